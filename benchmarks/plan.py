"""Micro-batches and gradient reductions per optimizer step: the step plan (dpotrain/plan/plan.py) against the plan it
replaced, on Dolci-like lengths, at 4 to 256 GPUs. CPU only, no model: the plan needs only each pair's length.

    python benchmarks/plan.py                       # the table of BENCHMARKS.md
    python benchmarks/plan.py --pairs 4000 --worlds 4 16 64 256 --max-length 8192
    python benchmarks/plan.py --timing              # how long planning a Think-sized run takes, now and before

`--timing`: CPU seconds to plan one epoch of 150k Dolci-Think-like pairs with the think recipe's budget (65,536
positions, 128 pairs per step, max_length 16384, prompts shared), at 4, 64 and 256 GPUs (256 GPUs need 256 pairs a
step: fewer are refused), with plan.py as it is and as it was before planning was made fast (commit fdcbfa8, read
from git, each run in a process of its own stopped after --before-limit seconds).

For each data set (a Dolci-Think-like heavy-tailed mix, and the same with ~15% of pairs at max_length), each world size
and each token budget (the think recipe's 65,536, and 2 x max_length, the smallest allowed), it prints, per optimizer
step: the micro-batches each GPU runs (mean and max), what the step needs at least (the lower bound of plan.py's
`fewest_bins`), the empty micro-batches (each one crashed the old collator), and the padding the padded path (TRL's
collator, for models that cannot pack, its rows run in groups of similar length: dpotrain/forwards/padded.py) gets
under the
plan against TRL's own sampler and collator. "Before" is the plan as of
commit 8b35cc8 (dpotrain/batching.py), read from git; each ZeRO backward is one gradient reduction, so micro-batches
per step are reductions per step.
"""

import argparse
import importlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from lengths_like import at_max_length, dolci_think  # noqa: E402

from dpotrain.data.pair_lengths import PairLengths  # noqa: E402
from dpotrain.plan import plan  # noqa: E402

BEFORE = "8b35cc8"
SLOW_PLAN = "fdcbfa8"  # plan.py before it was made fast (tokens recomputed over every pair, per pair per step)


def plan_module(commit: str | None):
    """dpotrain/plan/plan.py as it is (None) or at `commit`, read from git."""
    if commit is None:
        return plan
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{commit}:dpotrain/plan/plan.py"], capture_output=True, text=True, check=True
    ).stdout
    folder = Path(tempfile.mkdtemp()) / "old_plan"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "plan.py").write_text(source.replace("from .errors import", "from dpotrain.errors import"))
    sys.path.insert(0, str(folder.parent))
    return importlib.import_module("old_plan.plan")


def time_planning(commit: str | None, pairs: int, world: int, epochs: int) -> float:
    """CPU seconds to plan `epochs` epochs of `pairs` Dolci-Think-like pairs on `world` GPUs, the think budget."""
    module = plan_module(commit)
    prompt, chosen, rejected = dolci_think(pairs)
    lengths = module.PairLengths.from_parts(prompt, chosen, rejected, 16384, share=True)
    start = time.process_time()
    module.plan_run(lengths, module.StepPlan(max(128, world), world, 42, 65536, None), epochs)
    return time.process_time() - start


def timing(args) -> None:
    import platform

    print(
        f"\n### Planning time: {args.pairs:,} Dolci-Think-like pairs, {args.epochs} epoch(s), budget 65,536, "
        f"max_length 16384, prompts shared; {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}\n"
    )
    print("| GPUs | pairs per step | before (CPU s) | now (CPU s) |")
    print("|---|---|---|---|")
    for world in args.worlds:
        now = time_planning(None, args.pairs, world, args.epochs)
        cmd = [sys.executable, __file__, "--time-one", SLOW_PLAN, str(args.pairs), str(world), str(args.epochs)]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.before_limit, check=True).stdout
            before = f"{float(out.split()[-1]):.2f}"
        except subprocess.TimeoutExpired:
            before = f"not done after {args.before_limit:.0f} s"
        print(f"| {world} | {max(128, world)} | {before} | {now:.2f} |", flush=True)
    print(
        f"\n(before = plan.py at {SLOW_PLAN}; command: python benchmarks/plan.py --timing --pairs {args.pairs} "
        f"--epochs {args.epochs} --worlds {' '.join(map(str, args.worlds))})"
    )


def old_batching():
    """dpotrain/batching.py as it was before the step plan, loaded from git."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{BEFORE}:dpotrain/batching.py"], capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "old_batching.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_batching", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pair_lengths(parts, max_length: int) -> PairLengths:
    prompt, chosen, rejected = parts
    kept = prompt < max_length  # TRL drops the pairs whose prompt alone fills max_length
    return PairLengths(np.minimum(prompt + chosen, max_length)[kept], np.minimum(prompt + rejected, max_length)[kept])


def before(old, lengths: PairLengths, pairs_per_step: int, world: int, budget: int) -> dict:
    costs = lengths.tokens
    p = old.plan(costs, pairs_per_step, world, 42, 1, budget, None)
    per_rank = [list(old.epoch_micro_batches(costs, p, 42, 0, r)) for r in range(world)]
    steps = len(old.steps_of(np.arange(len(costs)), pairs_per_step, world))
    empty = sum(1 for mbs in per_rank for mb in mbs if not mb)
    return {"mean": len(per_rank[0]) / steps, "max": p.micro_batches, "empty": empty}


def after(lengths: PairLengths, pairs_per_step: int, world: int, budget: int, padded=False) -> dict:
    p = plan.StepPlan(pairs_per_step, world, 42, budget, None, padded)
    try:
        epoch = plan.plan_run(lengths, p, 1)
    except plan.PlanError as refused:
        return {"refused": str(refused)}
    # the padded path runs its rows in groups of similar length (dpotrain/forwards/padded.py)
    s = plan.summary(lengths, p, epoch, plan.RowLayout("padded") if padded else None)
    per_step = s["micro_batches_per_step"]
    empty = sum(1 for step in epoch[0] for rank in step for mb in rank if not mb)
    return {
        "mean": per_step["mean"],
        "max": per_step["max"],
        "bound": per_step["lower_bound_mean"],
        "empty": empty,
        "padding": s["padding_share"],
    }


def trl_padding(lengths: PairLengths, per_device: int = 4) -> float:
    """TRL's padded micro-batches: the sampler's random order, per_device pairs, padded to their longest sequence."""
    order = np.random.default_rng(0).permutation(len(lengths))
    real = padded = 0
    for i in range(0, len(order), per_device):
        mb = order[i : i + per_device]
        real += int(lengths.tokens[mb].sum())
        padded += 2 * len(mb) * int(lengths.longest[mb].max())
    return 1 - real / padded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=4000)
    parser.add_argument("--pairs-per-step", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=8192)
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--budgets", type=int, nargs="+", default=None, help="default: 65536 and 2 x max-length")
    parser.add_argument("--timing", action="store_true", help="planning time of a Think-sized run, now and before")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--before-limit", type=float, default=600, help="seconds before the old plan is stopped")
    if sys.argv[1:2] == ["--time-one"]:  # one timing in a process of its own (the old plan can run for hours)
        commit, pairs, world, epochs = sys.argv[2], *map(int, sys.argv[3:6])
        print(time_planning(commit, pairs, world, epochs))
        return
    args = parser.parse_args()
    if args.timing:
        args.pairs = args.pairs if "--pairs" in sys.argv else 150_000
        return timing(args)
    budgets = args.budgets or [65536, 2 * args.max_length]
    old = old_batching()
    sets = {
        "Dolci-Think-like": dolci_think(args.pairs),
        "15% at max_length": at_max_length(args.pairs, args.max_length),
    }
    for name, parts in sets.items():
        lengths = pair_lengths(parts, args.max_length)
        print(f"\n### {name}: {len(lengths)} pairs, max_length {args.max_length}, {args.pairs_per_step} pairs per step")
        print(f"TRL's padded micro-batches of 4 pairs (random order): {100 * trl_padding(lengths):.1f}% padding\n")
        print(
            "| GPUs | budget | before: micro-batches per step (mean / max) | before: empty | after: mean / max "
            "| after: lower bound | after: empty | padded path: padding |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for world in args.worlds:
            for budget in budgets:
                if args.pairs_per_step < world:
                    refused = after(lengths, args.pairs_per_step, world, budget)["refused"]
                    print(f"| {world} | {budget:,} | - | - | refused: {refused.split(':')[0]} | | | |")
                    continue
                b, a = (
                    before(old, lengths, args.pairs_per_step, world, budget),
                    after(lengths, args.pairs_per_step, world, budget),
                )
                padded = after(lengths, args.pairs_per_step, world, budget, padded=True)
                if "refused" in a:
                    print(
                        f"| {world} | {budget:,} | {b['mean']:.2f} / {b['max']} | {b['empty']} | refused: "
                        f"{a['refused'][:80]}... | | | |"
                    )
                    continue
                pad = f"{100 * padded['padding']:.1f}%" if "padding" in padded else "refused"
                print(
                    f"| {world} | {budget:,} | {b['mean']:.2f} / {b['max']} | {b['empty']} | {a['mean']:.2f} / "
                    f"{a['max']} | {a['bound']:.2f} | {a['empty']} | {pad} |"
                )
    print(f"\n(before = {BEFORE}: the largest count any step needs, on every step; after: each step its own count)")


if __name__ == "__main__":
    main()
