"""Shared-prompt packing: each pair's prompt computed once, not twice.

Every DPO implementation computes a pair as two sequences, prompt + chosen and prompt + rejected: 2P + C + R positions
where P + C + R suffice. On multi-turn data the shared history is most of a pair. Here each pair is laid out in its
packed row as

    prompt[0 .. P-2] | prompt[P-1] chosen[0 .. C-1] | prompt[P-1] rejected[0 .. R-1]
        branch 0     |          branch 1             |           branch 2

with position ids 0 .. P-1, P .. P+C-1, then P-1 again, P .. P+R-1: P + C + R + 1 positions. Each completion sees the
prompt and itself, never the other (forwards/masks.py: a block mask for FlexAttention, a dense one for sdpa and eager;
FlashAttention's varlen kernel cannot express it). The last prompt token appears once per branch: its hidden state
predicts each completion's first token (TRL's fused LM head scores the next token in the row). The outputs are laid
back out in TRL's `[2B, L-1]` layout as for unshared packing (`seq_jumps`, `seq_offsets`). A pair without a prompt, or
whose truncation would cut into it, is laid out unshared within the same row.
"""

from typing import Any

import torch

from dpotrain.data.pair_lengths import LABELS
from dpotrain.forwards.flops import layer_kinds
from dpotrain.forwards.packing import (
    PackedPreferenceCollator,
    attention_name,
    packing_problem,
    router_loss_coefficient,
    sequences,
    with_reference,
)
from dpotrain.recipe import upstream

# implementations that take a mask of our own: a 4D one (sdpa, eager) or a block mask (flex_attention)
SHARED_ATTENTION = {"sdpa", "eager", "flex_attention"}


def share_problem(config, attn_implementation: str | None, router_aux_loss_coef: float | None = None) -> str | None:
    """Why this model cannot share prompts in packed rows, or None when it can (`router_aux_loss_coef`: the recipe's,
    None for the model's own)."""
    if (problem := packing_problem(config)) is not None:
        return problem
    attn = attention_name(attn_implementation)
    if attn not in SHARED_ATTENTION:
        return f"{attn} attends within each packed sequence (varlen) and cannot express a prompt shared by two"
    text = config.get_text_config()
    kinds = set(layer_kinds(text))
    if kinds - {"full_attention", "sliding_attention"}:
        return f"{text.model_type} has {'/'.join(sorted(kinds))} layers, whose masks this project does not build"
    # MoE: TRL adds the router's load-balancing loss when the config has `output_router_logits` and a coefficient
    # other than 0 (its `aux_loss_enabled`); the model computes it from a per-token attention mask, which a shared
    # prompt's rows replace with a 4D one.
    if router_loss_coefficient(config, router_aux_loss_coef):
        return f"{text.model_type}'s router auxiliary loss needs a per-token attention mask, not a shared prompt's"
    window = getattr(text, "sliding_window", None) if getattr(text, "use_sliding_window", True) else None
    if window or "sliding_attention" in kinds:
        model_class = upstream.causal_lm_class(config)  # its forward must accept a dict of masks per layer kind
        if model_class is None or not upstream.takes_mask_per_layer_kind(model_class):
            return f"{text.model_type} builds its sliding-window mask itself and takes no mask per layer kind"
    return None


def _unit_shared(example: dict, max_length: int | None):
    """One shared pair: (ids, positions, completion mask, branch, chosen length, rejected length, prompt length,
    chosen completion length), truncated as TRL's collator truncates each sequence (keep_start)."""
    prompt, chosen, rejected = example["prompt_ids"], example["chosen_ids"], example["rejected_ids"]
    p = len(prompt)
    room = None if max_length is None else max_length - p
    chosen, rejected = chosen[:room], rejected[:room]
    c, r = len(chosen), len(rejected)
    ids = list(prompt) + list(chosen) + [prompt[-1]] + list(rejected)
    positions = list(range(p + c)) + [p - 1] + list(range(p, p + r))
    # The prompt's labels (earlier assistant turns with `assistant_turns: all`, turns.py) are laid out once and read by
    # both sides; the copy of the last prompt token is never a label (the chosen completion's end predicts nothing).
    mask = (example.get(LABELS) or [0] * p) + [1] * c + [0] + [1] * r
    branch = [0] * (p - 1) + [1] * (c + 1) + [2] * (r + 1)
    return ids, positions, mask, branch, p + c, p + r, p, c


def shareable(example: dict, max_length: int | None, truncation_mode: str) -> bool:
    """The pair has a prompt, and both sequences keep the whole of it after truncation (keep_end: nothing is cut)."""
    if not example["prompt_ids"]:
        return False
    if truncation_mode == "keep_start" or max_length is None:
        return True
    p = len(example["prompt_ids"])
    return p + len(example["chosen_ids"]) <= max_length and p + len(example["rejected_ids"]) <= max_length


class SharedPromptCollator(PackedPreferenceCollator):
    """Collates tokenized pairs into packed rows, each pair's prompt once, with the settings of
    `packing.PackedPreferenceCollator`. Emits what it emits, plus `seq_jumps` / `seq_offsets` (where a rejected sequence
    continues past its pair's chosen completion) and the mask's inputs `attention_block` and `attention_branch`."""

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        n = len(examples)
        units = []  # (ids, positions, completion mask, branch, [(sequence index, length, jump, offset)])
        for k, example in enumerate(examples):
            if shareable(example, self.max_length, self.truncation_mode):
                ids, pos, mask, branch, chosen_len, rejected_len, p, c = _unit_shared(example, self.max_length)
                # The chosen sequence is the unit's start; the rejected one jumps past the chosen completion and
                # the second copy of the last prompt token (c + 1 positions) from its token p on.
                members = [(k, chosen_len, chosen_len, 0), (n + k, rejected_len, p, c + 1)]
                units.append((ids, pos, mask, branch, members))
            else:
                for side, (ids, mask) in enumerate(sequences(example, self.max_length, self.truncation_mode)):
                    members = [(side * n + k, len(ids), len(ids), 0)]
                    units.append((ids, list(range(len(ids))), mask, [0] * len(ids), members))
        batch, where = self.lay_out(units)  # a row's end is a block of its own (0)
        block = torch.zeros(batch["input_ids"].shape, dtype=torch.long)
        branch = torch.zeros(batch["input_ids"].shape, dtype=torch.int8)
        seq = torch.zeros((2 * n, 5), dtype=torch.long)  # per sequence: length, row, start, jump, offset
        for u, ((r, start), (ids, _, _, br, members)) in enumerate(zip(where, units, strict=True)):
            branch[r, start : start + len(ids)] = torch.tensor(br, dtype=torch.int8)
            block[r, start : start + len(ids)] = u + 1
            for index, length, jump, offset in members:
                seq[index] = torch.tensor([length, r, start, jump, offset])
        batch |= {"attention_block": block, "attention_branch": branch}
        columns = ("seq_lens", "seq_rows", "seq_starts", "seq_jumps", "seq_offsets")
        batch |= {key: seq[:, i].clone() for i, key in enumerate(columns)}
        return with_reference(batch, examples)
