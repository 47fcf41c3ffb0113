"""A recipe's own settings for a few steps, as `train_dpo.py` runs them: configs/think.yaml (samples at step 0, its
token budget, 128 pairs per step, the memory plan's checkpointing, the forward it decides) on OLMo 3 at 7B's layer
width with 4 layers and generated think-like pairs (each answer opening with `<think>`, as the recipe's template
requires). What it shows: the run starts, samples, and trains with few FlexAttention compilations (step-0 samples used
to spend flex's recompile limit), what its first steps cost, its speed and its memory beside the plan.

    python benchmarks/recipe_steps.py --out /tmp/lease/think-recipe.json --model /tmp/lease/model   # one GPU
    python benchmarks/recipe_steps.py --out /tmp/think-recipe.json --tiny      # CPU: the tiny model, a minute

Only what cannot run here is changed: no W&B (report_to none), no checkpoints, max_steps; --tiny also: 4 pairs per
step, 16 new tokens per sample, the CPU. The final model is not wanted (a 7B-width fp32 model is 6.5 GB and 20-30 s of
writing): the run is ended as its final save begins, after training has logged every step. The JSON is rewritten as
each step is logged (a run cut off, by the lease's limit, keeps the steps it logged: `exit_code` null) and when the run
ends, however it ends.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

# What the JSON keeps of each logged step: speed, MFU and memory beside the plan.
KEEP = (
    "step",
    "loss",
    "num_tokens",
    "tokens_per_second",
    "tokens_per_second_per_gpu",
    "mfu",
    "memory/peak_allocated_gib",
    "memory/peak_reserved_gib",
    "memory/planned_gib",
    "memory/peak_rss_gib",
)


def command(args, folder: Path, model: Path) -> list[str]:
    flags = [
        "--config",
        str(ROOT / "configs" / f"{args.recipe}.yaml"),
        "--model_name_or_path",
        str(model),
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
            "4",
            "--sample_max_new_tokens",
            "16",
            "--dataloader_num_workers",
            "0",
        ]
    return [args.python, str(ROOT / "train_dpo.py"), *flags]


def jsonl(path: Path) -> list[dict]:
    """The records of a file the run appends to, read while it runs: a last line not yet ended is not read."""
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


def final_save_began(run: Path) -> bool:
    """The final save writes the model's config and weights at the top of the output folder (checkpoints are
    folders of their own, and there are none here)."""
    return (run / "config.json").exists() or any(run.glob("*.safetensors"))


def run_until_final_save(cmd: list[str], env: dict, log: Path, run: Path, progress=None) -> tuple[int, bool]:
    """The run, its output in `log`, ended (its whole process group) as soon as its final save begins: (exit code,
    whether it was ended there). `progress()` is called whenever the run logs a step."""
    metrics, seen = run / "metrics.jsonl", None
    with log.open("w") as out:
        process = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while process.poll() is None:
            if final_save_began(run):
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                return 0, True
            stamp = metrics.stat().st_mtime_ns if metrics.exists() else None
            if progress and stamp != seen:
                seen = stamp
                progress()
            time.sleep(0.2)
    return process.returncode, False


def summary(folder: Path, log: str, code: int | None, seconds: float, ended_at_save: bool) -> dict:
    """The run's own records: resolved_config.json (forward, memory plan, layers), metrics.jsonl, samples.jsonl.
    `code` None: the run is still going (what it has logged so far)."""
    run = folder / "run"
    resolved = json.loads((run / "resolved_config.json").read_text()) if (run / "resolved_config.json").exists() else {}
    derived = resolved.get("derived", resolved)
    steps = [{k: m[k] for k in KEEP if k in m} for m in jsonl(run / "metrics.jsonl") if "loss" in m]
    found = re.search(r"FlexAttention: (\d+) compilations this run", log)
    # Each step's seconds from its log (logging_steps 1): its tokens over its tokens/s (samples' time left out).
    before = 0
    for step in steps:
        step["step_seconds"] = round((step["num_tokens"] - before) / step["tokens_per_second"], 3)
        before = step["num_tokens"]
    seconds_of = [s["step_seconds"] for s in steps]
    steady = sorted(seconds_of[1:])[len(seconds_of[1:]) // 2] if len(seconds_of) > 1 else None
    peaks = [s["memory/peak_allocated_gib"] for s in steps if "memory/peak_allocated_gib" in s]
    reserved = [s["memory/peak_reserved_gib"] for s in steps if "memory/peak_reserved_gib" in s]
    memory = derived.get("memory") or {}
    plan = memory.get("per_gpu_gib") or {}
    return {
        "exit_code": code,
        "seconds": round(seconds, 1),
        "final_model": (
            "not saved (the run was ended as its final save began)"
            if ended_at_save
            else "not yet (the run is going on)"
            if code is None
            else "saved"
            if code == 0
            else f"not saved (the run ended with exit {code})"
        ),
        "forward": (derived.get("forward") or {}).get("layout"),
        "attention": (derived.get("forward") or {}).get("attention"),
        "memory_plan_gib": plan.get("total"),
        "memory_plan_allowance_gib": plan.get("cuda_context_and_fragmentation"),
        "checkpointing": memory.get("checkpointing"),
        "layers": derived.get("layers"),
        "reference": derived.get("reference"),
        "flex_compilations": int(found.group(1)) if found else None,
        "sample_steps": sorted({s["step"] for s in jsonl(run / "samples.jsonl")}),
        "first_step_s": seconds_of[0] if seconds_of else None,
        "steady_step_s": steady,
        "first_vs_steady": round(seconds_of[0] / steady, 2) if steady else None,
        "peak_allocated_gib": max(peaks) if peaks else None,
        "peak_reserved_gib": max(reserved) if reserved else None,
        "steps": steps,
        "log_tail": log.strip().splitlines()[-30:] if code else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write (the run's folder beside it)")
    parser.add_argument("--recipe", default="think", help="configs/<recipe>.yaml (default think)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of 7B width")
    parser.add_argument("--model", type=Path, default=None, help="a model written by end_to_end.py --write-model")
    parser.add_argument("--tiny", action="store_true", help="CPU: the 2-layer hidden-64 model")
    parser.add_argument("--python", default=sys.executable, help="the run's interpreter (gpu_lease.py's pieces')")
    args = parser.parse_args()
    import torch

    if not args.tiny and not torch.cuda.is_available():
        sys.exit("error: no GPU here: run this on a GPU machine (docs/gpu-benchmarks.md), or --tiny on a CPU")
    import end_to_end

    folder = args.out.with_suffix("")
    shutil.rmtree(folder / "run", ignore_errors=True)  # this script's own folder: a run of it before is not resumed
    folder.mkdir(parents=True, exist_ok=True)
    model = args.model or end_to_end.write_model(folder / "model", args.layers, args.tiny)
    per_step = 4 if args.tiny else 128
    scale = 480 / end_to_end.DATA["think"][0] if args.tiny else 1
    end_to_end.write_pairs(folder / "pairs.jsonl", "think", args.steps * per_step, scale, think_tag=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DPOTRAIN_CACHE": str(folder / "cache"), "WANDB_MODE": "disabled"}
    start = time.perf_counter()
    log = folder / "run.log"

    def save(code: int | None, ended: bool) -> dict:
        """The JSON replaced whole (a reader never sees half of it)."""
        record = summary(folder, log.read_text(), code, time.perf_counter() - start, ended)
        args.out.with_suffix(".partial").write_text(json.dumps(record, indent=2) + "\n")
        args.out.with_suffix(".partial").replace(args.out)
        return record

    def progress() -> None:
        try:
            save(None, False)
        except (OSError, ValueError, KeyError):  # a record being replaced as it was read: the next step reads it
            pass

    code, ended = run_until_final_save(command(args, folder, model), env, log, folder / "run", progress)
    record = save(code, ended)
    print(json.dumps({k: v for k, v in record.items() if k not in ("log_tail", "steps")}), flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
