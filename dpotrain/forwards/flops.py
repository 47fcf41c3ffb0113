"""Model FLOPs of a micro-batch and the GPU's peak: what MFU (model FLOPs utilization) is made of.

A sequence of s tokens costs 6 N s + 12 d sum_layers sum_t min(t, w) FLOPs forward + backward: N the weight matrices'
entries (no input embedding, norms or biases; of routed experts, the share a token runs), d = heads x head dim, w a
sliding window (linear-attention layers left out). Padding is not counted: MFU counts the useful work. MFU = model
FLOPs per second per GPU / the GPU's dense bf16 peak (or the recipe's `gpu_peak_tflops`); not logged on a CPU.
"""

from dataclasses import dataclass

import torch

# Dense (no sparsity) bf16 tensor-core peaks from the vendor's data sheets, by a substring of the device name.
PEAK_BF16_TFLOPS = {"B200": 2250.0, "B100": 1750.0, "H200": 989.0, "H100": 989.0, "A100": 312.0}


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
    """Per layer of a text config: its sliding window, None for full attention, 0 for a linear-attention layer."""
    window = getattr(text, "sliding_window", None)
    kinds = layer_kinds(text)
    return tuple(None if k == "full_attention" else window if k == "sliding_attention" else 0 for k in kinds)


def mlp_width(text) -> int:
    """The MLP width a token runs: an MoE layer's experts per token x their width, else the dense intermediate size."""
    if moe := getattr(text, "moe_intermediate_size", None):
        return moe * getattr(text, "num_experts_per_tok", 1)
    return getattr(text, "intermediate_size", 4 * text.hidden_size)


def head_dim(text) -> int:
    """A text config's attention head width: its `head_dim`, else hidden size / heads (0 for a model without heads).
    A config whose head width varies by layer (Gemma 4: full-attention layers' twice its sliding ones') refuses a
    global `head_dim` with transformers' error: the widest layer's, an upper bound for the memory plan and the FLOPs."""
    if "head_dim" in (getattr(text, "per_layer_attributes", None) or ()):
        return max(layer.head_dim for layer in text.per_layer_config)
    heads = getattr(text, "num_attention_heads", 0) or 0
    return getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)


@dataclass(frozen=True)
class ModelFlops:
    matmul_params: int  # N: the weights of matrix products (no input embedding, norms or biases)
    attention_width: int  # d: heads x head dim of a layer's queries
    windows: tuple  # per layer: its sliding window, or None for full attention (linear-attention layers: 0)

    @classmethod
    def of(cls, model) -> "ModelFlops":
        config = model.config.get_text_config()

        def count(p) -> int:  # ZeRO-3 keeps an empty local partition and the full shape aside
            shape = getattr(p, "ds_shape", None) or p.shape
            return int(torch.Size(shape).numel()) if len(shape) >= 2 else 0  # norms and biases do no matrix product

        # MoE: a token runs num_experts_per_tok of the routed experts; their weights count for that share.
        counts = (getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
        experts = next((n for n in counts if n), None)
        active = getattr(config, "num_experts_per_tok", None)
        share = active / experts if experts and active else 1.0
        total = sum(count(p) * (share if "experts" in name.split(".") else 1.0) for name, p in model.named_parameters())
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        tied = head is not None and embedding is not None and head.weight is embedding.weight  # the head's matmul
        matmul = total - (count(embedding.weight) if embedding is not None and not tied else 0)
        heads = getattr(config, "num_attention_heads", 0) or 0
        return cls(matmul, heads * head_dim(config), layer_windows(config))

    def training(self, seq_lens, shared_prefixes=None) -> float:
        """Forward + backward FLOPs of sequences of these lengths, less `shared_prefixes` computed once for two."""
        saved = 0.0 if shared_prefixes is None or len(shared_prefixes) == 0 else self.forward(shared_prefixes)
        return 3 * (self.forward(seq_lens) - saved)

    def forward(self, seq_lens) -> float:
        lens = torch.as_tensor(seq_lens, dtype=torch.float64)
        flops = 2.0 * self.matmul_params * float(lens.sum())
        for window in self.windows:
            if window == 0:
                continue
            # sum over positions t = 1..s of min(t, w): s(s+1)/2 up to the window, then w per position
            w = lens if window is None else torch.clamp(lens, max=window)
            attended = w * (w + 1) / 2 + (lens - w) * w
            flops += 2.0 * 2.0 * self.attention_width * float(attended.sum())
        return flops
