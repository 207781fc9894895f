#!/usr/bin/env bash
# Builds the side environment of the benchmark's OpenVINO peers in DIR (default .peers-env-ov), apart from the
# llama.cpp one (benchmarks/peers_env.sh), so that neither install can change the other's packages:
#   DIR/bin/python         a venv with openvino, openvino-genai, openvino-tokenizers, optimum-intel (its OpenVINO
#                          export: HF folder -> OpenVINO IR, int8 weights through nncf), torch (CPU), transformers
#   DIR/versions.txt       what was installed (the benchmark copies it into its results file)
# None of these is a dependency of sublayer: the benchmark drives them in a separate process with DIR/bin/python
# (src/sublayer/bench/openvino_worker.py).
# Usage: benchmarks/peers_env_openvino.sh [DIR]   (re-running skips a finished build; OPENVINO_VERSION=x.y.z pins it)
set -euo pipefail
DIR=${1:-.peers-env-ov}
PY=${PY:-python3}
STAMP="$DIR/.built"
if [[ -f "$STAMP" ]]; then echo "OpenVINO peers env ready: $DIR"; exit 0; fi
V=${OPENVINO_VERSION:-2026.4.1}
test -x "$DIR/bin/python" || "$PY" -m venv "$DIR"
# torch pinned to the CPU build (an unpinned torch pulls the CUDA one); genai and tokenizers follow openvino's version
"$DIR/bin/python" -m pip install --quiet "torch==2.13.0" "openvino==$V" "openvino-tokenizers~=${V%.*}.0" \
  "openvino-genai~=${V%.*}.0" "optimum-intel[openvino]==2.2.0" nncf numpy
# optimum-intel pulls PyPI's torchvision, built against the CUDA torch: its ops fail to register on the CPU torch
# and transformers, which imports torchvision when present, then fails to import its models; nothing here needs it
"$DIR/bin/python" -m pip uninstall --quiet --yes torchvision
"$DIR/bin/python" - > "$DIR/versions.txt" <<'PYEOF'
import importlib.metadata as md
for name in ("openvino", "openvino-genai", "openvino-tokenizers", "optimum-intel", "nncf", "torch", "transformers"):
    print(f"{name}=={md.version(name)}")
PYEOF
touch "$STAMP"
echo "OpenVINO peers env ready: $DIR"; cat "$DIR/versions.txt"
