"""Padded micro-batches for models that cannot pack, padded far less than TRL pads them.

TRL's collator pads all 2B sequences of a micro-batch to the longest one; even with pairs of similar length a pair's
two sides differ (~28% of the positions on Dolci-like data). So here the 2B sequences are sorted by length and cut into
at most `MAX_GROUPS` groups (the cut that pads least), and the model runs once per group, right-padded to the group's
longest sequence. `GroupedModel` stands in for TRL's model call and lays each group's per-token outputs back into TRL's
`[2B, L]` layout. MoE models that ask for their router's auxiliary loss run as one group (groups would change it).

Where the weights are sharded (ZeRO-3, FSDP2) every rank must run the same number of forwards, or the ranks wait on
each other forever: the ranks agree on the most groups any rank wants (one all-reduce per micro-batch), and a rank with
fewer rows than groups runs its shortest row again for each missing group, its result multiplied by zero. Each extra
group costs one more gather of the weights in the forward and in the backward (not yet measured on GPUs).
"""

import numpy as np
import torch

from dpotrain.cluster.collectives import max_over_ranks
from dpotrain.data import turns
from dpotrain.data.pair_lengths import LABELS
from dpotrain.forwards.packing import PER_TOKEN_FIELDS, truncate

MAX_GROUPS = 4  # forward calls per micro-batch: more pads a little less and launches more, smaller kernels


def row_groups(lengths: list[int], count: int | None = None) -> list[list[int]]:
    """Row indices in at most `MAX_GROUPS` groups of similar length whose padding is the least: the best cut of the rows
    sorted by length (dynamic programming). With `count`: the best cut into exactly that many (fewer rows: fewer)."""
    max_groups = MAX_GROUPS if count is None else (count := min(count, len(lengths)))
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    widths = np.asarray([lengths[i] for i in order], dtype=np.float64)
    n = len(order)
    starts = np.arange(n)
    # best[g][i]: the fewest positions for the first i rows (longest first) in g groups; cut[g][i]: where its last
    # group starts (the group j..i-1 is padded to widths[j])
    best = np.full((max_groups + 1, n + 1), np.inf)
    cut = np.zeros((max_groups + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0
    for g in range(1, max_groups + 1):
        for i in range(1, n + 1):
            costs = best[g - 1, :i] + (i - starts[:i]) * widths[:i]
            j = int(np.argmin(costs))
            best[g, i], cut[g, i] = costs[j], j
    # Each group is one more forward call: the fewest groups within 2% of the fewest positions.
    groups = count or next(g for g in range(1, max_groups + 1) if best[g, n] <= 1.02 * best[1:, n].min())
    bounds, i = [], n
    for g in range(groups, 0, -1):
        bounds.append((int(cut[g, i]), i))
        i = int(cut[g, i])
    return [order[a:b] for a, b in reversed(bounds) if b > a]


def positions(lengths: list[int]) -> int:
    """Positions the grouped forward runs for sequences of these lengths, in `row_groups`' cut."""
    return sum(len(group) * max(lengths[i] for i in group) for group in row_groups(lengths))


def labeled_completion_mask(mask: torch.Tensor, examples: list[dict], collate) -> torch.Tensor:
    """TRL's `[2B, L]` completion mask with each sequence's labeled prompt tokens (turns.py) marked too, truncated as
    TRL's collator truncates the sequence."""
    mask = mask.clone()
    max_length, mode = getattr(collate, "max_length", None), getattr(collate, "truncation_mode", "keep_start")
    for side, offset in (("chosen", 0), ("rejected", len(examples))):
        for k, example in enumerate(examples):
            full = turns.completion_mask(example, side)
            _, cut = truncate(full, full, max_length, mode)
            mask[offset + k, : len(cut)] = torch.tensor(cut, dtype=mask.dtype)
    return mask


class GroupedCollator:
    """TRL's padded collator, plus `row_groups`: which rows run together."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, examples):
        batch = self.collate(examples)
        if LABELS in examples[0]:  # `assistant_turns: all`: the prompt's labeled tokens join each completion mask
            batch["completion_mask"] = labeled_completion_mask(batch["completion_mask"], examples, self.collate)
        batch["row_groups"] = row_groups(batch["attention_mask"].sum(dim=1).tolist())
        return batch

    def __getattr__(self, name):  # the wrapped collator's settings (pad_token_id, ...)
        return getattr(self.collate, name)


class GroupedModel:
    """Stands in for the model where TRL's code calls it on a padded micro-batch: runs each row group on its own rows
    and width, and hands back the per-token outputs in the full `[2B, L-1]` layout; keeps the last outputs and the
    positions its forwards ran. `lockstep`: the weights are sharded, so the ranks run as many forwards each."""

    def __init__(self, model, groups: list[list[int]] | None, lockstep: bool = False):
        self.model, self.groups, self.lockstep = model, groups, lockstep
        self.outputs = None
        self.positions = 0

    def __call__(self, *, fused_lm_head: bool = False, output_router_logits: bool | None = None, **padded_kwargs):
        mask = padded_kwargs["attention_mask"]
        groups, fillers = self.groups, 0
        grouped = fused_lm_head and not output_router_logits and groups is not None
        if grouped and self.lockstep:
            count = max_over_ranks(len(groups), mask.device)  # the same on every rank: one call each, or `count`
            if count != len(groups):
                groups = row_groups(mask.sum(dim=1).tolist(), count=count)
            fillers = count - len(groups)
        if grouped and len(groups) + fillers > 1:
            return self._grouped(groups, padded_kwargs, fillers)
        extra = {} if output_router_logits is None else {"output_router_logits": output_router_logits}
        self.outputs = self.model(**padded_kwargs, fused_lm_head=fused_lm_head, **extra)  # TRL's single forward
        self.positions = mask.numel()  # rows x width
        return self.outputs

    def _grouped(self, groups: list[list[int]], padded_kwargs: dict, fillers: int):
        mask = padded_kwargs["attention_mask"]
        rows, width = mask.shape
        lengths = mask.sum(dim=1)
        fields, self.positions = {}, 0
        # then the other ranks' extra forwards, matched on the shortest row
        for k, group in enumerate(groups + [[int(torch.argmin(lengths))]] * fillers):
            index = torch.tensor(group, device=mask.device)
            length = int(lengths[index].max())
            out = self.model(**self._rows(padded_kwargs, index, length), fused_lm_head=True)
            self.positions += len(group) * length
            if k >= len(groups):  # a filler: in the loss's graph, so its backward runs (and gathers) like the other
                # ranks' real groups, and weighs nothing (zero)
                fields["log_probs"] = fields["log_probs"] + 0.0 * out.log_probs.sum()
                continue
            columns = torch.arange(length - 1, device=mask.device)
            for name in PER_TOKEN_FIELDS:
                value = getattr(out, name, None)
                if value is None:
                    continue
                if name not in fields:
                    fields[name] = value.new_zeros((rows, width - 1))
                # index_put keeps the graph: gradients flow back into each group's forward
                fields[name] = fields[name].index_put((index.unsqueeze(1), columns), value[:, : length - 1])
        self.outputs = type(out)(loss=None, aux_loss=None, **{n: fields.get(n) for n in PER_TOKEN_FIELDS})
        return self.outputs

    @staticmethod
    def _rows(padded_kwargs: dict, index: torch.Tensor, length: int) -> dict:
        """The padded inputs of the rows `index`, cut to `length` columns."""
        rows = padded_kwargs["attention_mask"].shape[0]
        return {
            k: (v[index, :length] if torch.is_tensor(v) and v.dim() == 2 and v.shape[0] == rows else v)
            for k, v in padded_kwargs.items()
        }
