"""Pairs cut or dropped at max_length, counted once for training, the dry run and the analyzer.

TRL 1.16 (`DPOTrainer._prepare_dataset` and its collator): with `truncation_mode: keep_start` a pair whose prompt alone
fills max_length is dropped (no completion token would be left), and a sequence (prompt + chosen, prompt + rejected)
longer than max_length loses its end; `keep_end` drops nothing and cuts the start instead. A pair is counted as cut
when either of its sequences is. Training counts from the tokenized training set (`plan_stage.run_stage`), a dry run
and the analyzer from the analyzer's per-pair lengths: the same rows give the same counts.
"""

import numpy as np

from dpotrain.recipe.errors import ConfigError


def count(
    prompt, chosen, rejected, max_length: int | None, truncation_mode: str = "keep_start", dropped_before: int = 0
) -> dict:
    """{"max_length", "truncation_mode", "pairs", "truncated", "dropped"} for pairs of these token counts.
    `dropped_before`: pairs already removed by the trainer (training counts on its filtered data set)."""
    prompt, chosen, rejected = (np.asarray(a, dtype=np.int64) for a in (prompt, chosen, rejected))
    pairs = len(prompt) + dropped_before
    if max_length is None:
        return {"max_length": None, "truncation_mode": truncation_mode, "pairs": pairs, "truncated": 0, "dropped": 0}
    drop = prompt >= max_length if truncation_mode == "keep_start" else np.zeros(len(prompt), dtype=bool)
    longer = prompt + np.maximum(chosen, rejected) > max_length
    return {
        "max_length": int(max_length),
        "truncation_mode": truncation_mode,
        "pairs": int(pairs),
        "truncated": int(np.count_nonzero(longer & ~drop)),
        "dropped": int(np.count_nonzero(drop)) + dropped_before,
    }


def line(cuts: dict) -> str:
    """'max_length 1,024: 3 of 384 pairs cut (keep_start: their end), 1 dropped (its prompt alone fills max_length)'."""
    if cuts["max_length"] is None:
        return f"max_length unset: none of {cuts['pairs']:,} pairs cut or dropped"
    end = "their end" if cuts["truncation_mode"] == "keep_start" else "their start"
    return (
        f"max_length {cuts['max_length']:,}: {cuts['truncated']:,} of {cuts['pairs']:,} pairs cut "
        f"({cuts['truncation_mode']}: {end}), {cuts['dropped']:,} dropped (prompt alone fills "
        "max_length)"
    )


def check(cuts: dict, prompt, source: str) -> None:
    """Refuse a max_length that drops every pair (the trainer would be left with no data): say what length would do."""
    if cuts["pairs"] and cuts["dropped"] == cuts["pairs"]:
        shortest = int(np.min(prompt)) if len(prompt) else 0
        raise ConfigError(
            f"max_length {cuts['max_length']} drops every pair of {source}: each prompt alone fills it "
            f"(the shortest prompt is {shortest:,} tokens): use a larger max_length, or `auto` to let "
            "the analyzer choose (docs/max_length.md)"
        )
