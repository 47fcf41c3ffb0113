"""Attention masks of packed rows, built on the device from the compact inputs the collators make.

A packed row says, per position, which unit it belongs to (`attention_block`: a shared pair, or one sequence), which
branch of that unit (`attention_branch`: 0 the shared prompt, 1 the chosen, 2 the rejected completion) and its position
id. Query q may attend to key k when they are in the same unit, k's position is not after q's, k is in the prompt or in
q's own branch, and, in a sliding-window layer, q's position is less than `window` past k's. Unshared rows are the case
of one branch, units found where position ids restart at 0. Two builders of the rule, one mask per layer kind:
`dense_masks` (sdpa, eager), built in place so the only temporaries are booleans, and `block_masks` (FlexAttention),
whose tables come from per-tile summaries, built once per micro-batch and kept in the batch (`CACHE`).
"""

import torch

from dpotrain.forwards.flops import layer_kinds, layer_windows
from dpotrain.recipe import upstream

BLOCK = 128  # FlexAttention's default tile: rows for flex are padded to a multiple of it (see the collators)
CACHE = "_block_masks"  # the batch key under which a micro-batch keeps its block masks


def causal_lm(model):
    """The transformers model inside whatever wraps it (DeepSpeed, DDP, FSDP, PEFT): the first in module order."""
    from transformers import PreTrainedModel

    return next(m for m in model.modules() if isinstance(m, PreTrainedModel))


def text_config(model):
    """The model's text config, through the wrappers engines put around it (a DeepSpeed engine's `config` is not)."""
    return causal_lm(model).config.get_text_config()


def windows(config) -> dict[str, int | None]:
    """The sliding window of each layer kind the model has (None: full attention). A config with a window and no layer
    kinds (Mistral, Phi-3, StarCoder2) slides in every layer (`layer_windows`): its one mask slides."""
    if not getattr(config, "layer_types", None):
        return {"full_attention": layer_windows(config)[0]}
    window = getattr(config, "sliding_window", None)
    return {kind: window if kind == "sliding_attention" else None for kind in sorted(set(layer_kinds(config)))}


def compact(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unit, branch, position) per position of the rows: a shared-prompt batch's own, else units where position ids
    restart at 0 and one branch."""
    pos = batch["position_ids"]
    if "attention_block" in batch:
        return batch["attention_block"], batch["attention_branch"], pos
    return (pos == 0).cumsum(dim=1), torch.zeros_like(pos, dtype=torch.int8), pos


NO_WINDOW = 2**31 - 1  # the window of a full-attention layer in `mask_mod`: further than any two positions are apart


def mask_mod_of(block: torch.Tensor, branch: torch.Tensor, pos: torch.Tensor, window: int | None):
    """FlexAttention's `mask_mod(b, h, q, k)` for the rule in the module doc. The window is a tensor (NO_WINDOW for
    full attention): the compiled FlexAttention guards on a Python value captured here, recompiling per layer kind."""
    window = torch.tensor(NO_WINDOW if window is None else window, device=pos.device)

    def mask_mod(b, h, q, k):
        allowed = (block[b, q] == block[b, k]) & (pos[b, q] >= pos[b, k])
        allowed = allowed & ((branch[b, k] == 0) | (branch[b, k] == branch[b, q]))
        return allowed & (pos[b, q] - pos[b, k] < window)

    return mask_mod


def dense_mask(block, branch, pos, window: int | None) -> torch.Tensor:
    """`[rows, 1, width, width]` booleans (True: attend), each comparison and-ed in place into the mask."""
    allowed = block.unsqueeze(2) == block.unsqueeze(1)
    allowed &= pos.unsqueeze(2) >= pos.unsqueeze(1)
    allowed &= (branch.unsqueeze(1) == 0) | (branch.unsqueeze(1) == branch.unsqueeze(2))
    if window is not None:
        allowed &= pos.unsqueeze(1) > (pos - window).unsqueeze(2)  # q - k < window, without a q - k tensor
    return allowed.unsqueeze(1)


def dense_masks(model, batch: dict):
    """The 4D masks of a shared-prompt batch for sdpa (boolean) or eager (additive), per layer kind (`_per_kind`)."""
    config = text_config(model)
    eager = upstream.attn_implementation(config) == "eager"
    dtype = next(model.parameters()).dtype

    def finish(allowed: torch.Tensor) -> torch.Tensor:
        if not eager:
            return allowed
        additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return additive.masked_fill_(~allowed, torch.finfo(dtype).min)

    block, branch, pos = compact(batch)
    return _per_kind(config, {kind: finish(dense_mask(block, branch, pos, w)) for kind, w in windows(config).items()})


def _per_kind(config, masks: dict):
    """A dict of masks per layer kind where the model has kinds, else the one mask."""
    return masks if getattr(config, "layer_types", None) else masks["full_attention"]


def _tiles(x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Per row and tile of BLOCK positions, the minimum and the maximum of `x`, each as (query tiles along dim 1, key
    tiles along dim 2)."""
    rows, width = x.shape
    tiles = x.long().view(rows, width // BLOCK, BLOCK)
    return tuple((t.unsqueeze(2), t.unsqueeze(1)) for t in (tiles.amin(dim=2), tiles.amax(dim=2)))


def block_tables(block, branch, pos, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(partial, full)`, `[rows, q tiles, k tiles]` booleans: the tile pairs whose mask must be evaluated, and those
    where every query attends to every key (the tests hold them to the dense mask). Sufficient conditions from per-tile
    minima and maxima: empty for a key tile after the query tile (every layout is causal along the row), unit ranges
    that do not meet, or keys beyond the window; full for one unit, every key before every query, in the prompt or the
    query's one branch, and within the window."""
    (bq_lo, bk_lo), (bq_hi, bk_hi) = _tiles(block)
    (rq_lo, rk_lo), (rq_hi, rk_hi) = _tiles(branch)
    (pq_lo, pk_lo), (pq_hi, pk_hi) = _tiles(pos)
    n = bq_lo.shape[1]
    q, k = torch.arange(n, device=block.device).view(n, 1), torch.arange(n, device=block.device).view(1, n)
    possible = (k <= q) & (bk_hi >= bq_lo) & (bk_lo <= bq_hi)
    one_unit = (bq_lo == bq_hi) & (bk_lo == bk_hi) & (bq_lo == bk_lo)
    branches = (rk_hi == 0) | ((rk_lo == rk_hi) & (rq_lo == rq_hi) & (rk_lo == rq_lo))
    full = (k < q) & one_unit & branches & (pk_hi <= pq_lo)
    if window is not None:
        possible &= pq_lo - pk_hi < window
        full &= pq_hi - pk_lo < window
    return possible & ~full, full


def _kv_blocks(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention's `(num_blocks, indices)` for a `[rows, q tiles, k tiles]` table."""
    num = table.sum(dim=2, dtype=torch.int32)
    indices = torch.argsort(table.to(torch.int8), dim=2, descending=True, stable=True).to(torch.int32)
    return num.unsqueeze(1), indices.unsqueeze(1)  # one head dimension: the mask is the same for every head


def block_mask(block, branch, pos, window: int | None):
    """The FlexAttention `BlockMask` of `[rows, width]` compact inputs (width a multiple of BLOCK)."""
    from torch.nn.attention.flex_attention import BlockMask

    width = block.shape[1]
    if width % BLOCK:
        raise ValueError(f"a row for FlexAttention must be a multiple of {BLOCK} positions wide (got {width})")
    partial, full = block_tables(block, branch, pos, window)
    num, indices = _kv_blocks(partial)
    full_num, full_indices = _kv_blocks(full)
    mask_mod = mask_mod_of(block, branch, pos, window)
    return BlockMask.from_kv_blocks(
        num, indices, full_num, full_indices, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(width, width)
    )


def block_masks(model, batch: dict):
    """The batch's block masks (`_per_kind`), built on the first call for a micro-batch and kept in it."""
    config = text_config(model)
    if CACHE not in batch:
        block, branch, pos = compact(batch)
        batch[CACHE] = {kind: block_mask(block, branch, pos, w) for kind, w in windows(config).items()}
    return _per_kind(config, batch[CACHE])


# Models whose own masks read the row alone, not its position ids (gpt-oss's forward gives its mask functions none):
# their packed rows on sdpa and eager get the project's masks per layer kind, as a shared prompt's rows do.
MASKS_GIVEN = {"gpt_oss"}


def attention_mask(model, batch: dict):
    """What a packed forward passes as `attention_mask`: block masks for FlexAttention, a dense mask for a shared
    prompt's rows on sdpa/eager and for a model whose own masks ignore position ids (`MASKS_GIVEN`), else
    nothing (transformers reads the position ids, a varlen kernel the boundaries)."""
    config = text_config(model)
    attn = upstream.attn_implementation(config)
    if attn == "flex_attention":
        return block_masks(model, batch)
    if "attention_branch" in batch or (config.model_type in MASKS_GIVEN and attn in ("sdpa", "eager")):
        return dense_masks(model, batch)
    return None
