"""Padded micro-batches for models that cannot pack, padded far less than TRL pads them.

TRL's collator pads all 2B sequences of a micro-batch (B chosen, B rejected) to the longest one. The plan already
gives a micro-batch pairs of similar length (`plan._padded_runs`), but a pair's two sides differ: on Dolci-like data
padding each chosen and rejected side to its pair's longer one alone is ~28% of the positions. So here the 2B
sequences are sorted by length and cut into at most `MAX_GROUPS` groups (the cut that pads least), and the model runs
once per group on that group's rows, padded to the group's own longest sequence. TRL's `_compute_loss` still sees
its own padded `[2B, L]` batch: `GroupedModel` stands in for its model call, like `packing.PackedModel` for packed
rows, and lays each group's per-token outputs back into TRL's layout. Right padding with an attention mask, as TRL
runs it, so each sequence computes what it computes in TRL's one padded batch (to kernel rounding).

MoE models that ask for their router's auxiliary loss run as one group: the load-balancing loss is taken over all of a
batch's tokens at once, and groups would change it.
"""

import numpy as np
import torch

from .packing import PER_TOKEN_FIELDS

MAX_GROUPS = 4  # forward calls per micro-batch: more pads a little less and launches more, smaller kernels


def row_groups(lengths: list[int], max_groups: int = MAX_GROUPS) -> list[list[int]]:
    """Row indices in at most `max_groups` groups of similar length whose padding (each group to its longest) is the
    least: the best cut of the rows sorted by length (dynamic programming over the cut points)."""
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
    groups = next(g for g in range(1, max_groups + 1) if best[g, n] <= 1.02 * best[1:, n].min())
    bounds, i = [], n
    for g in range(groups, 0, -1):
        bounds.append((int(cut[g, i]), i))
        i = int(cut[g, i])
    return [order[a:b] for a, b in reversed(bounds) if b > a]


def positions(lengths: list[int], groups: list[list[int]] | None = None, max_groups: int = MAX_GROUPS) -> int:
    """Positions the grouped forward runs for sequences of these lengths (in `groups`, or the best cut)."""
    groups = row_groups(lengths, max_groups) if groups is None else groups
    return sum(len(group) * max(lengths[i] for i in group) for group in groups)


class GroupedCollator:
    """TRL's padded collator, plus `row_groups`: which rows run together (`row_groups`)."""

    def __init__(self, collate, max_groups: int = MAX_GROUPS):
        self.collate, self.max_groups = collate, max_groups

    def __call__(self, examples):
        batch = self.collate(examples)
        batch["row_groups"] = row_groups(batch["attention_mask"].sum(dim=1).tolist(), self.max_groups)
        return batch

    def __getattr__(self, name):  # the wrapped collator's settings (pad_token_id, ...)
        return getattr(self.collate, name)


class GroupedModel:
    """Stands in for the model where TRL's code calls it on a padded micro-batch: runs each row group on its own rows
    and width, and hands back the per-token outputs in the full `[2B, L-1]` layout. Keeps the last outputs (for the
    project's metrics)."""

    def __init__(self, model, groups: list[list[int]] | None):
        self.model, self.groups = model, groups
        self.outputs = None

    def __call__(self, *, fused_lm_head: bool = False, output_router_logits: bool | None = None, **padded_kwargs):
        one_call = not fused_lm_head or output_router_logits or self.groups is None or len(self.groups) == 1
        if one_call:  # TRL's own single padded forward
            extra = {} if output_router_logits is None else {"output_router_logits": output_router_logits}
            self.outputs = self.model(**padded_kwargs, fused_lm_head=fused_lm_head, **extra)
            return self.outputs
        mask = padded_kwargs["attention_mask"]
        rows, width = mask.shape
        fields = {}
        for group in self.groups:
            index = torch.tensor(group, device=mask.device)
            length = int(mask[index].sum(dim=1).max())
            part = {k: (v[index, :length] if torch.is_tensor(v) and v.dim() == 2 and v.shape[0] == rows else v)
                    for k, v in padded_kwargs.items()}  # fmt: skip
            out = self.model(**part, fused_lm_head=True)
            for name in PER_TOKEN_FIELDS:
                value = getattr(out, name, None)
                if value is None:
                    continue
                if name not in fields:
                    fields[name] = value.new_zeros((rows, width - 1))
                # index_put keeps the graph: gradients flow back into each group's forward
                columns = torch.arange(length - 1, device=mask.device)
                fields[name] = fields[name].index_put((index.unsqueeze(1), columns), value[:, : length - 1])
        self.outputs = type(out)(loss=None, aux_loss=None, **{n: fields.get(n) for n in PER_TOKEN_FIELDS})
        return self.outputs
