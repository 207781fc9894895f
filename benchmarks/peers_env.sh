#!/usr/bin/env bash
# Builds the side environment of the benchmark's llama.cpp peer in DIR (default .peers-env):
#   DIR/bin/python         a venv with llama-cpp-python compiled from its sdist for this CPU, gguf, and what
#                          llama.cpp's HF -> GGUF converter imports (torch, transformers, sentencepiece, numpy)
#   DIR/converter/         convert_hf_to_gguf.py with its conversion/ and gguf-py/ folders, from the same sdist
#   DIR/versions.txt       what was installed (the benchmark copies it into its results file)
# llama-cpp-python is not a dependency of sublayer: the benchmark drives it in a separate process with DIR/bin/python.
# Usage: benchmarks/peers_env.sh [DIR]     (re-running skips a finished build; LLAMA_CPP_VERSION=x.y.z pins it)
set -euo pipefail
DIR=${1:-.peers-env}
PY=${PY:-python3}
STAMP="$DIR/.built"
if [[ -f "$STAMP" ]]; then echo "peers env ready: $DIR"; exit 0; fi
SPEC=llama-cpp-python${LLAMA_CPP_VERSION:+==$LLAMA_CPP_VERSION}
test -x "$DIR/bin/python" || "$PY" -m venv "$DIR"
PIP=("$DIR/bin/python" -m pip install --quiet)
# The sdist is fetched once: pip builds the extension from it and the converter is copied out of it.
mkdir -p "$DIR/sdist"
ls "$DIR"/sdist/llama_cpp_python-*.tar.gz >/dev/null 2>&1 ||
  "$DIR/bin/python" -m pip download --quiet --no-deps --no-binary :all: "$SPEC" -d "$DIR/sdist"
SDIST=$(ls "$DIR"/sdist/llama_cpp_python-*.tar.gz | head -1)
"${PIP[@]}" "torch==2.13.0" numpy sentencepiece "transformers>=4.40" safetensors gguf
# Native CPU build (AVX2/AVX-512 as the CPU has them); no multimodal library (LLAVA_BUILD), server, examples, tests.
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
"${PIP[@]}" --no-binary llama-cpp-python "$SDIST"
rm -rf "$DIR/converter" && mkdir -p "$DIR/converter"
tar xzf "$SDIST" -C "$DIR/converter" --strip-components=3 --wildcards \
  '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*'
"$DIR/bin/python" - > "$DIR/versions.txt" <<'PYEOF'
import importlib.metadata as md
for name in ("llama-cpp-python", "gguf", "torch", "transformers", "numpy"):
    print(f"{name}=={md.version(name)}")
import llama_cpp
print("llama.cpp system_info:", llama_cpp.llama_print_system_info().decode().strip())
PYEOF
touch "$STAMP"
echo "peers env ready: $DIR"; cat "$DIR/versions.txt"
