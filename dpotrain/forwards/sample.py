"""The pairs' lengths a run decides its forward from, before the model loads (docs/attention.md, "The lengths"): the
analyzer's cached lengths of the whole training split (`cached`), else a seeded sample of `SAMPLE_ROWS` rows tokenized
as the trainer tokenizes them (`sampled`). Every rank reads the same rows, so every rank takes the same decision.
"""

import numpy as np

from dpotrain.data import cuts, lengths, mixture
from dpotrain.forwards.cost import TokenCounts

SAMPLE_ROWS = 1024


def cached(recipe, tokenizer) -> TokenCounts | None:
    """The analyzer's cached lengths of the recipe's training split, read from this machine only; None without."""
    try:
        dataset_id = mixture.dataset_id(recipe, local_only=True)
    except (OSError, ValueError):
        return None
    found = lengths.cached_measure(dataset_id, tokenizer)
    if found is None:
        return None
    m, report = found
    return TokenCounts(m.prompt, m.chosen, m.rejected, f"the analyzer's cached lengths ({report})", m.shared)


def sampled(dataset, tokenizer, seed: int, hh_format: str = "messages", rows: int = SAMPLE_ROWS) -> TokenCounts:
    """The lengths of `rows` rows of `dataset` drawn with `seed` (a streamed data set: its first rows), as the trainer
    tokenizes them; rows the trainer could not tokenize are left out."""
    return measured_sample(dataset, tokenizer, seed, hh_format, rows)[0]


def measured_sample(
    dataset, tokenizer, seed: int, hh_format: str = "messages", rows: int = SAMPLE_ROWS, every: bool = False
) -> tuple[TokenCounts, lengths.Measured | None, lengths.Measured]:
    """`sampled`, and every pair's lengths where they were measured: the sample is all of them (at most `rows` pairs),
    or `every` asks for them (a dry run's step plan reads every pair). Then the pairs are measured once and the sample
    is their seeded rows: each row's lengths are its own, whatever else is measured with it. Last, the pairs measured
    (every pair, or the sample's): what was tokenized, which `lengths.missing_bos` judges."""
    total = len(dataset) if hasattr(dataset, "__len__") else None
    indices = None if total is None else np.sort(np.random.default_rng(seed).choice(total, min(rows, total), False))
    whole = every or (total is not None and total <= rows)
    if whole:
        m = all_pairs = lengths.measure(
            dataset, tokenizer, num_proc=_workers(dataset), skip_invalid=True, hh_format=hh_format
        )
        keep = m.index < rows if indices is None else np.isin(m.index, indices)
        prompt, chosen, rejected, shared = (v[keep] for v in (m.prompt, m.chosen, m.rejected, m.shared))
        valid = int(keep.sum())
    else:
        picked = dataset.take(rows) if indices is None else dataset.select(indices)
        m, all_pairs = lengths.measure(picked, tokenizer, skip_invalid=True, indices=indices, hh_format=hh_format), None
        prompt, chosen, rejected, shared, valid = m.prompt, m.chosen, m.rejected, m.shared, m.rows
    of = f"the first {valid:,}" if total is None else f"a seeded sample of {min(rows, total):,} of {total:,}"
    return TokenCounts(prompt, chosen, rejected, f"{of} rows, tokenized as the trainer does", shared), all_pairs, m


def _workers(dataset) -> int:
    """A stream's length is unknown before it is read: measured in this process, as its sample was."""
    return lengths.workers(dataset) if hasattr(dataset, "__len__") else 1


def run_lengths(recipe, dataset, model_path: str) -> TokenCounts:
    """The lengths a real run decides from: cached for the whole split, else a seeded sample of `dataset`."""
    tokenizer = lengths.recipe_tokenizer(recipe, model_path)
    found = cached(recipe, tokenizer) or sampled(dataset, tokenizer, recipe.training.seed, recipe.project.hh_format)
    # A max_length that leaves the pairs nothing to learn: refused here, before the model loads.
    t = recipe.training
    if t.max_length is not None:
        cuts.check(
            found.prompt, found.chosen, found.rejected, found.shared, t.max_length, t.truncation_mode, found.source
        )
    return found
