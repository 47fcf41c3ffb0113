"""The think recipe's max_length: the analyzer's table on synthetic lengths fitted to Dolci-Think-DPO-7B's statistics.

    python benchmarks/think_lengths.py                # 150,000 pairs (the data set's size): fit check, then the table
    python benchmarks/think_lengths.py --rows 1000    # the seed's sample size: how much the numbers move

Dolci-Think-DPO-7B cannot be downloaded here. A report on the data set published, from 1,000 of its rows,
the percentiles and cumulative distribution of total length (prompt + longer completion) and the median and 95th
percentile of prompt, chosen and rejected. This draws per-pair (prompt, chosen, rejected) token counts, no text, that
reproduce them, and prints the analyzer's own report on them (`lengths.summarize`, `lengths_report.to_markdown`):

- prompt: lognormal with the published median and 95th percentile, independent of the completions;
- the longer completion: a quantile function, interpolated in (normal score, log tokens), calibrated so that prompt
  + longer completion passes through every published point of total length (p50/p90/p95/p99 and the cumulative
  table). Past p99 the seed says nothing: the p95-p99 slope continues, and a completion is capped at 32,768 tokens
  (an assumed generation limit; it moves only the rows beyond 24K);
- which side is the longer one, and the shorter one's length: chosen is the longer in 90% of pairs under 12,000
  tokens and 60% above (the rejected side's long tail), the shorter is the longer x Beta(5, 4). Fitted on a small
  grid to the component medians and 95th percentiles: within 6% (the fit check prints them).

Synthetic numbers: what they support is the shape of the trade-off, not Dolci's exact counts.
"""

import argparse
import sys
import time
from pathlib import Path
from statistics import NormalDist

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# That report, measured on 1,000 rows of allenai/Dolci-Think-DPO-7B.
TOTAL_CDF = {  # tokens: share of pairs whose prompt + longer completion is at most that
    2_048: 0.478,
    2_138: 0.50,
    4_096: 0.751,
    8_192: 0.877,
    9_194: 0.90,
    12_288: 0.928,
    15_433: 0.95,
    16_384: 0.958,
    24_834: 0.99,
}
TOTAL_PERCENTILES = {50: 2_138, 90: 9_194, 95: 15_433, 99: 24_834}
COMPONENTS = {"prompt": (114, 793), "chosen": (1_864, 11_903), "rejected": (1_154, 9_518)}  # median, p95
COMPLETION_CAP = 32_768
Z95 = NormalDist().inv_cdf(0.95)


def _knots() -> tuple[np.ndarray, np.ndarray]:
    """The published total-length points as (normal score, log tokens)."""
    z = np.array([NormalDist().inv_cdf(share) for share in TOTAL_CDF.values()])
    return z, np.log(np.array(list(TOTAL_CDF), dtype=float))


def _quantile(z: np.ndarray, knots_z: np.ndarray, knots_x: np.ndarray) -> np.ndarray:
    """Tokens at normal score `z`: piecewise linear in log tokens, the end segments' slopes continued outside."""
    below = np.polyfit(knots_z[:3], knots_x[:3], 1)[0]  # the three lowest points: the body's slope
    above = (knots_x[-1] - knots_x[-2]) / (knots_z[-1] - knots_z[-2])  # p95 -> p99
    x = np.interp(z, knots_z, knots_x)
    x = np.where(z < knots_z[0], knots_x[0] + below * (z - knots_z[0]), x)
    x = np.where(z > knots_z[-1], knots_x[-1] + above * (z - knots_z[-1]), x)
    return np.exp(x)


def _prompts(rng, rows: int) -> np.ndarray:
    median, p95 = COMPONENTS["prompt"]
    return np.maximum(rng.lognormal(np.log(median), np.log(p95 / median) / Z95, rows), 1)


def _longer_knots(iterations: int = 30, rows: int = 200_000) -> np.ndarray:
    """Log-token knots of the longer completion such that prompt + it has the published total percentiles
    (fixed-point iteration on a fixed calibration sample, so every --rows and --seed draws from one distribution)."""
    rng = np.random.default_rng(12345)
    z, prompt = rng.standard_normal(rows), _prompts(rng, rows)
    knots_z, target = _knots()
    knots = target.copy()
    shares = list(TOTAL_CDF.values())
    for _ in range(iterations):
        total = prompt + np.minimum(_quantile(z, knots_z, knots), COMPLETION_CAP)
        knots += target - np.log(np.quantile(total, shares))
    return knots


def synthetic_think_lengths(rows: int = 150_000, seed: int = 0):
    """(prompt, chosen, rejected) token counts of `rows` pairs, as a `lengths.Measured`."""
    from dpotrain.data.lengths import Measured

    rng = np.random.default_rng(seed)
    knots_z, _ = _knots()
    prompt = _prompts(rng, rows)
    longer = np.minimum(_quantile(rng.standard_normal(rows), knots_z, _longer_knots()), COMPLETION_CAP)
    shorter = np.maximum(longer * rng.beta(5, 4, rows), 1)
    chosen_longer = rng.random(rows) < np.where(longer < 12_000, 0.9, 0.6)
    as_int = lambda a: np.rint(a).astype(np.int64)  # noqa: E731
    return Measured(
        index=np.arange(rows),
        prompt=as_int(prompt),
        chosen=as_int(np.where(chosen_longer, longer, shorter)),
        rejected=as_int(np.where(chosen_longer, shorter, longer)),
        invalid=[],
        conversational=True,
    )


def fit_check(m) -> str:
    """The published numbers beside the synthetic ones."""
    total = m.total
    lines = ["| Statistic | Published (1,000 rows) | Synthetic |", "|---|---|---|"]
    for q, value in TOTAL_PERCENTILES.items():
        lines.append(f"| total p{q} | {value:,} | {int(np.percentile(total, q)):,} |")
    for tokens, share in TOTAL_CDF.items():
        if tokens % 1024 == 0:
            lines.append(f"| total <= {tokens:,} | {share:.1%} | {np.mean(total <= tokens):.1%} |")
    for name, (median, p95) in COMPONENTS.items():
        values = getattr(m, name)
        lines.append(f"| {name} median | {median:,} | {int(np.median(values)):,} |")
        lines.append(f"| {name} p95 | {p95:,} | {int(np.percentile(values, 95)):,} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    import yaml

    from dpotrain.data import lengths, lengths_report

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=150_000, help="pairs to draw [150,000: the data set's size]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--coverage", type=float, default=lengths.DEFAULT_COVERAGE, help="the analyzer's --coverage")
    p.add_argument("--candidates", type=int, nargs="*", default=[6144, 9216, 20480], help="extra max_length values")
    args = p.parse_args(argv)

    recipe = yaml.safe_load((ROOT / "configs" / "think.yaml").read_text())
    m = synthetic_think_lengths(args.rows, args.seed)
    print(f"## Synthetic Dolci-Think-DPO-7B lengths: {args.rows:,} pairs, seed {args.seed}\n")
    print(fit_check(m) + "\n")
    start = time.perf_counter()
    report = lengths.summarize(
        m,
        target=args.coverage,
        candidates=[*args.candidates, recipe["max_length"]],
        batch_size=int(recipe.get("per_device_train_batch_size", lengths.DEFAULT_BATCH_SIZE)),
        dataset="synthetic lengths fitted to Dolci-Think-DPO-7B (benchmarks/think_lengths.py)",
        synthetic=True,
    )
    seconds = time.perf_counter() - start
    print(lengths_report.to_markdown(report, recipe["max_length"]))
    print(f"(lengths.summarize on {m.rows:,} pairs: {seconds:.2f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
