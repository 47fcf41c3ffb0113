"""Preflight: will DPO work on this model and data? The base model scores a seeded sample of pairs first.

    python scripts/preflight.py --config configs/think.yaml                     # 512 pairs, the recipe's seed
    python scripts/preflight.py --config configs/smoke.yaml --sample 128 --json pf.json --plot pf.png
    python scripts/preflight.py --config configs/instruct.yaml --model_name_or_path org/my-sft --max_length 2048
    python train_dpo.py --config configs/think.yaml --preflight                 # the same, with the defaults

Any train_dpo.py field is an override, as in training (on a machine without a GPU, bf16 is turned off). The base
model loads once (GPU if present, else CPU) and scores the sample through the project's own trainer, so tokenization,
truncation and forward are training's. Markdown goes to stdout; exit 0 for ok and warn, 3 for fail, 2 for bad input.
"""

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as `python scripts/preflight.py` from anywhere
from dpotrain.recipe import venv  # noqa: E402

with venv.entry_point(ROOT, command=__name__ == "__main__"):  # the project's venv, then .env, then torch
    from dpotrain import preflight
    from dpotrain.recipe import cli
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import run_command


def parse_own(argv):
    p = cli.Parser(
        prog="scripts/preflight.py",
        description="The base model's log-prob gap between chosen and rejected responses, and a verdict on the run. "
        "Options not listed here (--config, --model_name_or_path, --dataset_name, --max_length, ...) are train_dpo.py "
        "fields.",
        epilog=preflight.HELP_THRESHOLDS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--sample", type=int, default=preflight.DEFAULT_SAMPLE, help="pairs to score, drawn with --seed [512]"
    )
    p.add_argument(
        "--seed", type=int, help="seed of the sample and the recipe's (a mixture's draw) [the recipe's seed]"
    )
    # `~` expanded: after `--json=` a shell leaves it, and the check advised creating a folder named `~` here
    p.add_argument("--json", type=os.path.expanduser, help="write the report as JSON here")
    p.add_argument("--plot", type=os.path.expanduser, help="write a PNG histogram of the gaps here (.png)")
    return p.parse_known_args(argv)


def main(argv=None) -> int:
    if __name__ != "__main__":  # an importer (the tests); a command read it before its imports, once
        venv.load_env(ROOT)  # HF_TOKEN for gated models and data sets
    own, rest = parse_own(sys.argv[1:] if argv is None else argv)
    preflight.check_outputs(own.json, own.plot)  # before anything loads
    import torch

    if own.seed is not None:  # the recipe's seed too, as `train_dpo.py --preflight --seed N` takes it: launch.sh
        # passes the run's own flags here, and a run's `--seed 7` left a mixture drawn with the recipe's seed (other
        # rows than the run trains on, under a report that said seed 7)
        rest += ["--seed", str(own.seed)]
    if not torch.cuda.is_available() and not any(a.split("=")[0] in ("--bf16",) for a in rest):
        rest += ["--bf16", "false"]  # scoring on CPU: fp32 (the recipes' bf16 needs a GPU)
    return preflight.run(parse_args(rest), own.sample, own.seed, own.json, own.plot)


if __name__ == "__main__":
    run_command(main)
