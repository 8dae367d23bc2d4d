#!/usr/bin/env bash
# Codex CLI (@openai/codex from the npm registry: a launcher and its prebuilt Rust binary, ~400 MB unpacked) for
# tests/e2e/test_codex.py, installed into CODEX_DIR, a cache outside the clone (idempotent: nothing to do when the
# pinned version is there). Needs node and npm. Never part of `make serve` or `make test`'s setup.
set -euo pipefail
CODEX_DIR=${CODEX_DIR:-$HOME/.cache/sagemaker-llm/codex}
CODEX_VERSION=${CODEX_VERSION:?set CODEX_VERSION}
bin="$CODEX_DIR/node_modules/.bin/codex"
if [ -x "$bin" ] && [ "$("$bin" --version 2>/dev/null)" = "codex-cli $CODEX_VERSION" ]; then
  exit 0
fi
start=$(date +%s)
mkdir -p "$CODEX_DIR"
npm install --prefix "$CODEX_DIR" --no-audit --no-fund --no-save --loglevel=error "@openai/codex@$CODEX_VERSION"
"$bin" --version
echo "install_codex.sh: $CODEX_DIR ready in $(( $(date +%s) - start )) s ($(du -sh "$CODEX_DIR" | cut -f1))"
