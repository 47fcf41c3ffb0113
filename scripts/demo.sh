#!/usr/bin/env bash
# The built-in CPU demo, from a fresh clone: venv + requirements, then DPO on a tiny OLMo 3 built locally.
#   bash scripts/demo.sh                 # -> outputs/smoke-dpo/ (model, metrics.jsonl, training_curves.png, ...)
#   bash scripts/demo.sh --max_steps 10  # any train_dpo.py override
# From another folder (bash ~/dpotrain/scripts/demo.sh): still outputs/smoke-dpo/ in the project; a relative path
# given on its command line (--output_dir my-demo) is in the folder you ran it from.
set -euo pipefail
# It runs in the project (its venv, recipe and outputs/smoke-dpo), but a relative path on its command line is the
# user's, as a Slurm job's is (recipe/config.py): `bash ~/dpotrain/scripts/demo.sh --output_dir my-demo` wrote
# ~/dpotrain/my-demo, not ./my-demo.
export DPOTRAIN_SUBMIT_DIR=$PWD
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# A demo is repeatable: it replaces the previous demo run (outputs/smoke-dpo) instead of refusing to write over it.
# Sent to a folder of the user's choosing it does not: a finished run there (a real one, say) is refused, not replaced.
replace=(--overwrite_output_dir)
for arg in "$@"; do
    case "$arg" in --output_dir | --output_dir=* | --output-dir | --output-dir=*) replace=() ;; esac
done
.venv/bin/python train_dpo.py --config configs/smoke.yaml "${replace[@]}" "$@"
echo "Next (README, step 3 on): source .venv/bin/activate, then python scripts/analyze_dataset.py, python train_dpo.py"
