"""The model FLOPs behind the logged MFU (dpotrain/forwards/flops.py), against PyTorch's own FLOP counter."""

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from dpotrain.forwards.flops import ModelFlops


def test_forward_flops_match_torchs_counter():
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config._attn_implementation = "eager"  # plain matmuls: the counter sees the whole score matrix
    model = LlamaForCausalLM(config).eval()
    s = 50
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(0, 300, (1, s)))
    counted = counter.get_total_flops()
    ours = ModelFlops.of(model)
    matrices = sum(p.numel() for p in model.parameters() if p.ndim == 2)
    assert ours.matmul_params == matrices - 300 * 64  # the weight matrices but the input embedding
    # The counter charges the full s x s score matrix (eager computes it, then masks); model FLOPs count the causal
    # half: position t attends to t tokens. The difference is exactly the masked part: 2 x 2 x d x s(s-1)/2 per layer.
    masked = 2 * 2 * 64 * s * (s - 1) / 2 * 2
    assert abs(ours.forward([s]) + masked - counted) / counted < 1e-9
    assert ours.training([s]) == 3 * ours.forward([s])


def test_sliding_windows_stop_at_the_window():
    flops = ModelFlops(matmul_params=1000, attention_width=8, windows=(None, 4))
    full = 2 * 1000 * 10 + 4 * 8 * (10 * 11 / 2)  # the full layer: positions attend to 1..10 tokens
    windowed = 4 * 8 * (4 * 5 / 2 + 6 * 4)  # the window of 4: 1, 2, 3, 4, then 4 for the 6 positions after
    assert flops.forward([10]) == full + windowed


def test_moe_counts_the_experts_a_token_runs():
    """A token runs 2 of the 8 routed experts: PyTorch's counter sees a quarter of the experts' weights per token."""
    config = Qwen3MoeConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # a loop of plain matmuls over the routed tokens, which the counter sees
    model = Qwen3MoeForCausalLM(config).eval()
    s = 40
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(0, 300, (1, s)))
    counted = counter.get_total_flops()
    ours = ModelFlops.of(model)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for n, p in model.named_parameters() if p.ndim >= 2 and ".experts." not in n) - 300 * 64
    assert ours.matmul_params == dense + experts * 2 / 8
    masked = 2 * 2 * 64 * s * (s - 1) / 2 * 2
    assert abs(ours.forward([s]) + masked - counted) / counted < 1e-6
