"""The reference stage's steady tokens/s against the training loop's, in the same run (the issue's goal: >= 2.5x).

    python benchmarks/reference_speed.py --tiny            # the built-in tiny model, seconds of work (a test runs it)
    python benchmarks/reference_speed.py                   # CPU: OLMo 3-shaped 4-layer model, with and without
                                                           # activation checkpointing
    python benchmarks/reference_speed.py --device cuda     # a GPU: ~1.3B OLMo 3 shape, bf16, 4K pairs

Each run is `train_dpo.py` as a user runs it, in a fresh process with a fresh reference cache, so the stage scores
every pair its `--steps` optimizer steps train (steps x pairs per step of the generated pairs); then it trains them.
Both figures count the same tokens (every sequence of every pair,
whole: a shared prompt twice), over all processes, and both leave out their first unit of work:
- the reference stage: its steady speed after its first micro-batch (`derived.reference.train` in the run's
  resolved_config.json: warm-up, compilation and the first kernels apart);
- the training loop: the tokens of steps 2..N over their time, from metrics.jsonl (`num_tokens`, `tokens_per_second`,
  logged every step); step 1 holds the loop's own warm-up.
Printed per setting: both speeds, their ratio, the stage's warm-up and micro-batch count. Nothing is downloaded: the
model is built from a config, the tokenizer and data are generated (benchmarks/throughput.py's).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

GOAL = 2.5  # the reference stage's steady tokens/s over the training loop's (issue 25)

MODES = {
    # shape (benchmarks/throughput.py's SHAPES, or the built-in tiny model), pairs, max_length, token budget, steps
    "tiny": dict(shape="tiny", pairs=64, max_length=512, budget=2048, steps=3, pairs_per_step=8, bf16=False),
    "cpu": dict(shape="small", pairs=256, max_length=1024, budget=4096, steps=8, pairs_per_step=16, bf16=False),
    "cuda": dict(shape="1b", pairs=2048, max_length=4096, budget=32768, steps=12, pairs_per_step=64, bf16=True),
}


def training_speed(metrics_path: Path) -> tuple[float, int]:
    """Steady tokens/s of the training loop (steps 2..N: tokens over time), and the steps it covers."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    records = [r for r in records if "tokens_per_second" in r and r.get("tokens_per_second")]
    tokens, seconds, before = 0, 0.0, None
    for r in records:
        done = r["num_tokens"] - (before if before is not None else 0)
        if before is not None:  # the first logged step holds the loop's warm-up
            tokens += done
            seconds += done / r["tokens_per_second"]
        before = r["num_tokens"]
    if not seconds:
        raise SystemExit(f"{metrics_path}: fewer than 2 logged steps; raise --steps")
    return tokens / seconds, len(records) - 1


def run_once(mode: dict, model: str, data: Path, folder: Path, checkpointing: bool, device: str) -> dict:
    out, cache = folder / "out", folder / "cache"
    cmd = [
        sys.executable,
        str(ROOT / "train_dpo.py"),
        "--config",
        str(ROOT / "configs" / "smoke.yaml"),
        "--model_name_or_path",
        model,
        "--dataset_name",
        str(data),
        "--output_dir",
        str(out),
        "--max_length",
        str(mode["max_length"]),
        "--max_tokens_per_microbatch",
        str(mode["budget"]),
        "--pairs_per_step",
        str(mode["pairs_per_step"]),
        "--max_steps",
        str(mode["steps"]),
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--health_checks",
        "false",
        "--activation_checkpointing",
        str(checkpointing).lower(),
        "--bf16",
        str(mode["bf16"]).lower(),
    ]
    env = {**os.environ, "DPOTRAIN_CACHE": str(cache)}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        raise SystemExit(f"train_dpo.py failed:\n{result.stdout[-4000:]}")
    derived = json.loads((out / "resolved_config.json").read_text())["derived"]
    stage = derived["reference"]["train"]
    train, steps = training_speed(out / "metrics.jsonl")
    return {
        "activation_checkpointing": checkpointing,
        "reference_tokens_per_second": stage["tokens_per_second"],
        "reference_warmup_seconds": stage["warmup_seconds"],
        "reference_micro_batches": stage["micro_batches"],
        "training_tokens_per_second": round(train, 1),
        "training_steps_measured": steps,
        "ratio": round(stage["tokens_per_second"] / train, 2),
        "forward": derived["forward"]["layout"] + " on " + derived["forward"]["attention"],
    }


def make_inputs(mode: dict, folder: Path, data_set: str) -> tuple[str, Path]:
    from throughput import DATA_SETS, build_model

    from dpotrain.data import builtin

    if mode["shape"] == "tiny":
        model = builtin.materialize_model("builtin:tiny-olmo3")
        rows = builtin.make_preference_rows(mode["pairs"], seed=7)
    else:
        model = str(folder / "model")
        build_model(Path(model), mode["shape"], 100278 if mode["shape"] == "1b" else None)
        rows = DATA_SETS[data_set](mode["pairs"], seed=0)
    data = folder / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, data


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the built-in tiny model, seconds of work (a smoke test)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--data-set", choices=["dolci", "multiturn"], default="dolci")
    parser.add_argument(
        "--checkpointing",
        choices=["both", "on", "off"],
        default="both",
        help="activation checkpointing in training (the stage never checkpoints)",
    )
    parser.add_argument("--pairs", type=int, help="override the mode's pair count")
    parser.add_argument("--steps", type=int, help="override the mode's optimizer steps")
    args = parser.parse_args(argv)
    mode = dict(MODES["tiny" if args.tiny else args.device])
    mode.update({k: v for k, v in (("pairs", args.pairs), ("steps", args.steps)) if v})
    settings = {"both": [False, True], "on": [True], "off": [False]}[args.checkpointing]
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} CPUs, python {platform.python_version()}; "
        f"load average {os.getloadavg()[0]:.1f}; mode {mode}",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="dpotrain-refspeed-") as tmp:
        model, data = make_inputs(mode, Path(tmp), args.data_set)
        for checkpointing in settings:
            r = run_once(mode, model, data, Path(tmp) / f"ckpt-{checkpointing}", checkpointing, args.device)
            results.append(r)
            print(
                f"activation checkpointing {'on ' if checkpointing else 'off'}: reference stage "
                f"{r['reference_tokens_per_second']:,.0f} tokens/s (warm-up {r['reference_warmup_seconds']:.1f} s, "
                f"{r['reference_micro_batches']} micro-batches), training loop "
                f"{r['training_tokens_per_second']:,.0f} tokens/s (steps 2-{r['training_steps_measured'] + 1}): "
                f"{r['ratio']:.2f}x (goal {GOAL}x); {r['forward']}",
                flush=True,
            )
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
