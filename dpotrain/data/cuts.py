"""Pairs cut or dropped at max_length, counted once for training, the dry run and the analyzer.

TRL 1.16 (`DPOTrainer._prepare_dataset` and its collator): with `truncation_mode: keep_start` a pair whose prompt alone
fills max_length is dropped, and a sequence longer than max_length loses its end; `keep_end` drops nothing and cuts
the start instead. A pair is cut when either of its sequences is.
"""

import math

import numpy as np

from dpotrain.recipe.config import ProjectArguments
from dpotrain.recipe.errors import ConfigError

STEP = 512  # max_length is recommended as a multiple of this: kernel- and memory-friendly shapes
COVERAGE = ProjectArguments.auto_coverage  # the share of pairs left whole a recommendation aims at (the analyzer's)
TEACHING = 0.5  # a run is refused when fewer than this share of its pairs keep anything to learn after the cut


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
    return f"max_length {cuts['max_length']:,}: {counts(cuts)}"


def counts(cuts: dict) -> str:
    """'3 of 384 pairs cut (keep_start: their end), 1 dropped (prompt alone fills max_length)'."""
    end = "their end" if cuts["truncation_mode"] == "keep_start" else "their start"
    return (
        f"{cuts['truncated']:,} of {cuts['pairs']:,} pairs cut ({cuts['truncation_mode']}: {end}), "
        f"{cuts['dropped']:,} dropped (prompt alone fills max_length)"
    )


def recommend(total: np.ndarray, target: float) -> int:
    """The smallest multiple of `STEP` whose coverage reaches `target` (`total`: prompt + longer completion)."""
    if len(total) == 0:
        raise ConfigError("no valid rows to choose max_length from")
    lengths = STEP * np.arange(1, math.ceil(int(total.max()) / STEP) + 1)
    covered = np.searchsorted(np.sort(total), lengths, side="right") / len(total)
    return int(lengths[np.argmax(covered >= target)])


def drops(prompt, max_length: int, truncation_mode: str):
    """Which pairs the trainer drops at `max_length`: under keep_start, those whose prompt alone fills it (keep_end
    keeps the prompt's end, and drops none)."""
    prompt = np.asarray(prompt)
    return prompt >= max_length if truncation_mode == "keep_start" else np.zeros(len(prompt), dtype=bool)


def teaching(prompt, shared, max_length: int, truncation_mode: str) -> tuple[int, int, int]:
    """(pairs that keep a difference at `max_length`, pairs dropped, pairs cut until both sides are the same): under
    keep_start cut inside the start both completions share, under keep_end inside the end both sequences share (pairs
    whose answers differ only early, or a max_length shorter than the template's closing tokens)."""
    dropped = int(np.count_nonzero(drops(prompt, max_length, truncation_mode)))
    same = 0
    if shared is not None and len(prompt):  # `lengths.Measured.shared`: [shared start, shared end] per pair
        start, end = np.asarray(shared).T
        if truncation_mode == "keep_start":
            same = int(np.count_nonzero((prompt < max_length) & (max_length - prompt <= start)))
        else:  # keep_end keeps each sequence's last max_length tokens: the same where both end with that many alike
            same = int(np.count_nonzero(end >= max_length))
    return len(prompt) - dropped - same, dropped, same


def check(
    prompt,
    chosen,
    rejected,
    shared,
    max_length: int,
    truncation_mode: str,
    source: str,
    max_positions: int | None = None,
    budget: int | None = None,
) -> None:
    """Refuse a max_length that leaves fewer than `TEACHING` of the pairs anything to learn: a pair teaches nothing
    when the trainer drops it, or when the cut falls inside the start its completions share (keep_start) or the end its
    sequences share (keep_end) (`shared`, `teaching`; None: not measured), so that both sides are the same tokens. Say
    what length would do instead: within the model's `max_positions` where known (a longer one is refused in turn),
    with the token `budget` it needs, or that none does."""
    prompt, chosen, rejected = (np.asarray(a, dtype=np.int64) for a in (prompt, chosen, rejected))
    pairs = len(prompt)
    teach, dropped, same = teaching(prompt, shared, max_length, truncation_mode)
    if not pairs or teach >= TEACHING * pairs:
        return
    fits = recommend(prompt + np.maximum(chosen, rejected), COVERAGE)
    fix = advice(fits, max_positions, budget)
    if max_positions and fits > max_positions:
        if teaching(prompt, shared, max_positions, truncation_mode)[0] < TEACHING * pairs:
            long = int(np.count_nonzero(prompt >= max_positions))
            fix = (
                f"no max_length within the model's {max_positions:,} positions does ({long:,} of the pairs have a "
                "prompt that alone fills them): remove those pairs or shorten their prompts "
                "(scripts/analyze_dataset.py shows the lengths)"
            )
    raise ConfigError(
        f"max_length {max_length:,} leaves {teach:,} of {pairs:,} pairs ({teach / pairs:.1%}) anything to learn "
        f"({source}): {dropped:,} dropped (the prompt alone fills max_length; the shortest prompt is "
        f"{int(prompt.min()):,} tokens), {same:,} cut until chosen and rejected are the same tokens; at least "
        f"{TEACHING:.0%} must keep a difference: {fix}"
    )


def advice(fits: int, max_positions: int | None, budget: int | None = None) -> str:
    """What to pass instead: `fits` (the analyzer's rule, `recommend`), or the model's positions it reaches past; with
    the micro-batch token `budget` it needs where the run's is smaller than 2 x that length (`resolve.
    check_token_budget` refuses it otherwise: the advice followed alone was refused). The flags' values without
    thousands separators: copied as printed, `--max_length 4,096` is refused."""
    length = max_positions if max_positions and fits > max_positions else fits
    more = f" --max_tokens_per_microbatch {2 * length}" if budget and budget < 2 * length else ""
    held = f"; a micro-batch holds 2 x max_length, and max_tokens_per_microbatch is {budget}" if more else ""
    if length != fits:
        return f"pass --max_length {length}{more} (the model's positions: {fits:,} would reach past them{held})"
    return (
        f"pass --max_length {fits}{more} (the smallest multiple of {STEP} that leaves {COVERAGE:.0%} of these pairs "
        f"whole{held}) or --max_length auto{more} (docs/max_length.md)"
    )


def warning(
    prompt, chosen, rejected, max_length: int, truncation_mode: str, source: str, max_positions=None, budget=None
):
    """The line a run with a max_length of its own (not `auto`, chosen to `COVERAGE`) says when more than 1 - COVERAGE
    of its pairs are cut or dropped there, naming the analyzer's length within the model's `max_positions`; None
    where fewer are, or no length the model takes cuts fewer (max_length is its positions already)."""
    counted = count(prompt, chosen, rejected, max_length, truncation_mode)
    pairs, hit = counted["pairs"], counted["truncated"] + counted["dropped"]
    if not pairs or (pairs - hit) / pairs >= COVERAGE:  # the pairs left whole, as `recommend` counts its coverage
        return None
    fits = recommend(np.asarray(prompt) + np.maximum(chosen, rejected), COVERAGE)
    if min(fits, max_positions or fits) <= max_length:
        return None
    return (
        f"more than {1 - COVERAGE:.0%} of the pairs are cut or dropped at max_length {max_length:,} ({source}): "
        f"{counts(counted)}; {advice(fits, max_positions, budget)}"
    )
