"""The model families users bring, as tiny random models: each trains with the smoke recipe, and where it packs, the
packed forward equals TRL's padded one.

Each family is a 2-layer, hidden-64 model built from its transformers config with the built-in tokenizer, trained for
3 optimizer steps with `configs/smoke.yaml` as it is (only the model, output folder and `max_steps` change) on 24 pairs.
Checked for every family: step 1's DPO loss is ln 2 (for MoE models without the router term, which TRL adds to the
loss), every parameter moved, and the forward is the one `packing.PACKING_TESTED` promises. Where it packs, the packed
rows (balanced rows for sdpa, one row as FlashAttention gets them) give TRL's padded per-token log-probs, loss and MoE
auxiliary loss in fp32.
"""

import copy
import json
import math
import re
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GraniteMoeHybridConfig
from trl.trainer.dpo_trainer import DataCollatorForPreference

import train_dpo
from conftest import ROOT, built, ready, tiny_model
from dpotrain.data import builtin
from dpotrain.forwards import packing
from dpotrain.recipe import upstream
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError

SMOKE = str(ROOT / "configs" / "smoke.yaml")
SMOKE_DATA = "data/smoke_prefs.jsonl"
# Sliding windows shorter than the longer pairs (up to ~550 tokens), so that packed rows must honour them too.
WINDOW = dict(sliding_window=64)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES = {
    # dense
    "llama": {},
    "qwen2": dict(use_sliding_window=True, max_window_layers=1, **WINDOW),
    "qwen3": {},
    "mistral": WINDOW,
    "gemma2": WINDOW,
    "gemma3_text": dict(layer_types=["sliding_attention", "full_attention"], **WINDOW),
    "phi3": WINDOW,
    "olmo2": {},
    "olmo3": dict(layer_types=["sliding_attention", "full_attention"], **WINDOW),
    "granite": {},
    "cohere": {},
    "cohere2": dict(layer_types=["sliding_attention", "full_attention"], **WINDOW),
    "glm": {},
    "glm4": {},
    "gemma": {},
    "phi": {},  # partial rotary, biases, no RMSNorm
    "starcoder2": WINDOW,
    "ministral": dict(layer_types=["sliding_attention", "full_attention"], **WINDOW),
    "smollm3": {},  # no rotary embedding in every 4th layer
    "exaone4": dict(layer_types=["sliding_attention", "full_attention"], **WINDOW),
    "seed_oss": {},  # attention and residual dropout 0.1 in its config, applied functionally
    "olmo": {},  # LayerNorm without weights
    "helium": {},
    "arcee": {},  # ReLU² MLP without a gate
    "apertus": {},  # xIELU activation, QK norm
    "ernie4_5": {},
    "hunyuan_v1_dense": {},  # QK norm
    "internlm3": {},  # a Llama in transformers
    "stablelm": {},  # partial rotary, LayerNorm
    "nemotron": {},  # partial rotary, LayerNorm1P, squared-ReLU MLP
    "gpt_neox": {},  # fused QKV, parallel residual, partial rotary
    "vaultgemma": dict(layer_types=["sliding_attention", "full_attention"], **WINDOW),  # eager only
    "granite_swa": dict(layer_types=["sliding_attention", "full_attention"], **WINDOW),  # eager only
    # mixture of experts
    "qwen3_moe": MOE,
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),  # router_aux_loss_coef 0.01: the step-1 stop
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(shared_expert_intermediate_size=32, **MOE),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),  # TRL's num_experts is its num_local_experts
    # attention sinks (eager on a CPU: no sdpa), sliding and full layers, a router loss; its own masks ignore position
    # ids, so its packed rows take the project's
    "gpt_oss": dict(
        num_local_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"], **WINDOW
    ),
    # a DeepSeek-V3-style router (no aux loss in transformers), a dense first layer, partial rotary
    "glm4_moe": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    ),
    # hash-routed then top-k MoE layers, compressed attention: TRL's num_experts is its n_routed_experts, named
    # num_local_experts by its config's map
    "deepseek_v4": dict(mlp_layer_types=["hash_moe", "moe"], num_local_experts=4, num_experts_per_tok=2),
    # Gemma 4's text model with each of its variants' features at once: full-attention layers twice as wide as the
    # sliding ones, per-layer input embeddings (E2B/E4B), the last layers reading earlier layers' keys and values with
    # MLPs twice as wide (E2B/E4B), full layers' keys as values with key/value heads of their own (attention_k_eq_v),
    # an MoE block beside the MLP (26B A4B; no router loss)
    "gemma4_text": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        head_dim=16,
        global_head_dim=32,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=1024,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        **WINDOW,
    ),
    # multi-head latent attention (its rotary part is head_dim), a dense first layer, no router loss in transformers
    "deepseek_v3": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        head_dim=8,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
    ),
    # hybrids: linear attention / Mamba layers beside attention
    "olmo_hybrid": dict(
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=32
    ),
    "qwen3_next": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        shared_expert_intermediate_size=32,
        **MOE,
    ),
    "granitemoehybrid": dict(
        layer_types=["linear_attention", "full_attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_chunk_size=64,
    ),
}


@pytest.fixture(scope="module")
def rows():
    return builtin.make_preference_rows(24, seed=3)


def build_model(model_type: str, folder, tokenizer_dir: str) -> str:
    return tiny_model(model_type, folder, tokenizer_dir, **FAMILIES[model_type])  # a family may change the shape


def smoke_trainer(model_dir, output_dir, rows, *overrides, max_steps=3):
    """configs/smoke.yaml as it is, but for the model, the output folder and max_steps."""
    recipe = parse_args(
        [
            "--config",
            SMOKE,
            "--model_name_or_path",
            model_dir,
            "--output_dir",
            str(output_dir),
            "--max_steps",
            str(max_steps),
            *overrides,
        ]
    )
    return built(recipe, datasets.Dataset.from_list(rows))


# Each builds and trains a model (1-25 s on the loaded 2-core machine): slow.
@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_family_trains_with_the_smoke_recipe(tmp_path, monkeypatch, capsys, tiny_model_dir, rows, model_type):
    monkeypatch.setenv("DPOTRAIN_CACHE", str(tmp_path / "cache"))
    model_dir = build_model(model_type, tmp_path / "model", tiny_model_dir)
    trainer = ready(smoke_trainer(model_dir, tmp_path / "run", rows))
    packs = model_type in packing.PACKING_TESTED
    assert trainer.packed == packs and trainer.run_plan.step_plan.padded == (not packs)
    # Prompts shared wherever packing is and the mask can be given (not a mask the model builds itself, not an MoE
    # router's aux loss): then the packed = padded check below runs on the shared rows.
    shares = packs and model_type not in (
        "mistral",
        "phi3",
        "starcoder2",
        "qwen3_moe",
        "olmoe",
        "mixtral",
        "qwen2_moe",
        "granitemoe",
        "gpt_oss",
    )
    assert trainer.forward.share_prompt == shares
    if not packs:  # the one-line note says why
        assert "Note: padded micro-batches" in capsys.readouterr().out
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()

    assert trainer.health.stop is None, trainer.health.alarms
    step1 = trainer.state.log_history[0]
    assert step1["step"] == 1
    moe = trainer.aux_loss_enabled
    # Step 1: the policy is the reference, so the DPO loss is ln 2; MoE models log it beside the total with the router
    # term, and the health guards judge it.
    dpo_loss = step1["dpo_loss"] if moe else step1["loss"]
    assert abs(dpo_loss - math.log(2)) < 1e-5, step1
    if moe:
        assert step1["loss"] == pytest.approx(dpo_loss + trainer.router_aux_loss_coef * step1["aux_loss"], abs=1e-6)
    unchanged = [n for n, p in trainer.model.named_parameters() if p.requires_grad and torch.equal(p, before[n])]
    assert not unchanged, unchanged

    if model_type == "granitemoehybrid":  # the num_experts alias for TRL is not written to config.json
        config = trainer.model.config
        plain = copy.copy(config)
        plain.__class__ = GraniteMoeHybridConfig
        trainer.model.save_pretrained(tmp_path / "saved")
        saved = json.loads((tmp_path / "saved" / "config.json").read_text())
        assert config.num_experts == saved["num_local_experts"] == 4 and "num_experts" not in saved
        assert saved == json.loads(plain.to_json_string())
    if packs:
        assert_packed_equals_padded(trainer, moe)


def assert_packed_equals_padded(trainer, moe: bool):
    """Per-token log-probs, TRL's loss (with the router term) and the MoE auxiliary loss of the trained model: packed
    rows (the trainer's balanced rows and FlashAttention's single row) against TRL's padded batch of the same pairs,
    each read from the forward its loss ran (`scored`)."""
    model = trainer.model.eval()
    # With their cached reference log-probs; the prompt's labeled earlier turns (assistant_turns: all) left out, as
    # TRL's padded collator knows none: the layouts are compared on the same labels.
    examples = [{k: v for k, v in trainer.train_dataset[i].items() if k != "prompt_labels"} for i in range(8)]
    padded = DataCollatorForPreference(
        pad_token_id=trainer.processing_class.pad_token_id, max_length=trainer.args.max_length
    )(examples)
    one_row = packing.PackedPreferenceCollator(trainer.args.max_length, one_row=True)(examples)
    packed = trainer.data_collator(examples)
    assert packed["input_ids"].shape[0] > 1 and one_row["input_ids"].shape[0] == 1
    with torch.no_grad():
        want_loss, want = scored(trainer, model, padded)  # TRL's single forward of the padded rows
        assert want.log_probs.shape[0] == padded["input_ids"].shape[0]  # [chosen..., rejected...] rows
        for batch in (packed, one_row):
            loss, got = scored(trainer, model, batch)
            assert (got.log_probs - want.log_probs).abs().max() < 1e-5
            # fp32 sums: relative past 1 (trained with every turn labeled, the loss on these labels is ~4.8)
            assert abs(loss - want_loss) < 1e-6 * max(1.0, abs(float(want_loss)))
            if moe:
                assert abs(got.aux_loss - want.aux_loss) < 1e-6
                # ... where TRL's own fused head, left alone, also counts the padding that ends each packed row
                # (given masks per layer kind, it reads no per-token mask at all: the recomputation is the only way)
                if batch is packed and model.config.model_type not in packing.masks.MASKS_GIVEN:
                    unmasked = packing.forward(model, batch, output_router_logits=True).aux_loss
                    assert abs(unmasked - want.aux_loss) > 1e-6
    if moe:  # gradients, the router's included, with activation checkpointing (the recipes' GPU setting)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # checkpointing acts in training mode only (these configs have no dropout)
        grads = []
        for batch in (packed, padded):
            model.zero_grad()
            trainer.compute_loss(model, batch).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        assert grads[0].keys() == grads[1].keys()
        for name, g in grads[1].items():
            assert (grads[0][name] - g).abs().max() <= 1e-5 + 1e-4 * g.abs().max(), name


def scored(trainer, model, batch: dict):
    """`trainer.compute_loss` of `batch`, and the outputs of the forward it ran in the padded `[2B, L]` layout (what
    answered TRL's model call: the packed forward for packed rows, TRL's own for padded ones), one forward for both."""
    stand_ins = []

    def kept(*args, **kwargs):
        found = stand_in(*args, **kwargs)
        stand_ins.append(found[0])
        return found

    stand_in = trainer._stand_in
    with upstream.attributes_set(trainer, _stand_in=kept):
        loss = trainer.compute_loss(model, batch)
    assert len(stand_ins) == 1, stand_ins  # the cached reference: the policy's forward alone
    return loss, stand_ins[0].outputs


@pytest.mark.slow
def test_parity_check_catches_state_carried_across_packed_rows(tmp_path, tiny_model_dir, rows):
    """`packing.parity`, the start-up check for hybrids, on CPU: OLMo hybrid's linear attention leaks from one
    sequence of a packed row into the next, and transformers refuses to pass it sequence boundaries without the
    kernels that honour them; a dense model agrees to fp32 rounding."""
    for model_type in ("olmo_hybrid", "llama"):
        folder = build_model(model_type, tmp_path / model_type, tiny_model_dir)
        trainer = smoke_trainer(folder, tmp_path / f"run-{model_type}", rows[:8], "--padding_free", "false").trainer
        model = trainer.model.eval()  # with TRL's fused LM head
        examples = [trainer.train_dataset[i] for i in range(4)]
        rows_collator = packing.PackedPreferenceCollator(trainer.args.max_length, hidden_size=64)
        with torch.no_grad():
            diff = packing.parity(model, rows_collator, examples)
            if model_type == "llama":
                assert diff < 1e-5
                assert packing.parity(model, packing.PackedPreferenceCollator(1024, one_row=True), examples) < 1e-5
            else:
                assert diff > 10 * packing.PARITY_TOLERANCE["fp32"], diff
                with pytest.raises(ValueError, match="packed sequences apart"):
                    packing.parity(model, packing.PackedPreferenceCollator(1024, one_row=True), examples)


@pytest.mark.slow
def test_a_hybrid_packs_only_when_asked_and_a_failed_check_stops_the_run(
    tmp_path, monkeypatch, capsys, tiny_model_dir, rows
):
    """A hybrid let through to the packed path (as a varlen FlashAttention would let it on a GPU): without
    `padding_free: true` the forward stage decides padded, with the note, and the check at start never runs; asked for,
    it packs, the check at start finds its packed rows apart from the sequences alone, and the run stops with the fix
    (the forward is never re-decided after the trainer is built)."""
    monkeypatch.setenv("DPOTRAIN_CACHE", str(tmp_path / "cache"))
    model_dir = build_model("olmo_hybrid", tmp_path / "model", tiny_model_dir)
    monkeypatch.setattr(packing, "packing_problem", lambda config: None)
    trainer = ready(smoke_trainer(model_dir, tmp_path / "run", rows, max_steps=1))
    assert (
        "Note: padded micro-batches (TRL's collator) on the same step plan, not packed sequences: olmo_hybrid's "
        "recurrent layers pack only when asked for (--padding_free true" in capsys.readouterr().out
    )
    assert not trainer.forward.packed and trainer.run_plan.step_plan.padded and trainer.args.padding_free is False
    trainer.train()
    assert abs(trainer.state.log_history[0]["loss"] - math.log(2)) < 1e-5
    with pytest.raises(
        ConfigError,
        match=r"^padding_free \(packed sequences\) cannot be used here: its packed rows "
        r"score .* nats away from the same sequences alone .*; set --padding_free "
        r"false$",
    ):
        smoke_trainer(model_dir, tmp_path / "run2", rows, "--padding_free", "true")


# A model folder with its own code, as `trust_remote_code` models ship it: a family's model (a Llama unless said) under
# another model_type.
REMOTE_CODE = """from transformers import {config}, {model}


class TinyRemoteConfig({config}):
    model_type = "tiny_remote"


class TinyRemoteForCausalLM({model}):
    config_class = TinyRemoteConfig
"""


def remote_code_model(folder, tiny_model_dir, model_type: str = "llama") -> Path:
    """A tiny `model_type` saved in `folder` as a model with its own code (`REMOTE_CODE`, named in config.json's
    auto_map)."""
    tiny_model(model_type, folder, tiny_model_dir, **FAMILIES.get(model_type, {}))
    config = json.loads((folder / "config.json").read_text())
    (model,) = config["architectures"]
    code = REMOTE_CODE.format(config=type(AutoConfig.for_model(model_type)).__name__, model=model)
    (folder / "modeling_tiny_remote.py").write_text(code)
    classes = {"AutoConfig": "TinyRemoteConfig", "AutoModelForCausalLM": "TinyRemoteForCausalLM"}
    auto_map = {k: f"modeling_tiny_remote.{v}" for k, v in classes.items()}
    config |= {"model_type": "tiny_remote", "architectures": ["TinyRemoteForCausalLM"], "auto_map": auto_map}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.slow
def test_a_model_with_its_own_code_trains_with_trust_remote_code_and_is_refused_in_one_line_without(
    tmp_path, monkeypatch, capsys, tiny_model_dir, rows
):
    """--trust_remote_code true was recorded and never passed on: transformers' ValueError asked for the flag given."""
    monkeypatch.setenv("DPOTRAIN_CACHE", str(tmp_path / "cache"))
    model_dir = remote_code_model(tmp_path / "model", tiny_model_dir)

    with pytest.raises(ConfigError, match="--trust_remote_code true"):
        smoke_trainer(str(model_dir), tmp_path / "refused", rows, max_steps=2)
    trainer = ready(smoke_trainer(str(model_dir), tmp_path / "run", rows, "--trust_remote_code", "true", max_steps=2))
    assert type(trainer.model).__name__ == "TinyRemoteForCausalLM"
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"), trust_remote_code=True)
    ids = torch.tensor([trainer.train_dataset[0]["prompt_ids"]])
    with torch.no_grad():
        assert torch.equal(saved(ids).logits, trainer.model.eval()(ids).logits)
    # A GPU recipe's dry run plans its memory on the model its own code builds
    capsys.readouterr()
    instruct = ["--config", str(ROOT / "configs" / "instruct.yaml"), "--dataset_name", str(ROOT / SMOKE_DATA)]
    instruct += ["--max_length", "1024", "--output_dir", str(tmp_path / "instruct")]
    train_dpo.main([*instruct, "--model_name_or_path", str(model_dir), "--trust_remote_code", "true", "--dry-run"])
    assert re.search(r"^  memory/GPU: +~[0-9.]+ GiB \(model states", capsys.readouterr().out, re.MULTILINE)


def test_packing_is_denied_by_default():
    """Only the model types proven above pack: a stateful model without `layer_types` (RWKV, Mamba) does not."""
    from transformers import AutoConfig

    # RWKV's config names no layer types; Mamba's names them; ERNIE-4.5-MoE is attention only, but untested here, and so
    # is Gemma 3's multimodal wrapper around a text model that packs.
    for model_type in ("rwkv", "ernie4_5_moe", "gemma3"):
        assert "not among those proven to pack" in packing.packing_problem(AutoConfig.for_model(model_type))
    assert "carry state across packed sequences" in packing.packing_problem(AutoConfig.for_model("mamba2"))
    llama = AutoConfig.for_model("llama")
    assert packing.packing_problem(llama) is None
    for attn in ("flash_attention_4", "kernels-community/flash-attn3", "kernels-community/vllm-flash-attn3@v1"):
        llama._attn_implementation = attn
        assert packing.packing_problem(llama) is None and packing.one_row(attn)
    hybrid = AutoConfig.for_model("olmo_hybrid")
    assert "varlen attention" in packing.packing_problem(hybrid)
    hybrid._attn_implementation = "flash_attention_2"
    assert packing.packing_problem(hybrid) is None and hybrid.model_type in packing.BOUNDARY_HYBRIDS


def test_a_hybrid_packs_only_when_padding_free_is_given():
    """The forward stage's rule for hybrids whose kernels read sequence boundaries (choice.hybrid_problem): padded
    with a note unless the recipe gives `padding_free: true`, then packed on the varlen kernel; on the CPU (no varlen
    kernel) asking is refused with the fix."""
    from transformers import AutoConfig

    from dpotrain.forwards import choice

    def smoke(*args):
        return parse_args(["--config", SMOKE, "--output_dir", "/tmp/unused", *args])

    for model_type in sorted(packing.BOUNDARY_HYBRIDS):
        hybrid = AutoConfig.for_model(model_type)
        forwards, notes = choice.candidates(copy.deepcopy(hybrid), smoke(), True, "flash_attention_4", False)
        assert [c.packed for c in forwards] == [False], model_type
        assert notes == [
            f"Note: padded micro-batches (TRL's collator) on the same step plan, not packed sequences: "
            f"{model_type}'s recurrent layers pack only when asked for (--padding_free true, on a varlen "
            "FlashAttention kernel, checked at start)."
        ]
        forwards, notes = choice.candidates(
            copy.deepcopy(hybrid), smoke("--padding_free", "true"), True, "flash_attention_4", False
        )
        assert [(c.attention, c.packed) for c in forwards] == [("flash_attention_4", True)]
        assert not any("padded" in note for note in notes), notes
        with pytest.raises(
            ConfigError, match="padding_free .* cannot be used here: .*varlen attention.*; set --padding_free false"
        ):
            choice.candidates(copy.deepcopy(hybrid), smoke("--padding_free", "true"), False, None)


def test_moe_router_loss_keeps_prompts_unshared():
    """TRL's router auxiliary loss is computed by the model from a per-token attention mask: MoE models pack with each
    prompt twice, unless the recipe sets the loss off (router_aux_loss_coef 0)."""
    from transformers import AutoConfig

    from dpotrain.forwards import shared_prompt

    olmoe = AutoConfig.for_model("olmoe", num_hidden_layers=2)
    assert "router auxiliary loss" in shared_prompt.share_problem(olmoe, "sdpa")
    assert shared_prompt.share_problem(olmoe, "sdpa", router_aux_loss_coef=0.0) is None


def test_varlen_attention_names_follow_transformers():
    """Every FlashAttention build transformers loads from the `kernels` hub counts as varlen here."""
    from transformers.modeling_flash_attention_utils import FLASH_ATTN_KERNEL_FALLBACK, FLASH_ATTN_KERNEL_VERSIONS

    flash_kernels = {name for name in FLASH_ATTN_KERNEL_VERSIONS if "flash-attn" in name}
    assert set(FLASH_ATTN_KERNEL_FALLBACK) | flash_kernels <= packing.VARLEN_ATTENTION


def parity_attention() -> str | None:
    """The varlen FlashAttention the GPU parity test runs on: the one a run on this machine would take (FA4, FA3 or
    FA2, whose kernels import), by the run's own function."""
    from dpotrain.forwards import choice

    return choice.installed_varlen(torch.cuda.is_available())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("model_type", ["llama", "gpt_oss", "olmo_hybrid", "granitemoehybrid"])
def test_parity_check_on_a_gpu(tmp_path, tiny_model_dir, rows, model_type):
    """On a GPU, in bf16 with a varlen FlashAttention: a dense model passes the start-up check (this is where the bf16
    tolerance meets real kernels), gpt-oss too where the kernel takes its attention sinks (FA4's `learnable_sink`; one
    that drops them is refused), and a hybrid asked to pack packs exactly when its boundary-aware kernels are
    installed; without them the check stops the run, naming the fix."""
    import importlib.util

    from dpotrain.forwards import choice

    attn = parity_attention()
    if attn is None:
        pytest.skip("no varlen FlashAttention installed (pip install -r requirements-gpu.txt)")
    model_dir = build_model(model_type, tmp_path / "model", tiny_model_dir)
    args = ["--attn_implementation", attn, "--bf16", "true"]
    if model_type == "gpt_oss" and choice.drops_sinks(AutoConfig.from_pretrained(model_dir), attn):
        with pytest.raises(ConfigError, match=f"^attn_implementation {attn} cannot run gpt_oss: its kernel takes no"):
            smoke_trainer(model_dir, tmp_path / "run", rows, *args)
        return
    if model_type in ("llama", "gpt_oss"):
        trainer = smoke_trainer(model_dir, tmp_path / "run", rows, *args).trainer
        examples = [trainer.train_dataset[i] for i in range(4)]
        collator = packing.PackedPreferenceCollator(trainer.args.max_length, one_row=True)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            diff = packing.parity(trainer.model, collator, examples)
        print(f"{model_type} bf16 {attn}: packed rows vs sequences alone, largest per-token difference {diff:.3g}")
        assert trainer.packed and diff <= packing.PARITY_TOLERANCE["half"]
        return
    args += ["--padding_free", "true"]  # a hybrid packs only when asked for (choice.hybrid_problem)
    kernels = {"olmo_hybrid": ("fla", "causal_conv1d"), "granitemoehybrid": ("mamba_ssm", "causal_conv1d")}[model_type]
    if all(importlib.util.find_spec(k) for k in kernels):  # they keep the sequences of one row apart: the check passes
        assert smoke_trainer(model_dir, tmp_path / "run", rows, *args).trainer.packed
    else:  # transformers refuses the boundaries without them: the run stops, naming the fix
        with pytest.raises(ConfigError, match="packed sequences apart.*; set --padding_free false"):
            smoke_trainer(model_dir, tmp_path / "run", rows, *args)


def test_disable_dropout_reaches_the_dropout_a_model_applies_itself():
    """TRL's `disable_dropout` zeroes `nn.Dropout` modules only; Seed-OSS drops out functionally at the rates its config
    gives (attention and residual, 0.1 each), so its policy trained with dropout against a reference scored without,
    and the step-1 guard stopped the run. The trainer zeroes those rates too, leaving the config (config.json) as is."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl.trainer.utils import disable_dropout_in_model

    from dpotrain.train import dropout

    config = AutoConfig.for_model("seed_oss", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    config.update(dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_implementation="eager"))
    assert (config.attention_dropout, config.residual_dropout) == (0.1, 0.1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    ids = torch.arange(12).view(1, 12)

    def same_twice() -> bool:
        with torch.no_grad():
            return torch.equal(model(ids).logits, model(ids).logits)

    disable_dropout_in_model(model)  # what TRL does
    assert not same_twice()
    dropout.disable(model)
    assert same_twice()
    assert (model.config.attention_dropout, model.config.residual_dropout) == (0.1, 0.1)


@pytest.mark.parametrize("model_type", ["falcon", "persimmon"])
def test_disable_dropout_reaches_the_dropout_a_model_reads_from_its_config(model_type):
    """Falcon (the old decoder too), GPT-Neo, GPT-J and Persimmon read their dropout rates from the config at each
    forward (`self.config.hidden_dropout`): no module attribute held them, so `dropout.disable` left them on, TRL's
    `disable_dropout` too, and `dropout.active` said none was on. Their modules now read a view of the config without
    the rates; the model's config (config.json) and what else it says (the attention kernel) are as they were."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl.trainer.utils import disable_dropout_in_model

    from dpotrain.train import dropout

    shape = {
        "falcon": dict(hidden_size=32, num_attention_heads=4, new_decoder_architecture=False, hidden_dropout=0.3),
        "persimmon": dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, hidden_dropout=0.3),
    }[model_type]
    config = AutoConfig.for_model(model_type, vocab_size=64, num_hidden_layers=2, **shape)
    config.update(dict(attention_dropout=0.3))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    ids = torch.arange(12).view(1, 12)

    def same_twice() -> bool:
        with torch.no_grad():
            return torch.equal(model(ids).logits, model(ids).logits)

    disable_dropout_in_model(model)  # what TRL does
    assert not same_twice() and dropout.active(model)
    dropout.disable(model)
    assert same_twice() and dropout.active(model) == []
    assert dropout.config_rates(model.config) == dropout.config_rates(config) != {}  # saved as it was
    twin = copy.deepcopy(model)  # TR-DPO's reference, a copy: without the rates too
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, twin(ids).logits)
    if model_type == "persimmon":  # the kernel switched for samples (samples.py) reaches the modules' view
        model.set_attn_implementation("sdpa")
        assert model.model.layers[0].self_attn.config._attn_implementation == "sdpa" and same_twice()


def test_disable_dropout_under_lora_leaves_the_config_the_adapter_answers_with():
    """PEFT's PeftModel and LoraModel answer with the model's config: given the view without dropout rates, the
    record, the model card and TRL read attention_dropout 0 there. Only the modules inside the model get the view."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl.trainer.utils import disable_dropout_in_model

    from dpotrain.train import dropout

    shape = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64)
    config = AutoConfig.for_model("persimmon", attention_dropout=0.3, hidden_dropout=0.3, **shape)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    lora = LoraConfig(r=4, target_modules=["query_key_value"], lora_dropout=0.0)
    model = get_peft_model(AutoModelForCausalLM.from_config(config), lora).train()
    disable_dropout_in_model(model)  # what TRL does, then the trainer
    dropout.disable(model)
    ids = torch.arange(12).view(1, 12)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model(ids).logits) and dropout.active(model) == []
    assert (model.config.attention_dropout, model.base_model.config.hidden_dropout) == (0.3, 0.3)


@pytest.mark.parametrize(
    "model_type", ["granitemoe", "granitemoeshared", "granitemoe_swa", "phimoe", "llama4_text", "deepseek_v4"]
)
def test_moe_configs_answer_to_the_num_experts_trl_reads(tmp_path, model_type):
    """TRL's fused LM head reads `config.num_experts` for the router loss; these configs name it `num_local_experts`:
    granitemoe's first training step was an AttributeError. The config answers to both, pickles, and saves as it was."""
    import pickle

    from transformers import AutoConfig, AutoModelForCausalLM

    from dpotrain.train.trainer import trl_compatible_config

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4)
    config = AutoConfig.for_model(model_type, num_local_experts=4, num_experts_per_tok=2, **shape)
    model = AutoModelForCausalLM.from_config(config)
    assert not hasattr(model.config, "num_experts")
    trl_compatible_config(model)
    assert model.config.num_experts == 4 and isinstance(model.config, type(config))
    assert pickle.loads(pickle.dumps(model.config)).num_experts == 4
    model.config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "num_experts" not in saved and saved == json.loads(config.to_json_string())


def test_a_head_width_that_varies_by_layer_is_planned_with_the_widest():
    """Gemma 4's text config gives each layer its own head_dim (full attention twice sliding's) and refuses a global
    one: the forward stage's FLOP estimate stopped with transformers' AmbiguousGlobalPerLayerAttributeError. The
    memory plan takes the widest; the FLOPs each layer's own (tests/test_metrics_flops.py)."""
    from transformers import AutoConfig

    from dpotrain.cluster import sequence_parallel
    from dpotrain.forwards import cost, flops
    from dpotrain.plan import memory

    kinds = ["sliding_attention", "full_attention"]
    config = AutoConfig.for_model(
        "gemma4_text", num_hidden_layers=2, layer_types=kinds, head_dim=16, global_head_dim=32
    )
    assert [layer.head_dim for layer in config.per_layer_config] == [16, 32]
    assert flops.head_dim(config) == 32
    heads = config.num_attention_heads
    assert cost.model_flops(config).attention_widths == (heads * 16, heads * 32)
    assert memory.formula_activation_bytes(config, 100, False) > 0
    # Full layers with key/value heads of their own: a global num_key_value_heads is refused too, which stopped the
    # memory plan and the sequence-parallel check with AmbiguousGlobalPerLayerAttributeError.
    config = AutoConfig.for_model(
        "gemma4_text",
        num_hidden_layers=2,
        layer_types=kinds,
        num_key_value_heads=2,
        num_global_key_value_heads=4,
        attention_k_eq_v=True,
    )
    assert sequence_parallel.head_counts(config) == (config.num_attention_heads, 4)
    assert memory.formula_activation_bytes(config, 100, False) > 0


# Each builds a model and loads its weights 4 times (~1 s on the loaded 2-core machine): slow, as the family's training.
@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_the_dry_run_refuses_a_familys_weights_as_their_load_does(tmp_path, tiny_model_dir, model_type):
    """The dry run refuses weights that lack some of the model's tensors from the names in their files alone
    (`weight_names.check`: transformers' load on the meta device): for every family, tied and untied, mixture of
    experts (its checkpoint's per-expert layout converted as it loads) and hybrid, it refuses what the model's load
    refuses (`trainer.whole_weights_only`), with the same line, and nothing else. The weights as saved, without the
    base model's prefix (transformers adds it) and without the output head where it is tied pass; DDP's `module.`
    names and an untied head left out are refused."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig
    from trl.trainer import dpo_trainer

    from dpotrain.train import trainer, weight_names

    model_dir = build_model(model_type, tmp_path / "model", tiny_model_dir)
    saved = load_file(f"{model_dir}/model.safetensors")
    recipe = parse_args(["--config", SMOKE, "--model_name_or_path", model_dir, "--output_dir", str(tmp_path / "run")])
    config = AutoConfig.from_pretrained(model_dir)
    head = [name for name in saved if name.startswith(("lm_head.", "embed_out."))]  # gpt_neox's: embed_out
    variants = {
        "as saved": saved,
        "without the base model's prefix": {name.removeprefix("model."): t for name, t in saved.items()},
        "without the output head": {name: t for name, t in saved.items() if name not in head},
        "from DDP": {f"module.{name}": t for name, t in saved.items()},
    }

    def loaded():
        with trainer.whole_weights_only():
            dpo_trainer.create_model_from_path(model_dir)

    refused = {}
    for variant, weights in variants.items():
        save_file(weights, f"{model_dir}/model.safetensors")
        lines = []
        for judge in (lambda: weight_names.check(recipe, model_dir, config), loaded):
            try:
                judge()
                lines.append(None)
            except ConfigError as e:
                lines.append(str(e))
        assert lines[0] == lines[1], variant
        refused[variant] = lines[1] is not None
    expected = {"as saved": False, "without the base model's prefix": False}
    assert refused == expected | {"without the output head": bool(head), "from DDP": True}


def test_deepseek_v4s_compressor_which_a_short_micro_batch_leaves_out_is_in_every_bucketed_graph(
    tmp_path, tiny_model_dir
):
    """DeepSeek V4's compressed attention compresses blocks of 128 positions: its compressor has no gradient after a
    shorter micro-batch, and under DDP or ZeRO-2 the ranks then reduced gradients of other sizes (a 2-process launch
    stopped at step 1: test_engines). Those parameters are found from a 2-token forward's graph and added to each
    loss times 0: the same loss, a gradient for every parameter. Nothing else is added, for it or any other model, nor
    where the engine does not reduce by bucket over several processes."""
    from dpotrain.cluster.engine import Engine
    from dpotrain.recipe import upstream
    from dpotrain.train import unused_parameters

    model = AutoModelForCausalLM.from_pretrained(build_model("deepseek_v4", tmp_path / "v4", tiny_model_dir)).train()
    loaded = upstream.attn_implementation(model.config)
    upstream.set_attn_implementation(model.config, "flex_attention")  # chosen for training: not run by the probe
    left_out = unused_parameters.left_out_by_a_short_forward(model, Engine("zero2"), world=2)
    assert upstream.attn_implementation(model.config) == "flex_attention"  # as it was
    upstream.set_attn_implementation(model.config, loaded)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)].split("compressor.")[-1] for p in left_out) == sorted(
        ["position_bias", "kv_proj.weight", "gate_proj.weight", "kv_norm.weight"] * 2  # in each of the 2 layers
    )
    assert all("compressor" in names[id(p)] for p in left_out) and model.training  # its mode as it was
    assert unused_parameters.left_out_by_a_short_forward(model, Engine("ddp"), world=2) == left_out
    for engine, world in ((Engine("zero2"), 1), (Engine("zero3"), 2), (Engine("fsdp2"), 2), (Engine("single"), 1)):
        assert unused_parameters.left_out_by_a_short_forward(model, engine, world) == []
    olmo3 = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert unused_parameters.left_out_by_a_short_forward(olmo3, Engine("zero2"), world=2) == []

    loss = model(input_ids=torch.ones((1, 16), dtype=torch.long)).logits.float().logsumexp(-1).mean()
    kept = unused_parameters.in_every_graph(loss, left_out)
    assert kept.item() == loss.item()
    kept.backward()
    assert all(p.grad is not None and not p.grad.any() for p in left_out)
