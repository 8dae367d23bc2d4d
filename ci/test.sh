#!/usr/bin/env bash
# The whole suite: install, assemble the embedded model, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh
.venv/bin/python -m handler.assemble_model model_store/smollm2-135m-instruct
exec .venv/bin/python -m pytest "$@"
