"""Padding-free (packed) DPO forward: the chosen and rejected sequences of a micro-batch side by side in rows.

TRL pads a micro-batch of B pairs to `[2B, longest]`: more than half of the positions on real preference data (58% on
a Dolci-like mix). Here sequences are concatenated into rows, `position_ids` restarting at 0 for each, and the per-token
outputs are laid back out as `[2B, L-1]` in TRL's order (chosen 0..B-1, rejected 0..B-1), so TRL's own loss and metric
code runs on them unchanged (`PackedModel`). TRL's fused LM head shifts the labels across a whole row: the label of
each sequence's first token is set to -100, or the last token of one sequence would predict the first of the next.
"""

import math
from dataclasses import dataclass
from typing import Any

import torch

from dpotrain.data import turns
from dpotrain.forwards import flops, masks
from dpotrain.forwards.masks import causal_lm
from dpotrain.recipe import upstream

# Which models may pack: a layer carrying state along a row (linear attention, Mamba, RWKV) silently mixes packed
# sequences and a config need not say it has one, hence a list of types tests/test_architectures.py proves equal to the
# padded path (add one only with its test).
DENSE_PACKING = (
    "llama mistral qwen2 qwen3 gemma2 gemma3_text phi3 olmo2 olmo3 granite cohere cohere2 glm glm4 "
    "gemma phi starcoder2 ministral smollm3 exaone4 seed_oss olmo helium arcee apertus ernie4_5 hunyuan_v1_dense "
    "internlm3 stablelm nemotron gpt_neox vaultgemma granite_swa gemma4_text"
)
# Mixture of experts: the router's auxiliary loss over real tokens only (see `PackedModel`).
MOE_PACKING = "qwen3_moe olmoe mixtral qwen2_moe granitemoe deepseek_v3 glm4_moe gpt_oss"
PACKING_TESTED = {*DENSE_PACKING.split(), *MOE_PACKING.split()}
# Hybrids whose stateful layers' CUDA kernels read sequence boundaries from a one-row varlen batch (transformers 5.23:
# the gated delta rule `cu_seq_lens_q`, Mamba-2 and causal-conv `seq_idx`): packed only on a varlen attention when
# asked (`choice.hybrid_problem`), and only while `parity` holds at start.
BOUNDARY_HYBRIDS = {"olmo_hybrid", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "granitemoehybrid"}
# Layer types that read only their own sequence when given packed position_ids / cu_seq_lens.
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}
# Attention implementations whose varlen kernel takes the sequence boundaries (`cu_seq_lens_q/k`) of one packed row:
# FlashAttention 2, 3 and 4, and the `kernels` hub builds transformers 5.23 loads for them (FLASH_ATTN_KERNEL_FALLBACK /
# FLASH_ATTN_KERNEL_VERSIONS in modeling_flash_attention_utils.py). A `@revision` suffix is allowed.
VARLEN_ATTENTION = {"flash_attention_2", "flash_attention_3", "flash_attention_4"} | {
    f"kernels-community/{name}"
    for name in ("flash-attn2", "flash-attn3", "vllm-flash-attn3", "flash-attn4", "aiter-flash-attn")
}

# sdpa and eager build a per-sequence causal (and sliding-window) mask from position_ids; FlexAttention takes a block
# mask built from the same inputs (forwards/masks.py), which skips the blocks between sequences.
PACKED_ATTENTION = {"sdpa", "eager", "flex_attention"} | VARLEN_ATTENTION


def attention_name(attn_implementation: str | None) -> str:
    """The implementation without a kernel revision (`kernels-community/flash-attn3@v1`); transformers' default sdpa
    for None."""
    return (attn_implementation or "sdpa").split("@")[0]


def one_row(attn_implementation: str | None) -> bool:
    """FlashAttention's varlen kernel takes a whole micro-batch as one row (dense masks do better with narrow rows)."""
    return attention_name(attn_implementation) in VARLEN_ATTENTION


def packing_problem(config) -> str | None:
    """Why a model with this config cannot be trained packed, or None when it can."""
    text_config = config.get_text_config()
    model_type = config.model_type  # a multimodal wrapper is a type of its own (its text model's type is not enough)
    attn = attention_name(upstream.attn_implementation(config))
    if attn not in PACKED_ATTENTION:
        return f"attn_implementation {attn!r} is not one that honours packed sequences ({sorted(PACKED_ATTENTION)})"
    stateful = sorted(set(flops.layer_kinds(text_config)) - ATTENTION_LAYER_TYPES)
    if model_type in BOUNDARY_HYBRIDS:
        if attn in VARLEN_ATTENTION:
            return None
        return (
            f"{model_type} has {'/'.join(stateful) or 'recurrent'} layers, which carry state across packed "
            "sequences; their CUDA kernels take sequence boundaries only from a varlen attention implementation "
            "(flash_attention_2/3/4)"
        )
    if stateful:
        return f"{model_type} has {'/'.join(stateful)} layers, which carry state across packed sequences"
    if model_type not in PACKING_TESTED:
        return (
            f"model type {model_type!r} is not among those proven to pack exactly (dpotrain/forwards/packing.py "
            "PACKING_TESTED, each with its test in tests/test_architectures.py)"
        )
    return None


def truncate(ids: list[int], mask: list[int], max_length: int | None, truncation_mode: str):
    """Per-sequence truncation exactly as TRL's `DataCollatorForPreference`."""
    if max_length is None or len(ids) <= max_length:
        return ids, mask
    if truncation_mode == "keep_start":
        return ids[:max_length], mask[:max_length]
    if truncation_mode == "keep_end":
        return ids[-max_length:], mask[-max_length:]
    raise ValueError(f"truncation_mode must be 'keep_start' or 'keep_end' (got {truncation_mode!r})")


def sequences(example: dict, max_length: int | None, truncation_mode: str):
    """(ids, completion_mask) of the chosen and the rejected sequence of one tokenized pair, truncated; the mask marks
    the completion and, with `assistant_turns: all`, the prompt's earlier assistant turns (turns.py)."""
    prompt = example["prompt_ids"]
    return [
        truncate(prompt + example[f"{side}_ids"], turns.completion_mask(example, side), max_length, truncation_mode)
        for side in ("chosen", "rejected")
    ]


def balanced_rows(lengths: list[int], count: int) -> list[list[int]]:
    """Sequence indices in `count` rows of balanced fill: longest first into the emptiest row, then moves and swaps
    out of the fullest row while they lower it."""
    rows, fill = [[] for _ in range(count)], [0] * count
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = min(range(count), key=fill.__getitem__)
        rows[r].append(i)
        fill[r] += lengths[i]
    for _ in range(4 * len(lengths)):  # each pass lowers the fullest row or stops
        full = max(range(count), key=fill.__getitem__)
        best = None  # (new width of the pair of rows, row, item out of `full`, item back or None, moved length)
        for other in range(count):
            if other == full:
                continue
            for a in rows[full]:
                for b in [None, *rows[other]]:
                    delta = lengths[a] - (lengths[b] if b is not None else 0)
                    if delta <= 0:
                        continue
                    width = max(fill[full] - delta, fill[other] + delta)
                    if width < fill[full] and (best is None or width < best[0]):
                        best = (width, other, a, b, delta)
        if best is None:
            break
        _, other, a, b, delta = best
        rows[full].remove(a)
        rows[other].append(a)
        if b is not None:
            rows[other].remove(b)
            rows[full].append(b)
        fill[full] -= delta
        fill[other] += delta
    return [row for row in rows if row]


def row_width_bound(max_length: int | None) -> int | None:
    """The widest row `fill_rows` makes for sequences truncated to `max_length`: 2 x max_length, which a shared pair
    (P + C + R + 1 positions, C, R <= max_length - P, P >= 1) fits too."""
    return None if max_length is None else 2 * max_length


def positions_cap(budget: int | None, half_precision: bool) -> int | None:
    """The most positions balanced rows may take, their padding included: the micro-batch budget where the memory plan
    plans for it (runs in bf16 or fp16: `memory.plan`), so that the plan holds what the rows take; else none (an fp32
    run, as the CPU demo, whose memory is not planned, lays its rows by their cost alone)."""
    return budget if half_precision else None


def fill_rows(
    lengths: list[int], hidden_size: int, max_width: int | None = None, max_positions: int | None = None
) -> list[list[int]]:
    """Rows for dense-mask attention: the row count of lowest estimated cost, rows no wider than `max_width`. A row of
    width W costs ~W x (linear layers) x (1 + W / (8 x hidden_size)) (per position, attention ~4 x W x hidden FLOPs, a
    block's linear layers ~30-40 x hidden^2): fewer, wider rows pad less and attend more. Rows are padded to one width,
    so they may take more positions than their tokens: a count whose rows take more than `max_positions` (the
    micro-batch budget the memory plan plans for) is chosen only when none fits, the one of fewest positions."""
    longest, total = max(lengths), sum(lengths)
    if max_width is not None and longest > max_width:
        raise ValueError(f"a sequence of {longest} positions is wider than the rows' bound {max_width}")
    best, best_key = None, None
    # Rows wider than twice the longest sequence cost more than they save, unless only they keep within the cap
    first = 1 if max_positions is not None else max(1, math.ceil(total / (2 * longest)))
    for count in range(first, len(lengths) + 1):
        rows = balanced_rows(lengths, count)
        width = max(sum(lengths[i] for i in row) for row in rows)
        if max_width is not None and width > max_width:  # one sequence per row always fits: the loop ends there
            continue
        positions = len(rows) * width
        over = max_positions is not None and positions > max_positions
        key = (over, positions if over else positions * (1 + width / (8 * hidden_size)))
        if best_key is None or key < best_key:
            best, best_key = rows, key
        if width <= longest:  # narrower rows than the longest sequence cannot exist: more rows only pad more
            break
    return best


def lay_rows(lengths: list[int], one_row: bool, hidden_size: int, max_width=None, multiple=None, max_positions=None):
    """Units of these lengths in rows (all in one, or `fill_rows`'), and the width every row is padded to (rounded up
    to a multiple of `multiple`, if any)."""
    rows = [list(range(len(lengths)))] if one_row else fill_rows(lengths, hidden_size, max_width, max_positions)
    width = max(sum(lengths[i] for i in row) for row in rows)
    return rows, -(-width // multiple) * multiple if multiple else width


@dataclass
class PackedPreferenceCollator:
    """Collates tokenized pairs into packed rows: with `one_row` (varlen FlashAttention) all 2B sequences in one row
    with their boundaries, else balanced rows (`fill_rows`: a dense mask costs the square of the row). Emits
    `input_ids`, `position_ids`, `completion_mask` (`[rows, width]`), and per sequence in TRL's order `seq_lens`,
    `seq_rows` and `seq_starts`, plus the reference log-probs when the examples carry them."""

    max_length: int | None = None
    truncation_mode: str = "keep_start"
    one_row: bool = False
    hidden_size: int = 4096  # the model's: weighs attention against the linear layers when rows are formed
    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None  # FlexAttention's tile (forwards/masks.py BLOCK): rows end on a whole tile
    max_positions: int | None = None  # max_tokens_per_microbatch: balanced rows, padding included, stay within it

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        per_pair = [sequences(e, self.max_length, self.truncation_mode) for e in examples]
        seqs = [pair[0] for pair in per_pair] + [pair[1] for pair in per_pair]  # TRL's [chosen..., rejected...]
        lengths = [len(ids) for ids, _ in seqs]
        batch, where = self.lay_out([(ids, list(range(len(ids))), mask) for ids, mask in seqs])
        batch["seq_lens"] = torch.tensor(lengths, dtype=torch.long)
        batch["seq_rows"] = torch.tensor([r for r, _ in where], dtype=torch.long)
        batch["seq_starts"] = torch.tensor([start for _, start in where], dtype=torch.long)
        if self.one_row:
            batch |= varlen_boundaries(lengths, batch["input_ids"].shape[1])
        return with_reference(batch, examples)

    def lay_out(self, units: list[tuple]) -> tuple[dict, list[tuple[int, int]]]:
        """Units (ids, position ids, completion mask, ...) in rows (`lay_rows`) as the batch's `input_ids`,
        `position_ids` and `completion_mask`, and each unit's (row, start). The padding at the end of a row is a segment
        of its own (positions from 0): nothing attends to it."""
        bound = row_width_bound(self.max_length)
        lengths = [len(u[0]) for u in units]
        rows, width = lay_rows(
            lengths, self.one_row, self.hidden_size, bound, self.pad_to_multiple_of, self.max_positions
        )
        shape = (len(rows), width)
        batch = {
            "input_ids": torch.full(shape, self.pad_token_id, dtype=torch.long),
            "position_ids": torch.zeros(shape, dtype=torch.long),
            "completion_mask": torch.zeros(shape, dtype=torch.long),
        }
        where = [(0, 0)] * len(units)
        for r, row in enumerate(rows):
            start = 0
            for u in row:
                ids, positions, mask = units[u][:3]
                end = start + len(ids)
                batch["input_ids"][r, start:end] = torch.tensor(ids)
                batch["position_ids"][r, start:end] = torch.tensor(positions)
                batch["completion_mask"][r, start:end] = torch.tensor(mask)
                where[u] = (r, start)
                start = end
            batch["position_ids"][r, start:] = torch.arange(width - start)
        return batch, where


REFERENCE_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


def with_reference(batch: dict, examples: list[dict]) -> dict:
    return batch | {
        k: torch.tensor([e[k] for e in examples], dtype=torch.float32) for k in REFERENCE_KEYS if k in examples[0]
    }


def varlen_boundaries(lengths: list[int], width: int) -> dict:
    """The boundaries of one packed row of sequences of `lengths`, `width` wide, as varlen kernels take them
    (`seq_idx`: Mamba-2 / causal-conv kernels). Padding at the row's end is a segment of its own: a varlen kernel writes
    only the positions its segments cover, and an unwritten output is whatever memory held (NaN x 0 is NaN)."""
    segments = lengths + ([width - sum(lengths)] if width > sum(lengths) else [])
    cu_seq_lens = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu_seq_lens[1:] = torch.tensor(segments, dtype=torch.int32).cumsum(0)
    seq_idx = torch.repeat_interleave(torch.arange(len(segments), dtype=torch.int32), torch.tensor(segments))
    return {
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max(segments),
        "max_length_k": max(segments),
        "seq_idx": seq_idx[None],
    }


def is_packed(batch: dict) -> bool:
    return "seq_lens" in batch


# What a varlen attention kernel reads of `varlen_boundaries`: the whole row's, also under a sequence-parallel group,
# whose kernel holds whole rows after the all-to-all (sequence_parallel.py). `seq_idx` is read outside attention.
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
MODEL_KEYS = ("input_ids", "position_ids", *VARLEN_KEYS, "seq_idx")


def packed_labels(batch: dict) -> torch.Tensor:
    """Completion tokens as labels, -100 elsewhere and at every sequence's first position (see the module doc)."""
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    return labels.masked_fill(batch["position_ids"] == 0, -100)


def forward(model, batch: dict, **kwargs):
    """The model's fused-LM-head forward on packed rows: per-token outputs of shape `[rows, width-1]`, with the
    attention mask the model's attention needs for them (`forwards/masks.py`)."""
    model_kwargs = {k: batch[k] for k in MODEL_KEYS if k in batch}
    model_kwargs["attention_mask"] = masks.attention_mask(model, batch)  # None: transformers' default, no mask
    return model(**model_kwargs, labels=packed_labels(batch), fused_lm_head=True, use_cache=False, **kwargs)


def layout_index(starts: torch.Tensor, counts: torch.Tensor, width: int, jumps=None, offsets=None):
    """`[n, width]` indices into a flat packed tensor: row i reads `counts[i]` entries from `starts[i]` (skipping
    `offsets[i]` from its entry `jumps[i]` on); the rest points at index 0, marked invalid."""
    t = torch.arange(width, device=starts.device).unsqueeze(0)
    valid = t < counts.unsqueeze(1)
    index = starts.unsqueeze(1) + t
    if jumps is not None:
        index = index + torch.where(t >= jumps.unsqueeze(1), offsets.unsqueeze(1), 0)
    return torch.where(valid, index, 0), valid


def _layouts(batch: dict):
    """Index maps from the packed rows to TRL's padded layout, for per-token predictions and for tokens."""
    seq_lens, rows, starts = batch["seq_lens"], batch["seq_rows"], batch["seq_starts"]
    row_width = batch["input_ids"].shape[1]
    width = int(seq_lens.max())
    # Prediction t of sequence i sits at column starts[i] + t of its row's [width-1] outputs, its token t at column
    # starts[i] + t of its row; a shared-prompt rejected sequence continues `seq_offsets` columns on from `seq_jumps`.
    jumps, offsets = batch.get("seq_jumps"), batch.get("seq_offsets")
    predictions = layout_index(
        rows * (row_width - 1) + starts, seq_lens - 1, width - 1, None if jumps is None else jumps - 1, offsets
    )
    tokens = layout_index(rows * row_width + starts, seq_lens, width, jumps, offsets)
    return predictions, tokens


def _lay_out(packed: torch.Tensor | None, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor | None:
    """A packed tensor read through `layout_index`'s map (invalid entries 0); None stays None."""
    return None if packed is None else packed.reshape(-1)[index].masked_fill(~valid, 0)


def padded_view(batch: dict) -> dict:
    """The packed batch as the padded `[2B, L]` inputs TRL's `_compute_loss` reads besides the model's outputs."""
    _, (index, valid) = _layouts(batch)
    padded = {
        "input_ids": _lay_out(batch["input_ids"], index, valid),
        "attention_mask": valid.long(),
        "completion_mask": _lay_out(batch["completion_mask"], index, valid),
    }
    return padded | {k: batch[k] for k in REFERENCE_KEYS if k in batch}


PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


def unpack_outputs(outputs, batch: dict):
    """Per-token outputs of a packed forward (`[rows, width-1]`) laid out as TRL's `[2B, L-1]`: a gather, so gradients
    flow back into the packed forward."""
    (index, valid), _ = _layouts(batch)
    fields = {name: _lay_out(getattr(outputs, name), index, valid) for name in PER_TOKEN_FIELDS}
    return type(outputs)(loss=outputs.loss, aux_loss=outputs.aux_loss, **fields)


def token_weights(batch: dict) -> torch.Tensor:
    """`[rows, width]`: how many sequences of TRL's padded layout hold each position of the packed rows (1, or 0 for
    the padding that ends a row)."""
    _, (index, valid) = _layouts(batch)
    weights = torch.zeros(batch["input_ids"].numel(), device=index.device)
    weights.index_add_(0, index[valid], torch.ones(int(valid.sum()), device=index.device))
    return weights.view_as(batch["input_ids"])


def router_loss_coefficient(config, coefficient: float | None) -> float:
    """The weight of the MoE router's load-balancing loss TRL adds to this model's loss, 0.0 where it adds none (TRL's
    `aux_loss_enabled`): a text config that has `output_router_logits` at all (False, its default, included: TRL asks
    the model for its router logits itself) and a coefficient, the recipe's `router_aux_loss_coef` (`coefficient`) or
    else the config's, other than 0."""
    text = config.get_text_config()
    if not hasattr(text, "output_router_logits"):
        return 0.0
    return getattr(text, "router_aux_loss_coef", 0.0) if coefficient is None else coefficient


def router_aux_loss(model, run, batch: dict):
    """`run`'s forward of packed rows, its aux_loss the MoE load-balancing loss over the tokens TRL's padded path
    counts: transformers' own `load_balancing_loss_func` (the one TRL's fused head calls), weighed by `token_weights`,
    on the router logits hooked on the backbone (the module TRL's fused LM head runs). Only the backbone is asked for
    them: the fused head, asked, computes its own loss from the `attention_mask`, which it cannot read where that is
    FlexAttention's BlockMask or a shared prompt's 4D mask."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    lm, captured = causal_lm(model), []
    hooks = (
        lm.base_model.register_forward_pre_hook(
            lambda m, args, kwargs: (args, kwargs | {"output_router_logits": True}), with_kwargs=True
        ),
        lm.base_model.register_forward_hook(lambda m, a, output: captured.append(output.router_logits)),
    )
    try:
        outputs = run(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
    config = lm.config.get_text_config()
    weights = token_weights(batch)
    outputs.aux_loss = load_balancing_loss_func(captured[0], config.num_experts, config.num_experts_per_tok, weights)
    return outputs


class PackedModel:
    """Stands in for the model where TRL's code calls it on the padded view of a micro-batch: runs the packed forward
    of the real model inside whatever TRL entered around the call (no_grad, autocast, PEFT's adapter switch), and hands
    back the outputs in the padded layout. MoE: TRL's fused head would count the padding that ends a packed row in the
    router's load-balancing loss, so that loss is computed again over the real tokens only."""

    def __init__(self, model, batch: dict, run=None):
        self.model = model
        self.batch = batch
        self.run = run or forward  # the packed forward: `forward`, or split over a group (sequence_parallel.py)
        self.outputs = None  # the last call's outputs, in the padded layout

    def __call__(self, *, fused_lm_head: bool = False, output_router_logits: bool | None = None, **padded_kwargs):
        if not fused_lm_head:  # TRL's deprecated `return_outputs=True` path asks for logits: give the padded forward
            return self.model(**padded_kwargs)
        if output_router_logits:
            outputs = router_aux_loss(self.model, self.run, self.batch)
        else:
            extra = {} if output_router_logits is None else {"output_router_logits": False}
            outputs = self.run(self.model, self.batch, **extra)
        self.outputs = unpack_outputs(outputs, self.batch)
        return self.outputs


# The largest per-token log-prob difference `parity` accepts. Measured on CPU with tests/test_architectures.py's tiny
# models: dense models agree to ~1e-6 in fp32 and ~1e-3 in bf16; without boundaries, OLMo hybrid is off by 3.6e-2,
# GraniteMoeHybrid by 2.9e-2, Qwen3-Next by 3.2e-3. A check failed on rounding alone stops a run, never trains it wrong.
PARITY_TOLERANCE = {"fp32": 1e-3, "half": 2e-2}


def parity(model, collator: PackedPreferenceCollator, examples: list[dict]) -> float:
    """The largest difference between a completion token's log-prob in the packed rows of `examples` and in its
    sequence scored alone. Run under no_grad, in the caller's autocast."""
    device = next(model.parameters()).device
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in collator(examples).items()}
    packed = unpack_outputs(forward(model, batch), batch).log_probs.float()
    per_pair = [sequences(e, collator.max_length, collator.truncation_mode) for e in examples]
    worst = 0.0
    for i, (ids, mask) in enumerate([pair[0] for pair in per_pair] + [pair[1] for pair in per_pair]):
        alone = {
            "input_ids": torch.tensor([ids], device=device),
            "position_ids": torch.arange(len(ids), device=device)[None],
            "completion_mask": torch.tensor([mask], device=device),
        }
        scored = alone["completion_mask"][0, 1:].bool()
        log_probs = forward(model, alone).log_probs[0].float()
        worst = max(worst, float((packed[i, : len(ids) - 1] - log_probs)[scored].abs().max()))
    return worst
