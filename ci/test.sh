#!/usr/bin/env bash
# The whole suite: install, assemble the embedded model, run every test, then build and test the image.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh
.venv/bin/python -m handler.assemble_model model_store/smollm2-135m-instruct
.venv/bin/python handler/engine/model/kernels/build.py
.venv/bin/python -m handler.engine.prepare model_store/smollm2-135m-instruct
.venv/bin/python -m pytest "$@"
# The container as SageMaker runs it (podman; installs what it needs). SKIP_IMAGE_TEST=1 skips it locally.
if [ "${SKIP_IMAGE_TEST:-0}" != "1" ]; then
  bash ci/image_test.sh
fi
