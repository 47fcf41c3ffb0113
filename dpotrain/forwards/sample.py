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
    total = len(dataset) if hasattr(dataset, "__len__") else None
    if total is None:
        picked, indices = dataset.take(rows), None
    else:
        indices = np.sort(np.random.default_rng(seed).choice(total, min(rows, total), replace=False))
        picked = dataset.select(indices)
    m = lengths.measure(picked, tokenizer, num_proc=1, skip_invalid=True, indices=indices, hh_format=hh_format)
    of = f"the first {m.rows:,}" if total is None else f"a seeded sample of {min(rows, total):,} of {total:,}"
    return TokenCounts(m.prompt, m.chosen, m.rejected, f"{of} rows, tokenized as the trainer does", m.shared)


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
