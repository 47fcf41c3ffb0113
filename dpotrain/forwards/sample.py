"""The pairs' lengths a run decides its forward from where the analyzer has not cached those of the whole training
split (docs/attention.md, "The lengths"; `stages.measure_lengths` reads the cache): a seeded sample of `SAMPLE_ROWS`
rows tokenized as the trainer tokenizes them. Every rank reads the same rows, so every rank takes the same decision.
"""

import numpy as np

from dpotrain.data import lengths
from dpotrain.forwards.cost import TokenCounts

SAMPLE_ROWS = 1024


def measured_sample(
    dataset, tokenizer, seed: int, hh_format: str = "messages", rows: int = SAMPLE_ROWS, every: bool = False
) -> tuple[TokenCounts, lengths.Measured | None, lengths.Measured]:
    """The lengths of `rows` rows of `dataset` (the pairs as the run read them: `rows.RowFormat.read`) drawn with
    `seed`, as the trainer tokenizes them (rows it could not tokenize left out), and every pair's lengths where they
    were measured: the sample is all of them (at most `rows` pairs), or `every` asks for them (a dry run's step plan
    reads every pair). Then the pairs are measured once and the sample is their seeded rows: each row's lengths are
    its own, whatever else is measured with it. Last, the pairs measured (every pair, or the sample's): what was
    tokenized, which `lengths.missing_bos` judges. `dataset` is loaded whole: the run never streams its pairs
    (options.check_options refuses dataset_streaming)."""
    total = len(dataset)
    indices = np.sort(np.random.default_rng(seed).choice(total, min(rows, total), False))
    if every or total <= rows:
        m = all_pairs = lengths.measure(
            dataset, tokenizer, num_proc=lengths.workers(dataset), skip_invalid=True, hh_format=hh_format, read=True
        )
    else:
        picked = dataset.select(indices)
        m, all_pairs = (
            lengths.measure(picked, tokenizer, skip_invalid=True, indices=indices, hh_format=hh_format, read=True),
            None,
        )
    keep = np.isin(m.index, indices)  # the sample's rows of every pair measured (all of them where only they were)
    of = f"a seeded sample of {min(rows, total):,} of {total:,} rows, tokenized as the trainer does"
    return TokenCounts(*(v[keep] for v in (m.prompt, m.chosen, m.rejected)), of, m.shared[keep]), all_pairs, m
