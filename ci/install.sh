#!/usr/bin/env bash
# Create the virtual environment from the pinned requirement files (idempotent: a stamp records what was installed).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
stamp="$VENV/.requirements.sha256"
want=$(cat requirements.txt requirements-dev.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# torch==2.13.0 (pinned in requirements.txt) resolves to the CPU wheel on this machine's local disk.
"$VENV/bin/pip" install --quiet --disable-pip-version-check -r requirements-dev.txt
echo "$want" > "$stamp"
