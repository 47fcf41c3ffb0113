#!/usr/bin/env bash
# Everything only a GPU can show, as a list of pieces, each its own command under `timeout` (9 minutes: one piece fits
# one 10-minute command on a lent GPU), each writing its JSON under OUT_DIR and its log beside it. Resumable: a piece
# whose JSON exists is finished and skipped, so the same command continues where a lost machine stopped. A piece that
# fails or runs out of time is reported and the next one still runs. docs/gpu-benchmarks.md says which piece answers
# which goal. Minutes are estimates for one H100 at 7B layer width with 4 layers, from the runs measured there before.
#   bash benchmarks/gpu_all.sh OUT_DIR --dry-run       # the pieces, their minutes and commands, which are finished
#   bash benchmarks/gpu_all.sh OUT_DIR                 # every piece not finished yet, in order
#   bash benchmarks/gpu_all.sh OUT_DIR --next          # only the first piece not finished (one 10-minute command)
#   bash benchmarks/gpu_all.sh OUT_DIR --only NAME     # that piece (again, if finished: remove its JSON first)
#   PYTHON=/usr/bin/python3 bash benchmarks/gpu_all.sh OUT_DIR      # a Python other than .venv's
# Set PYTHONPATH first when the packages were installed with benchmarks/gpu_setup.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash benchmarks/gpu_all.sh OUT_DIR [--dry-run | --next | --only NAME]"
OUT=$(realpath -m "${1:?$usage}")
MODE=${2:-all}
ONLY=${3:-}
case $MODE in
  all|--dry-run|--next) ;;
  --only) [[ -n $ONLY ]] || { echo "error: --only needs a piece's name (--dry-run lists them)" >&2; exit 2; } ;;
  *) echo "error: unknown option $MODE; $usage" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python )}
LIMIT_S=${LIMIT_S:-540}  # per piece
E2E=(--layers 4 --steps 4 --paths trl project)  # plain TRL against the project's own choice of forward

# name|minutes|the JSON it writes (relative to OUT)|command (OUT, PYTHON expanded when it runs)
PIECES=(
  "probe|2|probe.json|\$PYTHON benchmarks/gpu_probe.py --out \$OUT/probe.json"
  "pytest-gpu|6|pytest-gpu.json|\$PYTHON benchmarks/gpu_tests.py --out \$OUT/pytest-gpu.json -- -k 'not shipped_recipe'"
  "pytest-gpu-recipes|8|pytest-gpu-recipes.json|\$PYTHON benchmarks/gpu_tests.py --out \$OUT/pytest-gpu-recipes.json -- -k shipped_recipe"
  "think-recipe|5|think-recipe.json|\$PYTHON benchmarks/recipe_steps.py --recipe think --steps 3 --out \$OUT/think-recipe.json"
  "attention-think|6|attention-think.json|\$PYTHON benchmarks/attention.py --device cuda --data think --layers 4 --budget 32768 --out \$OUT/attention-think.json"
  "attention-multiturn|5|attention-multiturn.json|\$PYTHON benchmarks/attention.py --device cuda --data multiturn --layers 4 --budget 32768 --out \$OUT/attention-multiturn.json"
  "e2e-think|7|e2e-think/results.json|\$PYTHON benchmarks/end_to_end.py --data think ${E2E[*]} --out \$OUT/e2e-think"
  "e2e-multiturn|6|e2e-multiturn/results.json|\$PYTHON benchmarks/end_to_end.py --data multiturn ${E2E[*]} --out \$OUT/e2e-multiturn"
  "e2e-zero2|8|e2e-zero2/results.json|\$PYTHON benchmarks/end_to_end.py --engine zero2 --data think ${E2E[*]} --out \$OUT/e2e-zero2"
)

if [[ $MODE == --dry-run ]]; then
  total=0
  for piece in "${PIECES[@]}"; do
    IFS='|' read -r name minutes result cmd <<< "$piece"
    state="to run"; [[ -f $OUT/$result ]] && state="finished ($OUT/$result)"
    printf '%-20s ~%s min  %s\n  %s\n' "$name" "$minutes" "$state" "$cmd"
    total=$((total + minutes))
  done
  echo "~$total min in all, at most $((LIMIT_S / 60)) min per piece (timeout ${LIMIT_S}s)"
  exit 0
fi

"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'error: no CUDA GPU visible here')" \
  || exit 2
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
status=0
ran=0
for piece in "${PIECES[@]}"; do
  IFS='|' read -r name minutes result cmd <<< "$piece"
  [[ $MODE == --only && $name != "$ONLY" ]] && continue
  if [[ -f $OUT/$result && $MODE != --only ]]; then
    echo "$name: finished ($OUT/$result), skipped"
    continue
  fi
  start=$SECONDS
  # a fresh process group under timeout: the piece's children (accelerate's workers) end with it
  OUT=$OUT PYTHON=$PYTHON timeout --kill-after=30 "$LIMIT_S" bash -c "$cmd" > "$OUT/$name.log" 2>&1
  rc=$?
  outcome="exit $rc"; (( rc == 124 || rc == 137 )) && outcome="timed out after ${LIMIT_S}s"
  [[ -f $OUT/$result ]] || outcome="$outcome, no $result: not finished"
  printf '%-20s %s, %ss (expected ~%s min; %s)\n' "$name" "$outcome" "$((SECONDS - start))" "$minutes" \
    "$OUT/$name.log" | tee -a "$OUT/summary.txt"
  (( rc == 0 )) || status=1
  ran=1
  [[ $MODE == --next ]] && break
done
[[ $MODE == --only && $ran == 0 ]] && { echo "error: no piece named $ONLY (--dry-run lists them)" >&2; exit 2; }
(( ran )) || echo "every piece is finished: results in $OUT (remove a piece's JSON to run it again)"
echo "logs and results in $OUT (summary.txt; e2e-*/results.md)"
exit $status
