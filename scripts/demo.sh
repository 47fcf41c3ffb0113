#!/usr/bin/env bash
# The built-in CPU demo, from a fresh clone: venv + requirements, then DPO on a tiny OLMo 3 built locally.
#   bash scripts/demo.sh                 # -> outputs/smoke-dpo/ (model, metrics.jsonl, training_curves.png, ...)
#   bash scripts/demo.sh --max_steps 10  # any train_dpo.py override
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# A demo is repeatable: replace the previous demo run instead of refusing to write over it.
.venv/bin/python train_dpo.py --config configs/smoke.yaml --overwrite_output_dir "$@"
echo "Next (README, step 3 on): source .venv/bin/activate, then python scripts/analyze_dataset.py, python train_dpo.py"
