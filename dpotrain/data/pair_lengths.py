"""Each pair's token lengths as the collators lay it out: its two sequences cut at max_length, and whether its prompt
is computed once (the step plan, the forwards' costs and the reference stage all read these)."""

import functools
from dataclasses import dataclass

import numpy as np

COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
# With `assistant_turns: all`, the prompt tokens that are trained (earlier assistant turns: dpotrain/data/turns.py)
LABELS = "prompt_labels"


def pair_columns(dataset) -> list[str]:
    """The columns that make a tokenized pair: its token ids, and its prompt's labels where it has them."""
    return [*COLUMNS, *([LABELS] if LABELS in dataset.column_names else [])]


def token_counts(dataset) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt, chosen, rejected) token counts of a tokenized data set, from its Arrow offsets (no row read)."""
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")[:]
    return tuple(np.asarray(pc.list_value_length(table.column(c)), dtype=np.int64) for c in COLUMNS)


@dataclass(frozen=True)
class PairLengths:
    """What the plan knows of each pair: its two sequences' lengths after truncation, as the collators cut them, and
    whether its prompt is laid out once (shared_prompt.py)."""

    chosen: np.ndarray  # prompt + chosen completion, truncated to max_length
    rejected: np.ndarray  # prompt + rejected completion, truncated
    prompt: np.ndarray | None = None  # with `shared`: the prompt's length
    shared: np.ndarray | None = None  # per pair: its prompt is computed once

    @classmethod
    def of(cls, dataset, max_length: int | None, share: bool = False, truncation_mode: str = "keep_start"):
        """From a tokenized data set's Arrow offsets (no row is read into Python)."""
        return cls.from_parts(*token_counts(dataset), max_length, share, truncation_mode)

    @classmethod
    def from_parts(cls, prompt, chosen, rejected, max_length, share=False, truncation_mode="keep_start"):
        """From token counts of prompt and completions; `share`: the pairs shared_prompt.py can share, share."""
        sides = [prompt + chosen, prompt + rejected]
        if max_length is not None:
            sides = [np.minimum(s, max_length) for s in sides]
        if not share:
            return cls(*sides)
        # As shared_prompt.shareable: a pair with a prompt; keep_end shares only one whose truncation cuts nothing.
        whole = (
            max_length is None
            or truncation_mode == "keep_start"
            or ((prompt + chosen <= max_length) & (prompt + rejected <= max_length))
        )
        shared = np.broadcast_to(whole, prompt.shape) & (np.asarray(prompt) > 0)
        return cls(*sides, prompt=np.asarray(prompt), shared=shared)

    def __len__(self) -> int:
        return len(self.chosen)

    # Computed once (the lengths never change): the plan reads them per pair, for every step of every epoch.
    @functools.cached_property
    def tokens(self) -> np.ndarray:
        """Positions of each pair in a packed micro-batch: both sequences, less one copy of a shared prompt but its
        last token (which each completion's first prediction needs)."""
        both = self.chosen + self.rejected
        return both if self.shared is None else both - np.where(self.shared, self.prompt - 1, 0)

    def sequences(self, pairs) -> list[int]:
        """The chosen sequences of these pairs, then their rejected ones: the rows of TRL's padded forward."""
        return [int(self.chosen[i]) for i in pairs] + [int(self.rejected[i]) for i in pairs]

    def units(self, pairs) -> list[int]:
        """What packed rows lay out for these pairs (shared_prompt.SharedPromptCollator): a pair whose prompt is shared
        is one unit (`tokens`), any other pair its two sequences."""
        if self.shared is None:
            return self.sequences(pairs)
        units = [int(self.tokens[i]) for i in pairs if self.shared[i]]
        return units + [int(s) for i in pairs if not self.shared[i] for s in (self.chosen[i], self.rejected[i])]

    @functools.cached_property
    def longest(self) -> np.ndarray:
        """Each pair's longer sequence: what a padded micro-batch pads its rows to."""
        return np.maximum(self.chosen, self.rejected)
