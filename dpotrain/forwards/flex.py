"""FlexAttention compiled once per run (docs/attention.md, "FlexAttention, compiled once per run"), registered as
transformers' `flex_attention` (`install`) in place of transformers' own, which recompiles per row width, window and
training flag until dynamo, past its recompile limit, runs it uncompiled and out of memory (310 GiB at the think
recipe's step 1). Here one `torch.compile(dynamic=True, fullgraph=True)` of `_flex`, the block mask's tables marked
dynamic, the window a tensor and whole tiles told to the compiler leave the autograd mode in the guards (about three
compilations a run); should dynamo still give flex up, the run stops with one line (`uncompiled_reason`).
"""

import functools

import torch
from transformers import TrainerCallback

from dpotrain.forwards.masks import BLOCK
from dpotrain.recipe import upstream
from dpotrain.recipe.errors import RunError

# The compiler backend. Tests set a cheap one ("eager"): recompilations are decided by dynamo's guards before any
# backend sees the graph, so counting them holds for inductor too (tests/test_forwards.py).
BACKEND = "inductor"
_assume = upstream.compiler_check()  # torch._check


def _flex(query, key, value, block_mask, scale, enable_gqa, score_mod, lse: bool = False):
    """FlexAttention's output, and with `lse` its log-sum-exp per query (float32) for `with_sinks`."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    if not torch.compiler.is_compiling():  # dynamo ran this frame without compiling it
        raise RunError(uncompiled_reason())
    # Rows are whole tiles (the collators pad them to BLOCK; `attention` sends no other width here). Compiled with
    # dynamic sizes the compiler cannot prove it and bounds-checks every tile's loads: told, it leaves them out.
    _assume(query.shape[-2] % BLOCK == 0)
    _assume(key.shape[-2] % BLOCK == 0)
    kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
    if not lse:
        return flex_attention(query, key, value, **kwargs)
    out, aux = flex_attention(query, key, value, return_aux=AuxRequest(lse=True), **kwargs)
    return out, aux.lse


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a learnable sink per head (gpt-oss): the softmax over the scores and the sink, from flex's over
    the scores alone, out x exp(lse) / (exp(lse) + exp(sink)) = out x sigmoid(lse - sink), as transformers'
    `flex_attention_forward` renormalizes (here in float32). `out` `[batch, heads, width, head_dim]`."""
    scale = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1)).unsqueeze(-1)
    return (out.float() * scale).to(out.dtype)


@functools.cache
def compiled_flex(backend: str):
    return torch.compile(_flex, dynamic=True, fullgraph=True, backend=backend)


def compilations() -> int:
    """How many compiled variants of the flex function this process holds (one per set of guards)."""
    return upstream.compilations_of(_flex.__code__)


def uncompiled_reason() -> str:
    dynamo = upstream.dynamo_config()
    fix = "see docs/attention.md, or run on another attention (--attn_implementation sdpa, or share_prompt false)"
    if dynamo.disable:
        why = "torch.compile is disabled (TORCH_COMPILE_DISABLE=1)"
    else:
        why = (
            f"torch.compile gave it up after {compilations()} compilations (torch._dynamo.config.recompile_limit "
            f"is {dynamo.recompile_limit}; TORCH_LOGS=recompiles says what changed)"
        )
    return (
        f"FlexAttention would run uncompiled, materializing each row's whole score matrix (out of memory at these "
        f"widths): {why}; {fix}"
    )


TABLES = [
    f"{full}{side}_{part}" for full in ("", "full_") for side in ("kv", "q") for part in ("num_blocks", "indices")
]


def _mark_dynamic(block_mask) -> None:
    """The tile dimensions of the block mask's tables (`[rows, heads, q tiles(, k tiles)]`) as dynamic sizes."""
    for name in TABLES:
        table = getattr(block_mask, name, None)
        if table is not None:
            for dim in range(2, table.dim()):
                upstream.mark_dynamic(table, dim)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """transformers' attention interface: `[batch, heads, width, head_dim]` in, `([batch, width, heads, head_dim],
    None)` out, `attention_mask` a `BlockMask`."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.flex_attention import flex_attention_forward, repeat_kv

    if dropout > 0:
        raise ValueError("flex_attention does not support attention dropout: set the model's attention_dropout to 0")
    sinks = kwargs.get("s_aux")  # learnable attention sinks, one per head (gpt-oss, Granite SWA): `with_sinks`
    if (
        kwargs.get("position_bias") is not None
        or not isinstance(attention_mask, BlockMask)
        or query.shape[-2] % BLOCK
        or key.shape[-2] % BLOCK
    ):
        # position biases, a dense mask or rows not padded to whole tiles (not the collators'): none of the models and
        # batches this project packs; transformers' own
        return flex_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, softcap=softcap, **kwargs
        )
    enable_gqa = True
    heads = query.shape[1]
    if heads & (heads - 1):  # as transformers does: grouped-query attention in the kernel for powers of two only
        key, value = repeat_kv(key, heads // key.shape[1]), repeat_kv(value, heads // value.shape[1])
        enable_gqa = False
    score_mod = None
    if softcap is not None:
        # A tensor, as the mask's window: a Python float becomes a symbolic float under the dynamic compile, which
        # flex_attention refuses as a score_mod input (Gemma 2's attention logit cap stopped its first forward).
        cap = torch.tensor(softcap, dtype=torch.float32, device=query.device)

        def score_mod(score, b, h, q, k):
            return cap * torch.tanh(score / cap)

    args = (query, key, value, attention_mask, scaling, enable_gqa, score_mod, sinks is not None)
    if torch.compiler.is_compiling():  # inside a compiled region (a compiled decoder layer): traced into its graph
        out = _flex(*args)
    else:
        _mark_dynamic(attention_mask)
        try:
            out = compiled_flex(BACKEND)(*args)
        except upstream.recompile_limit_hit() as e:  # fullgraph: dynamo refuses to run it uncompiled
            raise RunError(uncompiled_reason()) from e
    if sinks is not None:
        out = with_sinks(*out, sinks)
    return out.transpose(1, 2).contiguous(), None


def install() -> None:
    """Make every model of this process that runs `flex_attention` call `attention` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register("flex_attention", attention)


class CompilationReport(TrainerCallback):
    """One line at the end of training: how many times FlexAttention was compiled (the GPU tests read it)."""

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            dynamo = upstream.dynamo_config()
            print(
                f"FlexAttention: {compilations()} compilations this run (recompile limit {dynamo.recompile_limit})",
                flush=True,
            )
