#!/usr/bin/env bash
# Lease 1 rehearsed on the CPU with the lent GPU machine's own versions, before a lease spends device time on it:
# a Python 3.12 venv with what the machine's image has (torch 2.11, transformers 5.17, accelerate 1.15,
# huggingface_hub 1.33, ...: docs/gpu-benchmarks.md), the `core` carry folder installed over it as the lease installs
# it (`--no-deps --target`), then the lease's CPU trial on that interpreter. The project's venv and CI run torch 2.15
# and huggingface_hub 2.4; this is where a name only those have (an import, an argument) shows, in about a minute.
#   bash benchmarks/gpu_image_trial.sh [OUT] [PIECES]   # needs python3.12 and the package index (~3 GB the first time)
# With .whl/ds there (gpu_wheels.sh .whl ds) DeepSpeed is built and installed as lease 3 does: PIECES e2e-zero2 then runs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:-/tmp/dpotrain-image-trial}")
PIECES=${2:-tests,think-recipe,e2e-think,e2e-multiturn}
VENV=${GPU_IMAGE_VENV:-/tmp/dpotrain-image-venv}
SITE=$VENV-carried
PY312=${PYTHON312:-$(command -v python3.12 || true)}
# A pyenv shim is on PATH even where its global version is another: it is taken only if it runs.
[[ -x $PY312 ]] && "$PY312" -c '' 2>/dev/null || PY312=$(pyenv root 2>/dev/null)/versions/$(pyenv versions --bare 2>/dev/null | grep -m1 '^3\.12')/bin/python3.12
[[ -x $PY312 ]] || { echo "error: no python3.12 (the GPU machine's Python): install one, or set PYTHON312" >&2; exit 2; }

if [[ ! -x $VENV/bin/python ]]; then
  "$PY312" -m venv "$VENV"
  # The image's packages at its versions (tests/test_gpu_kit.py keeps the same list of what it has), and what
  # DeepSpeed imports that the image has (benchmarks/gpu_wheels.sh: all but hjson and pydantic, which `ds` carries).
  "$VENV/bin/pip" install -q "torch==2.11.0" "transformers==5.17.0" "accelerate==1.15.0" "huggingface_hub==1.33.0" \
    "tokenizers==0.23.2" peft safetensors pyarrow pandas xxhash matplotlib pytest einops msgpack ninja py-cpuinfo
fi
[[ -f .whl/core/SHA256SUMS ]] || bash benchmarks/gpu_wheels.sh .whl core
rm -rf "$SITE" && mkdir -p "$SITE"
# As gpu_lease.sh installs a carry folder: no index, no dependencies, into a folder of its own; the image's peft stays.
wheels=()
for wheel in .whl/core/*.whl; do [[ $(basename "$wheel") == peft-* ]] || wheels+=("$wheel"); done
"$VENV/bin/pip" install -q --no-index --no-deps --no-compile --target "$SITE" "${wheels[@]}"
if [[ -f .whl/ds/SHA256SUMS ]]; then  # DeepSpeed without its ops, against the image's torch, as lease 3 builds it
  "$VENV/bin/pip" install -q --no-index --no-deps --no-compile --target "$SITE" .whl/ds/*.whl
  DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$VENV/bin/pip" install -q --no-index --no-deps --no-compile --no-build-isolation \
    --target "$SITE" .whl/ds/deepspeed-*.tar.gz
fi
rm -rf "$OUT"
GPU_LEASE_CPU=1 GPU_LEASE_WORK="$OUT-work" PYTHON="$VENV/bin/python" PYTHONPATH="$SITE" \
  bash benchmarks/gpu_lease.sh "$OUT" 470 "$PIECES"
