"""Analyzer speed: the batched path against the one-row-at-a-time loop, on a synthetic Think-sized data set.

    python benchmarks/analyzer_speed.py                         # 150k rows: subset comparison, then the full run
    python benchmarks/analyzer_speed.py --rows 20000 --no-full  # quick: the comparison only

The data set is shaped like Dolci-Think-DPO-7B as the seed report measured it (total median ~2.1k tokens, p90 ~9k,
p95 ~14k; prompt median ~114; chosen longer than rejected), sized in tokens of the built-in tiny tokenizer: text is
cut from a pool of words at a measured characters-per-token rate. It is written once as Parquet under --out and
reused. Both paths run on the same rows in the same run, and must give the same lengths.
"""

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=150_000, help="rows in the synthetic data set")
    p.add_argument("--subset", type=int, default=2_000, help="rows both paths measure for the rows/s comparison")
    p.add_argument("--num-proc", type=int, default=None, help="processes for the batched path [all CPUs]")
    p.add_argument("--out", default="/tmp/dpotrain-bench", help="where the data set and its Arrow cache go")
    p.add_argument("--no-full", action="store_true", help="skip the full-data-set run")
    return p.parse_args(argv)


def make_dataset(path: Path, rows: int, tokenizer, seed: int = 0) -> None:
    """Think-like pairs: lognormal lengths (correlated chosen/rejected), text cut from a shuffled word pool."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dpotrain.data import builtin

    rng = np.random.default_rng(seed)
    words = " ".join(builtin._FACTS + builtin._TOPICS + builtin._SLOPPY).split() + [str(i) for i in range(100)]
    pool = " ".join(rng.choice(words, size=4_000_000)) + " "
    chars_per_token = len(pool[:200_000]) / len(tokenizer(pool[:200_000], add_special_tokens=False)["input_ids"])

    def text(tokens: float) -> str:
        size = max(int(tokens * chars_per_token), 1)
        start = pool.index(" ", int(rng.integers(0, len(pool) - size - 1000))) + 1
        return pool[start : start + size]

    # Parameters fitted so that prompt + max(chosen, rejected) matches the seed's percentiles (see module doc).
    z1 = rng.standard_normal(rows)
    z2 = 0.8 * z1 + 0.6 * rng.standard_normal(rows)
    prompt = np.minimum(rng.lognormal(np.log(114), 1.18, rows), 6_000)
    chosen = np.minimum(np.exp(np.log(1_600) + 1.25 * z1), 30_000)
    rejected = np.minimum(np.exp(np.log(1_600 * 0.62) + 1.3 * z2), 30_000)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = None
    for start in range(0, rows, 5_000):
        batch = {"chosen": [], "rejected": []}
        for i in range(start, min(start + 5_000, rows)):
            messages = [{"role": "user", "content": text(prompt[i])}]
            if i % 10 == 3:
                messages.insert(0, {"role": "system", "content": "You are a careful assistant. Think first."})
            batch["chosen"].append(messages + [{"role": "assistant", "content": text(chosen[i])}])
            batch["rejected"].append(messages + [{"role": "assistant", "content": text(rejected[i])}])
        table = pa.Table.from_pydict(batch)
        writer = writer or pq.ParquetWriter(path, table.schema, compression="zstd")
        writer.write_table(table)
    writer.close()


def timed(measure, *args, **kwargs):
    """(result, wall seconds, CPU seconds of this process and its finished workers, 1-min load average before).

    The machine may be shared: CPU seconds / cores is what the wall time would be on free cores."""
    import resource

    def cpu() -> float:
        return sum(
            u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        )

    load = os.getloadavg()[0]
    wall, used = time.perf_counter(), cpu()
    result = measure(*args, **kwargs)
    return result, time.perf_counter() - wall, cpu() - used, load


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    os.environ.setdefault("HF_DATASETS_CACHE", str(out / "hf-datasets"))  # before datasets is imported
    import numpy as np

    from dpotrain.data import data, lengths

    tokenizer = lengths.load_tokenizer("builtin:tiny-olmo3")
    num_proc = args.num_proc or lengths.available_cpus()
    path = out / f"think_synth_{args.rows}.parquet"
    if not path.exists():
        start = time.perf_counter()
        make_dataset(path, args.rows, tokenizer)
        print(f"generated {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s")
    start = time.perf_counter()
    dataset = data.load_preference_dataset(str(path))
    load_s = time.perf_counter() - start

    subset = dataset.select(range(min(args.subset, len(dataset))))
    runs = {
        "one row at a time (reference), 1 process": timed(lengths.measure, subset, tokenizer, method="reference"),
        "batched, 1 process": timed(lengths.measure, subset, tokenizer, method="batched"),
        f"batched, {num_proc} processes": timed(
            lengths.measure, subset, tokenizer, method="batched", num_proc=num_proc
        ),
    }
    reference = next(iter(runs.values()))[0]
    for name, (m, *_) in runs.items():
        same = all(np.array_equal(getattr(m, k), getattr(reference, k)) for k in ("prompt", "chosen", "rejected"))
        assert same, f"{name} disagrees with the reference"
    cpus = lengths.available_cpus()
    tokens = int((3 * reference.prompt + reference.chosen + reference.rejected).sum())
    print(f"\n{len(subset):,}-row subset, {tokens / len(subset):,.0f} tokens tokenized per row, {cpus} CPUs;")
    print("every path gives the same lengths.\n")
    print("| Path | rows/s (wall) | rows per CPU-second | load before | 150k rows at this wall rate |")
    print("|---|---|---|---|---|")
    for name, (m, wall, cpu, load) in runs.items():
        minutes = 150_000 / (m.rows / wall) / 60
        print(f"| {name} | {m.rows / wall:,.0f} | {m.rows / cpu:,.0f} | {load:.1f} | {minutes:.1f} min |")

    if not args.no_full:
        m, wall, cpu, load = timed(lengths.measure, dataset, tokenizer, num_proc=num_proc, progress=True)
        tokens = int((3 * m.prompt + m.chosen + m.rejected).sum())  # what is tokenized: prompt 3x, each completion
        print(
            f"\nFull data set: {m.rows:,} rows in {wall:.0f} s wall ({m.rows / wall:,.0f} rows/s, "
            f"{tokens / wall / 1e6:.2f}M tokens/s) with {num_proc} processes, {cpu:.0f} CPU-s "
            f"(= {cpu / cpus:.0f} s on {cpus} free cores); load average {load:.1f} before, "
            f"{os.getloadavg()[0]:.1f} after; loading the Parquet file took {load_s:.0f} s."
        )
        print(
            f"Total length median {int(np.median(m.total)):,}, p90 {int(np.percentile(m.total, 90)):,}, "
            f"p95 {int(np.percentile(m.total, 95)):,} tokens; fast-path mismatches: {m.fast_path_mismatches}"
        )


if __name__ == "__main__":
    main()
