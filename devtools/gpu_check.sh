#!/bin/bash
# The lean engine's GPU checks (CUDA graphs, issue #32) in one device call, for a session that is lent a GPU.
#
#   bash devtools/gpu_check.sh prepare [BEFORE_REV]   # here: fills .device/ (ignored): wheels, the model's small
#                                                     # files, BEFORE_REV's code (default 5aa04da: before the graphs) for the before column
#   device run, carry [".device"]:  bash devtools/gpu_check.sh run
#
# On the device: the engine tests on CUDA (tests/integration/test_cuda_graphs.py, the transformers parity test),
# then bench.run at 1 and 16 clients: ours (the defaults: eager), option.enforce_eager=false (graphs), BEFORE_REV's code,
# into $OUT/results.md. The embedded model's 517 MB cannot travel (64 MiB a call): the device builds a stand-in with
# its config, tokenizer and template and random weights (devtools/standin_model.py): the same shapes and kernels.
set -u
case "${1:-}" in
prepare)
  grep -qx "/.device/" .git/info/exclude 2>/dev/null || echo "/.device/" >> .git/info/exclude
  rm -rf .device && mkdir -p .device/whl .device/model .device/before
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .device/whl transformers==5.23.0 llguidance==1.9.1 flask==3.1.3 \
    blinker==1.9.0 itsdangerous==2.2.0 gunicorn==27.0.1 pydantic==2.14.3 pydantic_core==2.50.4 \
    annotated-types==0.8.0 typing-inspection==0.4.5 werkzeug==3.1.9 typing-extensions==4.16.0 || exit 1
  cp model_store/smollm2-135m-instruct/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} \
    .device/model/ || exit 1
  git archive "${2:-5aa04da}" handler djl_python bench | tar -x -C .device/before
  du -sh .device ;;
run)
  export PYTHONUNBUFFERED=1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .device/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  mkdir -p model_store
  python3 devtools/standin_model.py .device/model model_store/smollm2-135m-instruct || exit 1
  ENGINE_TEST_DEVICE=cuda timeout "${PYTEST_S:-200}" python3 -m pytest -q -p no:cacheprovider \
    tests/integration/test_cuda_graphs.py "tests/integration/test_model.py::test_model_matches_transformers" 2>&1 \
    | tail -25 | tee "$OUT/pytest.txt"
  ln -sfn "$PWD/model_store" .device/before/model_store
  timeout "${BENCH_S:-330}" python3 -m bench.run --levels 1,16 --requests 3 --baseline-levels "" --rounds 1 \
    --variant graphs:OPTION_ENFORCE_EAGER=false --variant before:TREE=.device/before \
    --results "$OUT/results.md" 2>&1 | tail -40
  grep -h -i "graph\|warm-up\|load took" bench/out/server-*.log | head -20 ;;
*) echo "usage: bash devtools/gpu_check.sh prepare [BEFORE_REV] | run" >&2; exit 2 ;;
esac
