"""Model FLOPs of a micro-batch and the GPU's peak: what MFU (model FLOPs utilization) is made of.

A sequence of s tokens costs 6 N s + 12 sum_layers d_l sum_t min(t, w_l) FLOPs forward + backward: N the weight
matrices' entries (no embedding tables, norms or biases; of routed experts, the share a token runs), d_l = heads x
head dim of layer l (Gemma 4: its full-attention layers' wider heads), w_l its sliding window (linear-attention layers
left out). Padding is not counted: MFU counts the useful work. MFU = model
FLOPs per second per GPU / the GPU's dense bf16 peak (or the recipe's `gpu_peak_tflops`); not logged on a CPU.
"""

from dataclasses import dataclass

import torch

# Dense (no sparsity) bf16 tensor-core peaks from the vendor's data sheets, by a substring of the device name.
PEAK_BF16_TFLOPS = {"B200": 2250.0, "B100": 1750.0, "H200": 989.0, "H100": 989.0, "A100": 312.0}
# The names MoE configs give their routed experts, one per model family (absent or 0 in a dense model)
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
# DBRX keeps its MoE's fields in `ffn_config` under names of its own: the config's name for each of the fields read here
FFN_CONFIG_NAMES = {
    "num_experts": "moe_num_experts",
    "num_experts_per_tok": "moe_top_k",
    "moe_intermediate_size": "ffn_hidden_size",
}


def moe_field(text, name: str):
    """A text config's MoE field (`EXPERT_COUNTS`, `num_experts_per_tok`, `moe_intermediate_size`), or DBRX's in its
    `ffn_config` (`FFN_CONFIG_NAMES`): none at the top, and the counts took its experts for a dense MLP 4 x hidden wide
    (the forward's cost) and all 16 for run by every token (the MFU: ~3x too high at DBRX's shape)."""
    value = getattr(text, name, None)
    ffn = getattr(text, "ffn_config", None)
    return getattr(ffn, FFN_CONFIG_NAMES.get(name, name), None) if value is None and ffn is not None else value


def peak_tflops(given: float | None = None) -> float | None:
    """The GPU's dense bf16 peak in TFLOP/s: `given` (the recipe's `gpu_peak_tflops`), else by the device's name."""
    if given or not torch.cuda.is_available():
        return given or None
    return peak_of(torch.cuda.get_device_name())


def peak_of(name: str) -> float | None:
    """The dense bf16 peak of the GPU so named ("NVIDIA H100 80GB HBM3", "B200"), None for one not in the table."""
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def layer_kinds(text) -> list[str]:
    """Each layer's kind in a text config: its `layer_types`, else full attention (a config without them)."""
    return getattr(text, "layer_types", None) or ["full_attention"] * getattr(text, "num_hidden_layers", 1)


def layer_windows(text) -> tuple:
    """Per layer of a text config: its sliding window, None for full attention, 0 for a linear-attention layer. A
    config without `layer_types` but with a `sliding_window` (Mistral, Mixtral, Phi-3, StarCoder2; not where
    `use_sliding_window` is false) slides in every layer: its model builds one sliding mask for all."""
    window = getattr(text, "sliding_window", None)
    if not getattr(text, "layer_types", None) and window and getattr(text, "use_sliding_window", True) is not False:
        return (window,) * getattr(text, "num_hidden_layers", 1)
    kinds = layer_kinds(text)
    return tuple(None if k == "full_attention" else window if k == "sliding_attention" else 0 for k in kinds)


def mlp_width(text) -> int:
    """The MLP width a token runs in the widest layer, for the memory plan's formula: of an MoE layer its routed
    experts per token x their width (`moe_intermediate_size`, else `intermediate_size`: Mixtral), any shared expert,
    and one more per expert for the router's logits (fp32); else the dense intermediate size (`mlp_params`' layers)."""
    layers = range(len(layer_kinds(text)))
    beside = [dense_width(text, i) if getattr(text, "enable_moe_block", None) else 0 for i in layers]  # Gemma 4
    widths = [dense_width(text, i) if (moe := _moe(text, i)) is None else sum(moe) + beside[i] for i in layers]
    return max(widths, default=dense_width(text, 0))


def dense_width(text, layer: int) -> int:
    """A layer's dense MLP width: `intermediate_size`, one per layer where it is a list (Gemma 3n's), else 4 x hidden.
    A list was multiplied as a list: the plans stopped in a TypeError traceback."""
    width = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    return width[layer] if isinstance(width, list | tuple) else width


def per_layer(text, name: str) -> list:
    """Each layer's value of a config attribute: Gemma 4's `per_layer_config` gives some their own (head_dim,
    num_key_value_heads of full-attention layers) and refuses the global one; else the global value for all."""
    layers = len(layer_kinds(text))
    if name in (getattr(text, "per_layer_attributes", None) or ()):
        return [getattr(text.per_layer_config[i], name) for i in range(layers)]
    return [head_dim(text) if name == "head_dim" else getattr(text, name, None)] * layers


def kv_matrices(text, layer: int) -> int:
    """The key and value projections a layer has: none where it reuses an earlier layer's keys and values (Gemma 4's
    `num_kv_shared_layers`), one where its keys double as values (Gemma 4's `attention_k_eq_v`, full layers), else 2."""
    if _reuses_kv(text, layer):
        return 0
    return 1 if getattr(text, "attention_k_eq_v", False) and layer_kinds(text)[layer] == "full_attention" else 2


def _reuses_kv(text, layer: int) -> bool:
    modes = getattr(text, "kv_sharing_modes", None) if getattr(text, "num_kv_shared_layers", 0) else None
    return bool(modes) and modes[layer] == "reuse"


def attention_widths(text) -> tuple:
    """Per layer of a text config: query heads x that layer's head dim (the mean of score and value widths where they
    differ), 0 for a linear-attention layer (no softmax attention). Gemma 4's sliding layers have half the head dim of
    its full ones: the widest for every layer counted up to 2x their attention FLOPs."""
    heads = getattr(text, "num_attention_heads", 0) or 0
    dims = per_layer(text, "head_dim")
    if getattr(text, "kv_lora_rank", None):  # multi-head latent attention: scores qk_head_dim wide, values v_head_dim
        dims = [(text.qk_head_dim + text.v_head_dim) / 2] * len(dims)  # (its head_dim is only the rotary part)
    return tuple(0 if window == 0 else heads * d for window, d in zip(layer_windows(text), dims, strict=True))


# Model types whose dense MLP is an up and a down projection (2 matrices, no gate): checked against the built models.
UNGATED_MLP = frozenset({"phi", "starcoder2", "arcee", "nemotron", "apertus", "gpt_neox"})


def mlp_params(text, layer: int) -> int:
    """The MLP weights a token runs in this layer (3 matrices of hidden x width, 2 where `UNGATED_MLP`): of an MoE
    layer the router, `num_experts_per_tok` routed experts (`moe_intermediate_size` wide, else `intermediate_size`:
    Mixtral, OLMoE, gpt-oss) and any shared expert; DeepSeek's first `first_k_dense_replace` layers, Qwen's
    `mlp_only_layers` dense; Gemma 4's MoE block beside its dense MLP."""
    h, dense = text.hidden_size, dense_width(text, layer)
    dense *= 2 if getattr(text, "use_double_wide_mlp", False) and _reuses_kv(text, layer) else 1  # Gemma 4
    moe = _moe(text, layer)
    if moe is None:
        return (2 if getattr(text, "model_type", None) in UNGATED_MLP else 3) * h * dense
    experts, routed, shared = moe
    return 3 * h * (routed + shared + (dense if getattr(text, "enable_moe_block", None) else 0)) + h * experts


# Model types whose every MoE layer runs a shared MLP as wide as `intermediate_size` beside the routed experts, which
# their config names no field for (Hunyuan-MoE's `shared_mlp`): checked against the built models.
SHARED_DENSE_MLP = frozenset({"hunyuan_v1_moe"})
# Model types whose routed experts are `intermediate_size` wide whatever `moe_intermediate_size` says: Hunyuan-MoE's
# shipped config gives one per layer (a list, which stopped the forward's choice in a TypeError traceback), and
# transformers builds its experts from `intermediate_size` alone. Checked against the built models.
DENSE_WIDE_EXPERTS = frozenset({"hunyuan_v1_moe"})


def _moe(text, layer: int) -> tuple[int, int, int] | None:
    """(experts, their width a token runs, shared experts' width) of an MoE layer; None for a dense one (`mlp_params`).
    Granite's shared MLP is `shared_intermediate_size` wide; `SHARED_DENSE_MLP`'s the dense width."""
    counts = (_at(moe_field(text, k), layer) for k in EXPERT_COUNTS)
    experts = next((n for n in counts if n), None)
    dense_layer = layer < (getattr(text, "first_k_dense_replace", None) or 0) or layer in (
        getattr(text, "mlp_only_layers", None) or ()
    )
    if not experts or dense_layer or getattr(text, "enable_moe_block", None) is False:
        return None
    own = getattr(text, "model_type", None) not in DENSE_WIDE_EXPERTS and moe_field(text, "moe_intermediate_size")
    width = own or dense_width(text, layer)
    active = _at(moe_field(text, "num_experts_per_tok") or getattr(text, "top_k_experts", None) or 1, layer)
    shared = (
        getattr(text, "shared_expert_intermediate_size", None)
        or getattr(text, "shared_intermediate_size", None)
        or (getattr(text, "n_shared_experts", None) or 0) * width
        or (dense_width(text, layer) if getattr(text, "model_type", None) in SHARED_DENSE_MLP else 0)
    )
    return experts, active * width, shared


def _at(value, layer: int):
    """A config value at one layer: Hunyuan-MoE's `moe_topk` and `num_experts` may be per-layer lists (its shipped
    config's are), which the FLOP counts multiplied as lists: the run stopped in a TypeError traceback as it chose
    its forward."""
    return value[layer] if isinstance(value, list | tuple) else value


def _mean(value):
    """A config value over the layers (`_at`'s lists by their mean)."""
    return sum(value) / len(value) if isinstance(value, list | tuple) and value else value


def head_dim(text) -> int:
    """A text config's attention head width: its `head_dim`, else hidden size / heads (0 for a model without heads).
    A config whose head width varies by layer (Gemma 4: full-attention layers' twice its sliding ones') refuses a
    global `head_dim` with transformers' error: the widest layer's, an upper bound for the memory plan (the FLOPs take
    each layer's own, `per_layer`)."""
    if "head_dim" in (getattr(text, "per_layer_attributes", None) or ()):
        return max(layer.head_dim for layer in text.per_layer_config)
    heads = getattr(text, "num_attention_heads", 0) or 0
    return getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)


def query_width(text) -> int:
    """The widest query/key head of any layer: `head_dim`'s, or multi-head latent attention's `qk_head_dim` (its
    head_dim is the rotary part alone, DeepSeek V3's 64 of 192)."""
    return text.qk_head_dim if getattr(text, "kv_lora_rank", None) else head_dim(text)


@dataclass(frozen=True)
class ModelFlops:
    matmul_params: int  # N: the weights of matrix products (no input embedding, norms or biases)
    attention_widths: tuple  # per layer: d, heads x head dim of its queries (`attention_widths`; 0: linear attention)
    windows: tuple  # per layer: its sliding window, or None for full attention (linear-attention layers: 0)

    @classmethod
    def of(cls, model) -> "ModelFlops":
        config = model.config.get_text_config()

        def count(p) -> int:  # ZeRO-3 keeps an empty local partition and the full shape aside
            shape = getattr(p, "ds_shape", None) or p.shape
            return int(torch.Size(shape).numel()) if len(shape) >= 2 else 0  # norms and biases do no matrix product

        # MoE: a token runs num_experts_per_tok of the routed experts; their weights count for that share.
        counts = (moe_field(config, k) for k in EXPERT_COUNTS)
        experts = _mean(next((n for n in counts if n), None))
        active = _mean(moe_field(config, "num_experts_per_tok") or getattr(config, "top_k_experts", None))  # Gemma 4
        share = active / experts if experts and active else 1.0
        total = sum(count(p) * (share if "experts" in name.split(".") else 1.0) for name, p in model.named_parameters())
        # Embedding tables are looked up, not multiplied: the input one and Gemma 4's per-layer ones (billions of
        # entries, once counted as matmul weights: an MFU many times too high). A head tied to the input table is one.
        head = model.get_output_embeddings()
        tables = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        tables.pop(id(head.weight) if head is not None else None, None)
        matmul = total - sum(count(w) for w in tables.values())
        return cls(matmul, attention_widths(config), layer_windows(config))

    def training(self, seq_lens, shared_prefixes=None) -> float:
        """Forward + backward FLOPs of sequences of these lengths, less `shared_prefixes` computed once for two."""
        saved = 0.0 if shared_prefixes is None or len(shared_prefixes) == 0 else self.forward(shared_prefixes)
        return 3 * (self.forward(seq_lens) - saved)

    def forward(self, seq_lens) -> float:
        lens = torch.as_tensor(seq_lens, dtype=torch.float64)
        flops = 2.0 * self.matmul_params * float(lens.sum())
        for width, window in zip(self.attention_widths, self.windows, strict=True):
            if window == 0:
                continue
            # sum over positions t = 1..s of min(t, w): s(s+1)/2 up to the window, then w per position
            w = lens if window is None else torch.clamp(lens, max=window)
            attended = w * (w + 1) / 2 + (lens - w) * w
            flops += 2.0 * 2.0 * width * float(attended.sum())
        return flops
