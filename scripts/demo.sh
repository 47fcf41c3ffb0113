#!/usr/bin/env bash
# The built-in CPU demo, from a fresh clone: venv + requirements, then DPO on a tiny OLMo 3 built locally.
#   bash scripts/demo.sh                 # -> outputs/smoke-dpo/ (model, metrics.jsonl, training_curves.png, ...)
#   bash scripts/demo.sh --max_steps 10  # any train_dpo.py override
# From another folder (bash ~/dpotrain/scripts/demo.sh): still outputs/smoke-dpo/ in the project; a relative path
# given on its command line (--output_dir my-demo, --accelerate_config my.yaml) is in the folder you ran it from.
set -euo pipefail
# It runs in the project (its venv, recipe and outputs/smoke-dpo), but a relative path on its command line is the
# user's, as a Slurm job's is (recipe/config.py): `bash ~/dpotrain/scripts/demo.sh --output_dir my-demo` wrote
# ~/dpotrain/my-demo, not ./my-demo.
export DPOTRAIN_SUBMIT_DIR=$PWD
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# train_dpo.py leaves a command line's accelerate_config to the launcher (launch.sh places a job's), which is this
# script here: a relative one is the user's file where it is in the folder they ran it from, as the other paths are.
placed() {
    if [[ $1 != /* && -f $DPOTRAIN_SUBMIT_DIR/$1 ]]; then
        printf '%s' "$DPOTRAIN_SUBMIT_DIR/$1"
    else
        printf '%s' "$1"
    fi
}
# A demo is repeatable: it replaces the previous demo run (outputs/smoke-dpo) instead of refusing to write over it.
# Sent to a folder of the user's choosing it does not: a finished run there (a real one, say) is refused, not replaced.
# A run name chooses one too (outputs/<run_name>): `--run_name think-dpo` replaced configs/think.yaml's finished run.
replace=(--overwrite_output_dir) args=() engine=
for arg in "$@"; do
    if [[ -n $engine ]]; then
        arg=$(placed "$arg") engine=
    else
        case "$arg" in
            --output_dir | --output_dir=* | --output-dir | --output-dir=*) replace=() ;;
            --run_name | --run_name=* | --run-name | --run-name=*) replace=() ;;
            --accelerate_config | --accelerate-config) engine=1 ;;
            --accelerate_config=* | --accelerate-config=*) arg=${arg%%=*}=$(placed "${arg#*=}") ;;
        esac
    fi
    args+=("$arg")
done
.venv/bin/python train_dpo.py --config configs/smoke.yaml "${replace[@]}" "${args[@]}"
echo "Next (README, step 3 on): source .venv/bin/activate, then python scripts/analyze_dataset.py, python train_dpo.py"
