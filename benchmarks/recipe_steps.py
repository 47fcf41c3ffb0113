"""A recipe's own settings for a few steps, as `train_dpo.py` runs them: configs/think.yaml (samples at step 0, its
token budget, 128 pairs per step, the memory plan's checkpointing, the forward it decides) on OLMo 3 at 7B's layer
width with 4 layers and generated think-like pairs. What it shows: the run starts, samples, and trains with few
FlexAttention compilations (step-0 samples used to spend flex's recompile limit), and what its first steps cost.

    python benchmarks/recipe_steps.py --out results/think-recipe.json          # one GPU (gpu_all.sh's piece)
    python benchmarks/recipe_steps.py --out /tmp/think-recipe.json --tiny      # CPU: the tiny model, a minute

Only what cannot run here is changed: no W&B (report_to none), no checkpoints, max_steps; --tiny also: 8 pairs per
step, 16 new tokens per sample, the CPU.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def command(args, folder: Path) -> list[str]:
    flags = [
        "--config",
        str(ROOT / "configs" / f"{args.recipe}.yaml"),
        "--model_name_or_path",
        str(folder / "model"),
        "--dataset_name",
        str(folder / "pairs.jsonl"),
        "--output_dir",
        str(folder / "run"),
        "--max_steps",
        str(args.steps),
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        "--dataset_num_proc",
        "1",
    ]
    if args.tiny:
        flags += [
            "--use_cpu",
            "true",
            "--pairs_per_step",
            "8",
            "--sample_max_new_tokens",
            "16",
            "--dataloader_num_workers",
            "0",
        ]
    return [sys.executable, str(ROOT / "train_dpo.py"), *flags]


def summary(folder: Path, log: str, code: int, seconds: float) -> dict:
    """The run's own records: resolved_config.json (forward, memory plan, layers), metrics.jsonl, samples.jsonl."""
    run = folder / "run"
    resolved = json.loads((run / "resolved_config.json").read_text()) if (run / "resolved_config.json").exists() else {}
    derived = resolved.get("derived", resolved)
    metrics = (
        [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        if (run / "metrics.jsonl").exists()
        else []
    )
    samples = (
        [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
        if (run / "samples.jsonl").exists()
        else []
    )
    found = re.search(r"FlexAttention: (\d+) compilations this run", log)
    keep = ("step", "loss", "tokens_per_second_per_gpu", "mfu", "step_seconds")
    return {
        "exit_code": code,
        "seconds": round(seconds, 1),
        "forward": (derived.get("forward") or {}).get("layout"),
        "attention": (derived.get("forward") or {}).get("attention"),
        "memory_plan_gib": ((derived.get("memory") or {}).get("per_gpu_gib") or {}).get("total"),
        "checkpointing": (derived.get("memory") or {}).get("checkpointing"),
        "layers": derived.get("layers"),
        "reference": derived.get("reference"),
        "flex_compilations": int(found.group(1)) if found else None,
        "sample_steps": sorted({s["step"] for s in samples}),
        "steps": [{k: m[k] for k in keep if k in m} for m in metrics if "loss" in m],
        "log_tail": log.strip().splitlines()[-30:] if code else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write (the run's folder beside it)")
    parser.add_argument("--recipe", default="think", help="configs/<recipe>.yaml (default think)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of 7B width")
    parser.add_argument("--tiny", action="store_true", help="CPU: the 2-layer hidden-64 model")
    args = parser.parse_args()
    import torch

    if not args.tiny and not torch.cuda.is_available():
        sys.exit("error: no GPU here: run this on a GPU machine (docs/gpu-benchmarks.md), or --tiny on a CPU")
    import end_to_end

    folder = args.out.with_suffix("")
    folder.mkdir(parents=True, exist_ok=True)
    end_to_end.write_model(folder / "model", args.layers, args.tiny)
    per_step = 8 if args.tiny else 128
    scale = 480 / end_to_end.DATA["think"][0] if args.tiny else 1
    end_to_end.write_pairs(folder / "pairs.jsonl", "think", args.steps * per_step, scale)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DPOTRAIN_CACHE": str(folder / "cache"), "WANDB_MODE": "disabled"}
    start = time.perf_counter()
    result = subprocess.run(
        command(args, folder), env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    (folder / "run.log").write_text(result.stdout)
    record = summary(folder, result.stdout, result.returncode, time.perf_counter() - start)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "log_tail"}), flush=True)
    sys.exit(result.returncode)


if __name__ == "__main__":
    main()
