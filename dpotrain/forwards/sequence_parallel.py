"""Sequence parallelism (docs/sequence_parallel.md): one packed micro-batch split along the sequence over the N
processes of a group (DeepSpeed Ulysses), for pairs longer than one GPU holds (`sequence_parallel_size: N`).

Every process of a group collates the same micro-batch (its width padded to a multiple of N) and runs the model on its
1/N of the columns (`forward`). In every attention layer DeepSpeed's `UlyssesSPAttentionHF` all-to-alls q, k and v to
the whole rows for 1/N of the heads, and attention runs with the WHOLE rows' boundaries (`whole_row_inputs`):
DeepSpeed's own wrapper drops 4D masks and rebuilds a causal-only block mask for flex, which would let packed sequences
see each other, so only its attention module is used. Each local position is labelled with the next token of the whole
row, and the per-token outputs are gathered over the group, so TRL's loss sees whole sequences; the gather's backward
sums the group's gradients, so the engine's average is the gradient without the split.
"""

import threading

import torch

from dpotrain.cluster import collectives
from dpotrain.cluster import sequence_parallel as groups
from dpotrain.forwards import flops, masks, packing
from dpotrain.recipe import upstream
from dpotrain.recipe.errors import plural

# The attentions a split forward runs, each with the whole rows' sequence boundaries (`whole_row_inputs`); the forward
# choice takes no other (`choice.sequence_parallel_forwards`). Not eager: Ulysses takes boolean masks, eager's additive.
ATTENTION = ("flex_attention", "sdpa", *sorted(packing.VARLEN_ATTENTION))

# A split forward's local position ids reach the attention wrapper two ways. As a model kwarg: transformers' activation
# checkpointing keeps each layer's kwargs and recomputes the layer in the backward, after the forward has returned (and
# on a GPU in autograd's own thread), where the recomputed attention must be split as the forward's was. And as state
# set around the forward, for the models whose layers keep the model's kwargs from their attention
# (`KWARGS_KEPT_FROM_ATTENTION`: their recompute cannot be split, so `model_problem` refuses checkpointing).
SPLIT = "dpotrain_split_positions"
_state = threading.local()
KWARGS_KEPT_FROM_ATTENTION = {"stablelm", "nemotron"}  # transformers 5.23: their layers call attention without them
_group: dict = {}  # this process's group, set once by `set_up`: size, rank, process group, Ulysses module


def size() -> int:
    return _group.get("size", 1)


def leads_group() -> bool:
    """Whether this process is the first of its group (the one whose metrics count: the others hold the same pairs)."""
    return _group.get("rank", 0) == 0


def model_problem(config, router_aux_loss_coef: float | None, checkpointing: bool = False) -> str | None:
    """Why no group splits this model's rows (`router_aux_loss_coef`, `checkpointing`: the recipe's), or None (for the
    forward choice and the memory plan alike)."""
    if config.model_type in packing.BOUNDARY_HYBRIDS:  # their recurrent layers run on each process's columns only
        return (
            f"{config.model_type}'s recurrent layers read the sequence boundaries of the whole row (cu_seq_lens, "
            "seq_idx) and carry state along it, which a group splits; use --sequence_parallel_size 1 for hybrid models"
        )
    if scaled := sorted(rope_types(config.get_text_config()) & POSITION_SCALED_ROPE):
        return (
            f"{config.model_type}'s rope_type {scaled[0]!r} picks its frequencies from the largest position id a "
            "forward sees, and each process of a group sees only its own columns' (its scores would differ from the "
            "unsplit row's); use --sequence_parallel_size 1"
        )
    if upstream.has_attention_sinks(config):
        return (
            f"{config.model_type}'s attention sinks hold one value for each head of a layer, and a group gives each "
            "process a slice of the heads; use --sequence_parallel_size 1"
        )
    if checkpointing and config.model_type in KWARGS_KEPT_FROM_ATTENTION:
        return (
            f"{config.model_type}'s layers do not hand the model's inputs on to their attention, so a layer that "
            "activation checkpointing recomputes in the backward could not be split again; pass "
            "--activation_checkpointing false, or use --sequence_parallel_size 1"
        )
    # Last, the one a flag lifts: its balance is a product of sums over every token, and a process routes 1/N of them
    if coefficient := packing.router_loss_coefficient(config, router_aux_loss_coef):
        return (
            f"TRL adds the MoE router's load-balancing loss (router_aux_loss_coef {coefficient:g}), which is not split "
            "over a group here; pass --router_aux_loss_coef 0 to train without it, or use --sequence_parallel_size 1"
        )
    return None


# RoPE types whose frequencies transformers picks per forward from `max(position_ids) + 1` (`dynamic_rope_update`):
# the long or short factors of longrope, dynamic NTK's rescaling. Others (default, linear, llama3, yarn) are fixed.
POSITION_SCALED_ROPE = {"longrope", "dynamic"}


def rope_types(text) -> set:
    """The rope types of a text config: its `rope_parameters`' one, or each layer kind's (Gemma 3)."""
    params = getattr(text, "rope_parameters", None) or {}
    if "rope_type" in params:
        return {params["rope_type"]}
    return {p.get("rope_type") for p in params.values() if isinstance(p, dict)}


def set_up(sp_size: int, model) -> None:
    """This process's group (consecutive ranks) and the attention wrapper, once the process group and the model exist.
    Every process calls it (each group is made by all)."""
    if sp_size <= 1 or _group:
        return
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = masks.text_config(model)
    attention = upstream.attn_implementation(config)
    heads, kv_heads = groups.head_counts(model.config)
    rank, world = collectives.rank_and_world()
    made = [dist.new_group(list(range(first, first + sp_size))) for first in range(0, world, sp_size)]
    mine = made[groups.data_parallel_rank(rank, sp_size)]
    ulysses = UlyssesSPAttentionHF(
        attn=ALL_ATTENTION_FUNCTIONS[attention],
        batch_size=1,
        attn_head_count=heads,
        attn_head_size=flops.head_dim(config),
        kv_head_count=kv_heads,
        num_hidden_layers=config.num_hidden_layers,
        process_group=mine,
        seq_length_is_variable=True,
    )
    _group.update(size=sp_size, rank=groups.sequence_parallel_rank(rank, sp_size), group=mine, ulysses=ulysses)
    ALL_ATTENTION_FUNCTIONS[attention] = _Attention(ALL_ATTENTION_FUNCTIONS[attention], ulysses)
    if rank == 0:
        print(
            f"Sequence parallel: {plural(world // sp_size, 'group')} of {sp_size} processes, each process "
            f"1/{sp_size} of every packed row; {attention} over whole rows for {heads // sp_size} of {heads} heads "
            "per process (DeepSpeed Ulysses all-to-all)",
            flush=True,
        )


class _Attention:
    """The attention function transformers calls: Ulysses around the original inside a sequence-parallel forward, the
    original alone anywhere else (where a process holds whole sequences)."""

    def __init__(self, original, ulysses):
        self.original, self.ulysses = original, ulysses

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        local_positions = kwargs.pop(SPLIT, None)
        if local_positions is None:
            local_positions = getattr(_state, "position_ids", None)
        if local_positions is None:
            return self.original(module, query, key, value, attention_mask, *args, **kwargs)
        u = self.ulysses
        # Ulysses holds one shape for every call, and this layer's is set on it: rows per micro-batch vary (its
        # sequence length, dim 0, is variable and set by its forward from the query); so may the key/value heads and
        # the head width by layer (Gemma 4's full-attention layers), and the width between keys and values (DeepSeek's
        # MLA: values narrower), where Ulysses takes one width for all three: the query's, values padded with zeros to
        # it (they add nothing to an output column) and the output cut back. ([rows, heads, columns, width])
        (rows, heads, _, width), kv_heads, value_width = query.shape, key.shape[1], value.shape[-1]
        if value_width != width:
            value = torch.nn.functional.pad(value, [0, width - value_width])
        u.batch_size, u.attn_head_size, u.attn_head_count, u.global_kv_head_count = rows, width, heads, kv_heads
        u.local_q_head_count = heads // u.world_size
        u.kv_replication_factor = u.world_size // kv_heads  # key/value heads fewer than N: each rank gets one
        u.local_kv_head_count = 1 if u.kv_replication_factor > 1 else kv_heads // u.world_size
        u.required_query_shape = torch.Size([1, rows, heads, width])
        u.required_key_value_shape = torch.Size([1, rows, kv_heads, width])
        u.required_context_shape = torch.Size([1, rows, width * heads // u.world_size])
        kwargs["position_ids"] = local_positions  # Ulysses gathers them over the group
        # Ulysses sets the layer's num_key_value_groups for its split heads; a forward outside a split (samples) needs
        # the layer's own
        groups = getattr(module, "num_key_value_groups", None)
        try:
            output, weights = u(module, query, key, value, attention_mask, *args, **kwargs)
        finally:
            if groups is not None:
                module.num_key_value_groups = groups
        if value_width != width:  # [rows, columns, heads x width] -> each head's first value_width
            output = output.unflatten(-1, (-1, width))[..., :value_width].flatten(-2)
        return output, weights


class _GatherColumns(torch.autograd.Function):
    """All-gather along the columns over the group, whose backward gives each process the group's summed gradient of
    its own columns: all-reduced whole and sliced, since torch.distributed.nn's all-gather fails under gloo in every
    group but the first (torch 2.13: "Global rank 0 is not part of group")."""

    @staticmethod
    def forward(ctx, tensor):
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(_group["size"])]
        dist.all_gather(parts, tensor.contiguous(), group=_group["group"])
        ctx.cols = slice(_group["rank"] * tensor.shape[1], (_group["rank"] + 1) * tensor.shape[1])
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.clone(memory_format=torch.contiguous_format)  # all_reduce works in place, on contiguous memory
        dist.all_reduce(grad, group=_group["group"])
        return grad[:, ctx.cols]


def whole_row_inputs(model, batch: dict) -> dict:
    """The attention's inputs of the WHOLE rows: FlexAttention's block masks; for a varlen kernel no mask and the
    boundaries `cu_seq_lens_q/k` and `max_length_q/k`, which transformers' FlashAttention takes before the position ids
    (not `seq_idx`: its readers see only local columns); else dense masks, even without shared prompts (transformers
    would build one from the local slice's position ids only)."""
    attention = upstream.attn_implementation(masks.text_config(model))
    if attention == "flex_attention":
        return {"attention_mask": masks.block_masks(model, batch)}
    if packing.one_row(attention):
        return {"attention_mask": None} | {key: batch[key] for key in packing.VARLEN_KEYS}
    return {"attention_mask": masks.dense_masks(model, batch)}


def forward(model, batch: dict, **kwargs):
    """`packing.forward` split over the group: per-token outputs of the whole rows, `[rows, width-1]`."""
    n, rank = _group["size"], _group["rank"]
    width = batch["input_ids"].shape[1]
    if width % n:
        raise ValueError(
            f"a packed row of {width} positions cannot be split over {n} processes (the collator pads "
            "rows to a multiple of sequence_parallel_size)"
        )
    cols = slice(rank * width // n, (rank + 1) * width // n)
    # The label of every position is the next token of the whole row (the fused head would shift within the slice)
    shift_labels = torch.nn.functional.pad(packing.packed_labels(batch)[:, 1:], (0, 1), value=-100)
    local_positions = batch["position_ids"][:, cols]
    _state.position_ids = local_positions  # the forward in progress, for the attention wrapper
    try:
        outputs = model(
            input_ids=batch["input_ids"][:, cols],
            position_ids=local_positions,
            **whole_row_inputs(model, batch),
            shift_labels=shift_labels[:, cols],
            fused_lm_head=True,
            use_cache=False,
            **{SPLIT: local_positions},  # for the attention wrapper in a checkpointed layer's recompute too
            **kwargs,
        )
    finally:
        _state.position_ids = None
    # Each process's `[rows, width / N]` gathered as `[rows, width]`, in rank order (autograd flows back); the last
    # column predicts nothing.
    fields = {name: getattr(outputs, name, None) for name in packing.PER_TOKEN_FIELDS}
    fields = {name: None if t is None else _GatherColumns.apply(t)[:, : width - 1] for name, t in fields.items()}
    # `loss` is the local slice's (TRL's DPO loss reads the per-token outputs only)
    return type(outputs)(loss=outputs.loss, aux_loss=outputs.aux_loss, **fields)
