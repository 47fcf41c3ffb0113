"""Synthetic per-pair token lengths shaped like the project's real data sets, for benchmarks that need no model.

`dolci_think(n)`: prompt, chosen and rejected lengths drawn from log-normal distributions fitted to the published
statistics of allenai/Dolci-Think-DPO-7B (1,000 rows: component medians 114 / 1,864 / 1,154 tokens and 95th
percentiles 793 / 11,903 / 9,518), which reproduces its heavy tail (a median pair of ~2k tokens, a tenth of the pairs
beyond 8k). `at_max_length(n, share)`: the same mix with `share` of the pairs pushed past max_length on both sides
(data where ~15% of pairs reach max_length). Synthetic: the numbers measured on them describe the plan, not Dolci.
"""

import math

import numpy as np

# (median, 95th percentile) of each component, Dolci-Think-DPO-7B (that report)
DOLCI_THINK = {"prompt": (114, 793), "chosen": (1864, 11903), "rejected": (1154, 9518)}


def _lognormal(rng, median: float, p95: float, n: int) -> np.ndarray:
    sigma = math.log(p95 / median) / 1.6449  # the 95th percentile of a normal is 1.645 sigma above its median
    return np.maximum(1, rng.lognormal(math.log(median), sigma, n)).astype(np.int64)


def dolci_think(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt, chosen, rejected) token counts of `n` Dolci-Think-like pairs."""
    rng = np.random.default_rng(seed)
    return tuple(_lognormal(rng, *DOLCI_THINK[part], n) for part in ("prompt", "chosen", "rejected"))


def at_max_length(n: int, max_length: int, share: float = 0.15, seed: int = 0):
    """Dolci-Think-like pairs, `share` of which are longer than `max_length` on both sides."""
    prompt, chosen, rejected = dolci_think(n, seed)
    rng = np.random.default_rng(seed + 1)
    long = rng.random(n) < share
    chosen[long] = np.maximum(chosen[long], max_length)
    rejected[long] = np.maximum(rejected[long], max_length)
    return prompt, chosen, rejected
