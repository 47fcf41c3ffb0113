"""The model FLOPs behind the logged MFU (dpotrain/forwards/flops.py), against PyTorch's own FLOP counter."""

import pytest
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
    flops = ModelFlops(matmul_params=1000, attention_widths=(8, 8), windows=(None, 4))
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


def tiny_gemma4(**extra):
    """A 2-layer Gemma 4 text config: layer 0 slides (window 4, head dim 16), layer 1 attends fully with heads twice
    as wide (32); its per-layer input tables kept to the tiny vocabulary."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=300,
        vocab_size_per_layer_input=300,
        hidden_size=64,
        hidden_size_per_layer_input=8,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        sliding_window=4,
        **(dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]) | extra),
    )


def test_each_layer_counts_its_own_head_width_and_window():
    """Gemma 4 on a 16-token sequence, counted by hand. The old count gave both layers the widest head (4 x 32) and
    the weights the full layers' head dim in every layer: its attention FLOPs 1.5x, its N too high."""
    from dpotrain.forwards import cost

    work = cost.model_flops(tiny_gemma4())
    h, s = 64, 16
    sliding_attention = 2 * h * (4 * 16) + 2 * h * (2 * 16)  # q and o of 4 heads, k and v of 2, head dim 16
    full_attention = 2 * h * (4 * 32) + 2 * h * (2 * 32)  # head dim 32
    mlps = 2 * 3 * h * 128
    per_layer_inputs = 2 * 3 * h * 8  # each layer's gate and projection, and its share of the model's projection
    head = 300 * h
    assert work.matmul_params == sliding_attention + full_attention + mlps + per_layer_inputs + head
    sliding_keys = 1 + 2 + 3 + 4 + 12 * 4  # positions 1..4 attend to 1..4 keys, the 12 after to the window of 4
    full_keys = 16 * 17 / 2
    attention = 2 * 2 * (4 * 16) * sliding_keys + 2 * 2 * (4 * 32) * full_keys  # QK^T and AV, per key
    assert work.forward([s]) == 2 * work.matmul_params * s + attention
    assert work.training([s]) == 3 * (2 * work.matmul_params * s + attention)


def test_gemma4_forward_flops_match_torchs_counter():
    """The built model's count (what the MFU uses) against PyTorch's counter: eager computes each layer's whole s x s
    score matrix and masks it, so the masked keys are the difference, each layer at its own head width. The per-layer
    embedding tables (looked up, not multiplied) once counted as weights: an MFU many times too high."""
    from transformers import Gemma4ForCausalLM

    from dpotrain.forwards import cost

    config = tiny_gemma4()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(config).eval()
    s = 16
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(0, 300, (1, s)))
    ours = ModelFlops.of(model)
    assert ours == cost.model_flops(config)  # the forward's estimate and the MFU count alike
    masked = 2 * 2 * (4 * 16) * (s * s - 58) + 2 * 2 * (4 * 32) * (s * s - 136)
    counted = counter.get_total_flops()
    assert abs(ours.forward([s]) + masked - counted) / counted < 1e-6


KINDS = ["sliding_attention", "full_attention"]
TWO_OF_FOUR = dict(num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.mark.parametrize(
    "model_type, moe",
    [
        ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),  # experts as wide as intermediate_size
        ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, layer_types=KINDS)),
        ("qwen2_moe", dict(num_experts=4, **TWO_OF_FOUR)),  # and a shared expert
        ("glm4_moe", dict(n_routed_experts=4, first_k_dense_replace=1, **TWO_OF_FOUR)),  # a dense first layer
        ("hunyuan_v1_moe", dict(num_experts=4, moe_topk=2)),  # a shared MLP its config names no width for
        # its shipped config's moe_intermediate_size, per layer, which transformers does not read (intermediate_size)
        ("hunyuan_v1_moe", dict(num_experts=4, moe_topk=[2, 2], moe_intermediate_size=[32, 32])),
    ],
)
def test_the_forward_choice_counts_the_experts_a_token_runs(model_type, moe):
    """The forward is chosen from the config before the weights load (`cost.model_flops`): it counts what the MFU
    counts of the built model. It took one expert of intermediate_size width (Mixtral, gpt-oss: 2 run), and left out
    shared experts and DeepSeek-style dense first layers. Hunyuan-MoE's per-layer moe_intermediate_size (its shipped
    config's) stopped the run in a TypeError traceback as it chose its forward."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dpotrain.forwards import cost

    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = AutoConfig.for_model(model_type, **shape, num_key_value_heads=2, head_dim=16, **moe)
    torch.manual_seed(0)
    built = ModelFlops.of(AutoModelForCausalLM.from_config(config))
    estimated = cost.model_flops(config)
    # within the few biases and gates of one row the config does not describe (qwen2_moe's shared-expert gate)
    assert abs(estimated.matmul_params - built.matmul_params) / built.matmul_params < 0.01
    assert (estimated.attention_widths, estimated.windows) == (built.attention_widths, built.windows)


def test_dbrx_counts_the_experts_its_ffn_config_names():
    """DBRX names its experts, their width and the experts a token runs in `ffn_config` (moe_num_experts,
    ffn_hidden_size, moe_top_k): the forward's cost took a dense MLP 4 x hidden wide, and the MFU every expert's
    weights (at DBRX's shape, 16 experts of which 4 run: its MFU ~3x too high). Both now count the 2 of 4 that run."""
    from transformers import DbrxConfig, DbrxForCausalLM

    from dpotrain.forwards import cost, flops

    attention = dict(kv_n_heads=2, clip_qkv=8, rope_theta=10000.0)
    experts = dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2)
    config = DbrxConfig(d_model=64, n_heads=4, n_layers=2, vocab_size=300, attn_config=attention, ffn_config=experts)
    torch.manual_seed(0)
    built = ModelFlops.of(DbrxForCausalLM(config))
    attention_and_head = 2 * (64 * (64 + 2 * 2 * 16) + 64 * 64) + 300 * 64
    assert built.matmul_params == attention_and_head + 2 * (3 * 64 * 2 * 96 + 64 * 4)  # 2 experts a token, router
    assert cost.model_flops(config) == built
    assert flops.mlp_width(config) == 2 * 96 + 4


@pytest.mark.parametrize(
    "variant",
    [
        # the last 2 of 4 layers reuse earlier layers' keys and values (no k/v weights), their MLPs twice as wide
        dict(num_hidden_layers=4, layer_types=KINDS * 2, num_kv_shared_layers=2, use_double_wide_mlp=True),
        # full layers' keys double as values, with their own key/value heads: a global num_key_value_heads is refused
        dict(attention_k_eq_v=True, num_global_key_value_heads=1),
        dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),  # beside the dense MLP
    ],
)
def test_the_forward_choice_counts_what_a_gemma4_variant_runs(variant):
    """Gemma 4's kinds of layer, from the config as the built model counts them. A config with its own key/value
    heads for full layers stopped the forward's estimate with transformers' AmbiguousGlobalPerLayerAttributeError."""
    from transformers import Gemma4ForCausalLM

    from dpotrain.forwards import cost

    config = tiny_gemma4(**variant)
    torch.manual_seed(0)
    assert cost.model_flops(config) == ModelFlops.of(Gemma4ForCausalLM(config))


def test_latent_attention_counts_its_score_and_value_widths():
    """DeepSeek-V3's multi-head latent attention: scores qk_head_dim (8 + 8) wide, values v_head_dim (32); its
    head_dim is the rotary part alone (8), which the count took for the whole head: attention FLOPs 2.5x too few at
    DeepSeek-V3's own shape (192 and 128 against 64). Against torch's counter, as the Llama above."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from dpotrain.forwards import cost

    config = DeepseekV3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=32,
    )
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval()
    s = 20
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(0, 300, (1, s)))
    ours = ModelFlops.of(model)
    assert ours == cost.model_flops(config)
    assert ours.attention_widths == (4 * (16 + 32) / 2,) * 2
    masked = (2 * 4 * 16 + 2 * 4 * 32) * (s * s - s * (s + 1) / 2) * 2  # QK^T 16 wide, AV 32 wide, 2 layers
    counted = counter.get_total_flops()
    assert abs(ours.forward([s]) + masked - counted) / counted < 1e-6


@pytest.mark.parametrize("model_type", ["llama", "phi", "starcoder2", "arcee", "nemotron", "apertus", "gpt_neox"])
def test_an_mlp_without_a_gate_counts_two_matrices(model_type):
    """The forward's estimate from the config, against the built model: these MLPs are an up and a down projection,
    which the count took as gated (3 matrices: N 21% too high on these tiny shapes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dpotrain.forwards import cost

    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = AutoConfig.for_model(
        model_type, **shape, num_key_value_heads=4, pad_token_id=0, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    assert cost.model_flops(config) == ModelFlops.of(AutoModelForCausalLM.from_config(config))


@pytest.mark.parametrize("model_type", ["mistral", "mixtral", "phi3", "starcoder2"])
def test_a_window_without_layer_types_slides_in_every_layer(model_type):
    """These configs give `sliding_window` and no `layer_types`; their models mask every layer to the window. The count
    took every layer as full attention: on 16 tokens with a window of 4, 136 keys a layer against 58."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dpotrain.forwards import cost

    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = AutoConfig.for_model(model_type, **shape, num_key_value_heads=2, sliding_window=4, pad_token_id=0)
    work = cost.model_flops(config)
    assert work.windows == (4, 4)
    keys = 1 + 2 + 3 + 4 + 12 * 4  # per layer: positions 1..4 attend to 1..4 keys, the 12 after to 4
    assert work.forward([16]) == 2 * work.matmul_params * 16 + 2 * (2 * 2 * (4 * 16) * keys)
    assert ModelFlops.of(AutoModelForCausalLM.from_config(config)).windows == (4, 4)  # the MFU's count alike


@pytest.mark.parametrize("model_type", ["mamba", "mamba2", "rwkv"])
def test_a_model_without_attention_is_costed_and_planned(model_type):
    """Mamba, Mamba 2 and RWKV configs name no `num_attention_heads`: such a model trains padded (docs/speed.md), but
    the forward's cost (every run, before the weights load), the reference stage's micro-batch under eager attention
    and the memory plan's formula (a bf16 run and its dry run) each read the heads and stopped the run with an
    AttributeError. No attention is counted: its layers are costed by their other weights, which tokens pass alone."""
    from transformers import AutoConfig

    from dpotrain.cluster import sequence_parallel
    from dpotrain.forwards import cost
    from dpotrain.plan import memory

    shape = dict(num_heads=2, head_dim=64) if model_type == "mamba2" else {}  # its heads are the SSM's, not attention
    config = AutoConfig.for_model(model_type, vocab_size=300, hidden_size=64, num_hidden_layers=2, **shape)
    assert not hasattr(config, "num_attention_heads")
    work = cost.model_flops(config)
    assert work.attention_widths == (0, 0) and work.matmul_params > 300 * 64
    assert work.forward([10]) == 2 * work.matmul_params * 10  # tokens pass the weights; no attention term
    assert sequence_parallel.head_counts(config) == (0, 0)
    assert memory.mask_bytes("eager", 16, 16, config, False) == 16 * 16 * memory.BF16  # the one mask, no per-head probs
    assert memory.formula_activation_bytes(config, 16, False) > 0
    assert 1 <= memory.forward_only_multiple(config, 1024, 1024, "eager", False) <= memory.REFERENCE_MULTIPLE_MOST


def test_an_mlp_width_given_per_layer_is_each_layers_own():
    """Gemma 3n's config gives `intermediate_size` per layer (a list): the forward's cost multiplied the list, and the
    memory plan's formula (where its trace fails, as Gemma 3n's does) stopped a bf16 run's dry run in a TypeError
    traceback. Each layer's MLP is counted at its own width; the formula takes the widest."""
    from transformers import AutoConfig

    from dpotrain.forwards import cost, flops
    from dpotrain.plan import memory

    shape = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    shape |= dict(num_kv_shared_layers=0)  # none of its 2 layers reuses another's keys and values (15 by default)
    config = AutoConfig.for_model(
        "gemma3n_text", **shape, intermediate_size=[96, 128], activation_sparsity_pattern=[0.0, 0.0]
    )
    assert [flops.mlp_params(config, i) for i in (0, 1)] == [3 * 64 * 96, 3 * 64 * 128]  # gated: 3 matrices each
    assert flops.mlp_width(config) == 128
    assert cost.model_flops(config).matmul_params > 3 * 64 * (96 + 128)
    narrow = AutoConfig.for_model("gemma3n_text", **shape, intermediate_size=96, activation_sparsity_pattern=[0.0, 0.0])
    assert memory.formula_activation_bytes(config, 16, False) > memory.formula_activation_bytes(narrow, 16, False)


def test_experts_given_per_layer_are_each_layers_own():
    """Hunyuan-MoE's shipped config gives `moe_topk` per layer (a list; `num_experts` may be one too): the forward's
    cost multiplied the list, and the run stopped in a TypeError traceback as it chose its forward (the MFU's count of
    the built model divided it). Each layer's MLP is counted with its own experts; the MFU takes their mean share."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dpotrain.forwards import cost, flops

    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    shape |= dict(num_key_value_heads=2, head_dim=16, num_experts=4)
    listed = AutoConfig.for_model("hunyuan_v1_moe", **shape, moe_topk=[2, 1])
    each = [AutoConfig.for_model("hunyuan_v1_moe", **shape, moe_topk=k) for k in (2, 1)]
    assert [flops.mlp_params(listed, i) for i in (0, 1)] == [flops.mlp_params(each[i], i) for i in (0, 1)]
    assert flops.mlp_params(listed, 0) > flops.mlp_params(listed, 1)
    assert cost.model_flops(listed).matmul_params == pytest.approx(
        sum(cost.model_flops(c).matmul_params for c in each) / 2
    )
    torch.manual_seed(0)
    built = [ModelFlops.of(AutoModelForCausalLM.from_config(c)).matmul_params for c in (listed, *each)]
    assert built[0] == pytest.approx((built[1] + built[2]) / 2)
