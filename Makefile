# The two commands a newcomer needs: `make serve` and `make test`.
PY := .venv/bin/python
MODEL := model_store/smollm2-135m-instruct
PORT ?= 8080

.PHONY: serve test venv model bench fmt lint clean image image-test

serve: venv model  ## serve the embedded model on :8080 (SAGEMAKER_BIND_TO_PORT overrides)
	$(PY) -m handler serve

test:  ## the whole suite (installs and assembles what it needs)
	bash ci/test.sh

venv:
	bash ci/install.sh

model: venv  ## assemble the embedded default model (idempotent)
	$(PY) -m handler.assemble_model $(MODEL)

bench: venv model  ## throughput / latency benchmark against a naive baseline
	$(PY) -m bench.run

fmt: venv
	$(PY) -m ruff format handler tests bench devtools

lint: venv
	$(PY) -m ruff check handler tests bench devtools

image:  ## build the serving image with podman (as root; installs podman, base image, wheelhouse when missing)
	bash ci/image.sh

image-test:  ## build the image, run it as SageMaker does, check /ping, requests and a clean SIGTERM stop
	bash ci/image_test.sh

clean:
	rm -rf .venv $(MODEL)
