#!/usr/bin/env bash
# Everything only a GPU can show, one step after another, each step's log in OUT_DIR (a step that fails is reported
# and the next one still runs): the GPU tests, the training-loop benchmark per forward, and the end-to-end benchmark
# against plain TRL, one process and under DeepSpeed ZeRO-2. About 30-60 minutes on one H100.
#   bash benchmarks/gpu_all.sh OUT_DIR
#   PYTHON=/usr/bin/python3 bash benchmarks/gpu_all.sh OUT_DIR      # a Python other than .venv's
# Set PYTHONPATH first when the packages were installed with benchmarks/gpu_setup.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:?usage: bash benchmarks/gpu_all.sh OUT_DIR}")
PYTHON=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python )}
mkdir -p "$OUT"
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'error: no CUDA GPU visible here')" \
  || exit 2

status=0
step() {  # step NAME COMMAND...: runs it, its output in OUT/NAME.log, one line of outcome
  local name=$1; shift
  local start=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  printf '%-22s exit %s, %ss (%s)\n' "$name" "$rc" "$((SECONDS - start))" "$OUT/$name.log" | tee -a "$OUT/summary.txt"
  (( rc == 0 )) || status=1
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
step pytest-gpu "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider
step attention-think "$PYTHON" benchmarks/attention.py --device cuda --data think
step attention-multiturn "$PYTHON" benchmarks/attention.py --device cuda --data multiturn
step end-to-end "$PYTHON" benchmarks/end_to_end.py --out "$OUT/end-to-end"
step end-to-end-zero2 "$PYTHON" benchmarks/end_to_end.py --out "$OUT/end-to-end-zero2" --engine zero2
echo "logs and results in $OUT (summary.txt; end-to-end*/results.md)"
exit $status
