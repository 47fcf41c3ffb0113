"""The forwards and their choice (dpotrain/forwards/): FlexAttention's block mask is the dense mask, block for block;
FlexAttention scores packed rows (shared prompts or not) as sdpa does; rows stay within the memory plan's bound; an
attention implementation given in the recipe is honoured or refused, never replaced."""

import sys

import pytest
import torch
from test_shared_prompt import fused, per_token, random_pairs
from torch.nn.attention.flex_attention import create_mask
from transformers import AutoConfig

from conftest import ROOT, tiny_model
from dpotrain.data.pair_lengths import PairLengths
from dpotrain.forwards import choice, flex, masks, packing
from dpotrain.forwards.shared_prompt import SharedPromptCollator
from dpotrain.plan import plan
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError, RunError, run_cli

sys.path.insert(0, str(ROOT / "benchmarks"))
SMOKE = str(ROOT / "configs" / "smoke.yaml")


def random_layout(seed: int, shared: bool):
    """One flex row of random pairs: prompts of 1 to 300 tokens, completions of 1 to 200, so tile boundaries fall
    anywhere (inside a prompt, between branches, between pairs)."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 7, (1,), generator=g))
    sizes = torch.randint(1, 300, (n, 3), generator=g).tolist()
    pairs = [
        {"prompt_ids": [7] * p, "chosen_ids": [8] * (1 + c % 200), "rejected_ids": [9] * (1 + r % 200)}
        for p, c, r in sizes
    ]
    kind = SharedPromptCollator if shared else packing.PackedPreferenceCollator
    return kind(4096, one_row=True, pad_to_multiple_of=masks.BLOCK)(pairs)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_block_mask_is_the_dense_mask(seed, shared):
    batch = random_layout(seed, shared)
    block, branch, pos = masks.compact(batch)
    rows, width = block.shape
    tiles = width // masks.BLOCK
    for window in (None, 100, 300):
        dense = masks.dense_mask(block, branch, pos, window)
        assert torch.equal(
            create_mask(masks.mask_mod_of(block, branch, pos, window), rows, None, width, width, block.device), dense
        )
        partial, full = masks.block_tables(block, branch, pos, window)
        per_tile = dense[:, 0].view(rows, tiles, masks.BLOCK, tiles, masks.BLOCK).transpose(2, 3)
        seen, all_seen = per_tile.any(-1).any(-1), per_tile.all(-1).all(-1)
        assert not (seen & ~(partial | full)).any()  # no skipped tile holds a pair that may attend
        assert not (full & ~all_seen).any()  # a tile run without the mask is all allowed
        assert int((partial | full).sum()) < tiles * tiles or tiles == 1  # and tiles are skipped
        block_mask = masks.block_mask(block, branch, pos, window)
        assert torch.equal(block_mask.to_dense().bool(), (partial | full).unsqueeze(1))


@pytest.fixture
def cheap_flex(monkeypatch):
    """The project's compiled FlexAttention (forwards/flex.py), installed as transformers' `flex_attention`, on dynamo's
    "eager" backend: dynamo traces it and guards each compilation exactly as on a GPU (which compilations happen is
    decided by the guards, before a backend sees the graph), while inductor would take minutes per compilation on this
    CPU. Dynamo's caches start empty, so the counts are this test's own."""
    import torch._dynamo
    from transformers import AttentionInterface

    monkeypatch.setattr(flex, "BACKEND", "eager")
    monkeypatch.setitem(AttentionInterface._global_mapping, "flex_attention", flex.attention)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["olmo3", "llama"])
def test_flex_scores_packed_rows_as_sdpa_does(model, tiny_model_dir, llama_dir, cheap_flex):
    model_dir = tiny_model_dir if model == "olmo3" else llama_dir
    sdpa, on_flex = fused(model_dir, "sdpa"), fused(model_dir, "flex_attention")
    pairs = random_pairs(prompts=(150, 30, 1), completions=((40, 90), (200, 20), (7, 9)))  # past the 128 window
    for kind in (SharedPromptCollator, packing.PackedPreferenceCollator):
        with torch.no_grad():
            want = per_token(sdpa, kind(1024, hidden_size=64)(pairs))
            batch = kind(1024, one_row=True, pad_to_multiple_of=masks.BLOCK)(pairs)
            got = per_token(on_flex, batch)
        assert batch["input_ids"].shape[0] == 1 and batch["input_ids"].shape[1] % masks.BLOCK == 0
        assert (got - want).abs().max() < 1e-5, kind
        assert masks.CACHE in batch  # built once for the micro-batch, for every layer (and a live reference)
    assert flex.compilations() == 1  # through the project's compiled function: one compilation for both layouts


@pytest.mark.slow
def test_flex_keeps_the_window_of_a_model_whose_every_layer_slides(tiny_model_dir, tmp_path, cheap_flex):
    """Mistral, Phi-3 and StarCoder2 configs name a sliding window and no layer kinds: every layer slides (their models
    build one sliding mask for all). FlexAttention's block mask, which the model takes as given, slid in none of them:
    a packed row attended past the window, scoring other log-probs than sdpa's rows (and TRL's padded batches)."""
    model_dir = tiny_model("mistral", tmp_path, tiny_model_dir, sliding_window=64)
    sdpa, on_flex = fused(model_dir, "sdpa"), fused(model_dir, "flex_attention")
    pairs = random_pairs(prompts=(150, 30, 1), completions=((40, 90), (200, 20), (7, 9)))  # past the 64 window
    with torch.no_grad():
        want = per_token(sdpa, packing.PackedPreferenceCollator(1024, hidden_size=64)(pairs))
        got = per_token(
            on_flex, packing.PackedPreferenceCollator(1024, one_row=True, pad_to_multiple_of=masks.BLOCK)(pairs)
        )
    assert (got - want).abs().max() < 1e-5


def padded_log_probs(model, pairs, moe=False):
    """TRL's plain padded forward of `pairs` (its collator, the model's fused head): per-token outputs and the positions
    the loss reads."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    batch = DataCollatorForPreference(pad_token_id=0)(pairs)
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    extra = {"output_router_logits": True} if moe else {}
    out = model(**{k: batch[k] for k in ("input_ids", "attention_mask")}, labels=labels, fused_lm_head=True, **extra)
    return out, batch["completion_mask"][:, 1:].bool()


@pytest.mark.slow
def test_flex_runs_gemma2s_attention_logit_softcapping(tiny_model_dir, tmp_path, cheap_flex):
    """Gemma 2 caps its attention logits (`attn_logit_softcapping`, 50 in its configs) and has no sdpa, so on a GPU it
    runs flex first. The cap, a Python float in the score_mod, became a symbolic float under the dynamic compile, which
    flex_attention refuses: every Gemma 2 run on flex stopped at its first forward. Now: the padded eager scores."""
    caps = dict(sliding_window=64, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    model_dir = tiny_model("gemma2", tmp_path, tiny_model_dir, **caps)
    pairs = random_pairs(prompts=(150, 30, 1), completions=((40, 90), (200, 20), (7, 9)))  # past the 64 window
    with torch.no_grad():
        want, scored = padded_log_probs(fused(model_dir, "eager"), pairs)
        batch = packing.PackedPreferenceCollator(1024, one_row=True, pad_to_multiple_of=masks.BLOCK)(pairs)
        got = per_token(fused(model_dir, "flex_attention"), batch)
    assert (got - want.log_probs)[scored].abs().max() < 1e-5


@pytest.mark.slow
def test_flex_scores_an_moe_routers_loss_as_the_padded_forward(tiny_model_dir, tmp_path, cheap_flex):
    """TRL asks an MoE model (router_aux_loss_coef set, as Mixtral's and OLMoE's configs do) for its router loss, and
    its fused head computes it from the `attention_mask` it was given: on flex a BlockMask, which it cannot read
    (AttributeError at the first step). The packed forward's own loss over real tokens is TRL's padded one."""
    model_dir = tiny_model("mixtral", tmp_path, tiny_model_dir, num_local_experts=4, num_experts_per_tok=2)
    pairs = random_pairs(prompts=(150, 30, 1), completions=((40, 90), (200, 20), (7, 9)))
    with torch.no_grad():
        want, scored = padded_log_probs(fused(model_dir, "eager"), pairs, moe=True)
        batch = packing.PackedPreferenceCollator(1024, one_row=True, pad_to_multiple_of=masks.BLOCK)(pairs)
        on_flex = packing.PackedModel(fused(model_dir, "flex_attention"), batch)
        got = on_flex(fused_lm_head=True, output_router_logits=True)
    assert (got.log_probs - want.log_probs)[scored].abs().max() < 1e-5
    assert abs(float(got.aux_loss - want.aux_loss)) < 1e-6


SINKS = {  # models with learnable attention sinks: gpt-oss (experts, a router loss), Granite SWA (dense)
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"]),
    "granite_swa": dict(layer_types=["sliding_attention", "full_attention"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(SINKS))
def test_flex_scores_attention_sinks_in_the_projects_compiled_call(model_type, tiny_model_dir, tmp_path, cheap_flex):
    """gpt-oss and Granite SWA pack; on a GPU their rows run on flex. The project's compiled call handed a call with
    sinks to transformers' own flex function, which compiles per row width (the recompilations that stopped #52's first
    GPU run). It now runs them itself, flex's output renormalized by its log-sum-exp with the sink (`flex.with_sinks`):
    the scores of eager's packed rows (equal to the padded path: tests/test_architectures.py), in one compilation."""
    model_dir = tiny_model(model_type, tmp_path, tiny_model_dir, sliding_window=64, **SINKS[model_type])
    eager, on_flex = fused(model_dir, "eager"), fused(model_dir, "flex_attention")
    for model in (eager, on_flex):  # sinks far from 0, as a trained model's: their scale is what is checked
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, mean=1.0, std=2.0, generator=torch.Generator().manual_seed(0))
    kind = packing.PackedPreferenceCollator if model_type == "gpt_oss" else SharedPromptCollator  # its router loss
    pairs = random_pairs(prompts=(150, 30, 1), completions=((40, 90), (200, 20), (7, 9)))  # past the 64 window
    with torch.no_grad():
        want = per_token(eager, kind(1024, hidden_size=64)(pairs))
        got = per_token(on_flex, kind(1024, one_row=True, pad_to_multiple_of=masks.BLOCK)(pairs))
    assert (got - want).abs().max() < 1e-5
    assert flex.compilations() == 1


def flex_batches(widths: int):
    """Shared-prompt micro-batches of `widths` distinct row widths (each a multiple of 128, at least two tiles wide)."""
    batches, seen = [], set()
    for seed in range(100):
        sizes = (100 + 61 * seed % 700, 20 + 13 * seed % 90, 5 + 29 * seed % 70)
        pairs = random_pairs(seed, prompts=(sizes[0], 30), completions=((sizes[1], sizes[2]), (9, 4)))
        batch = SharedPromptCollator(1024, one_row=True, pad_to_multiple_of=masks.BLOCK)(pairs)
        width = batch["input_ids"].shape[1]
        if width > masks.BLOCK and width not in seen:
            seen.add(width)
            batches.append(batch)
    return batches[:widths]


@pytest.mark.slow  # ~30 s: three dynamo compilations with dynamic shapes on 2 cores
def test_flex_compiles_once_per_autograd_mode(tiny_model_dir, cheap_flex):
    """The compilation count follows the autograd modes a run uses (with gradients, without, inference mode), not the
    row widths, the layer kinds (OLMo 3 has full and sliding-window layers) nor the module's training flag:
    transformers' own flex function would compile per width, per window and per flip, past torch's recompile limit."""
    model = fused(tiny_model_dir, "flex_attention").requires_grad_(False)  # no flex backward on CPU: grad mode only
    modes = (torch.enable_grad, torch.no_grad, torch.inference_mode)
    batches = flex_batches(3)
    assert len(batches) == 3 and set(text_kinds(model)) == {"full_attention", "sliding_attention"}
    for i, batch in enumerate(batches):
        for mode in modes:
            model.train(i % 2 == 0)  # the flag flips between micro-batches
            with mode():
                per_token(model, dict(batch))
        assert flex.compilations() == len(modes), f"after {i + 1} widths"


@pytest.mark.slow
@pytest.mark.extended  # ~70-110 s on 2 cores: one inductor compilation of FlexAttention (C++ code generation)
def test_flex_on_inductor_compiles_once_over_widths(tiny_model_dir, monkeypatch):
    """The real backend, as on a GPU: one compilation over three row widths, both layer kinds and a training-flag flip,
    per-token log-probs as sdpa's."""
    import torch._dynamo
    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, "flex_attention", flex.attention)
    torch._dynamo.reset()
    sdpa, on_flex = fused(tiny_model_dir, "sdpa"), fused(tiny_model_dir, "flex_attention")
    for i, batch in enumerate(flex_batches(3)):
        on_flex.train(i == 1)
        with torch.no_grad():
            got = per_token(on_flex, dict(batch))
            want = per_token(sdpa, dict(batch))  # the same row on a dense mask
        assert (got - want).abs().max() < 1e-4
    assert flex.compilations() == 1
    torch._dynamo.reset()


@pytest.mark.slow
def test_generation_leaves_the_training_flex_compilation_alone(tiny_model_dir, cheap_flex, tmp_path):
    """Samples are generated on sdpa: no new FlexAttention compilation (on flex, generation's cache and one-token
    queries would each be one), and the model is back on flex, in training mode, for the next step."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer, TrainerState

    from dpotrain.train.samples import SampleGenerator

    model = fused(tiny_model_dir, "flex_attention")
    batch = flex_batches(1)[0]
    with torch.no_grad():
        want = per_token(model, dict(batch))
    assert flex.compilations() == 1
    generator = SampleGenerator(
        [[5, 6, 7, 8, 9]], AutoTokenizer.from_pretrained(tiny_model_dir), every=1, max_new_tokens=6, warn_at=1.0
    )
    model.train()
    records = generator.generate(SimpleNamespace(output_dir=str(tmp_path)), TrainerState(), model)
    assert len(records) == 1 and records[0]["completion"]
    assert flex.compilations() == 1 and model.config._attn_implementation == "flex_attention" and model.training
    with torch.no_grad():
        assert torch.equal(per_token(model, dict(batch)), want)
    assert flex.compilations() == 1


def text_kinds(model):
    return masks.windows(masks.text_config(model))


@pytest.mark.slow
def test_flex_that_would_run_uncompiled_stops_the_run_in_one_line(tiny_model_dir, cheap_flex, monkeypatch, capsys):
    """At dynamo's recompile limit, or with compilation disabled, the forward raises RunError (train_dpo.py prints its
    one line) instead of running flex uncompiled into an out-of-memory error."""
    import torch._dynamo

    model = fused(tiny_model_dir, "flex_attention")
    batch = flex_batches(1)[0]
    with torch.no_grad():
        per_token(model, dict(batch))
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    with torch.inference_mode(), pytest.raises(RunError, match=r"^FlexAttention would run uncompiled.*recompile_limit"):
        per_token(model, dict(batch))  # a second autograd mode: a second compilation, past the limit of 1
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    monkeypatch.setattr(torch._dynamo.config, "disable", True)  # as TORCH_COMPILE_DISABLE=1
    torch._dynamo.reset()  # nothing compiled yet, as at a run's start
    capsys.readouterr()  # the model's loading messages
    with torch.no_grad(), pytest.raises(SystemExit) as stopped:
        run_cli(lambda: per_token(model, dict(batch)))  # as train_dpo.py runs its main
    err = capsys.readouterr().err
    assert stopped.value.code == 1 and err.count("\n") == 1, err  # one line, no traceback
    assert err.startswith("error: FlexAttention would run uncompiled") and "TORCH_COMPILE_DISABLE=1" in err


def test_rows_stay_within_the_memory_plan_on_a_think_epoch():
    """Every micro-batch of a Think-like epoch (max_length 16384, budget 65,536): rows no wider than the plan's width
    and dense masks no larger than its mask (unshared and shared prompts; shared pairs are up to 2 x max_length)."""
    from lengths_like import dolci_think

    from dpotrain.plan import memory

    recipe = parse_args(
        [
            "--config",
            SMOKE,
            "--max_length",
            "16384",
            "--max_tokens_per_microbatch",
            "65536",
            "--output_dir",
            "/tmp/unused",
        ]
    )
    tokens, width, _ = memory.micro_batch(recipe)
    prompt, chosen, rejected = dolci_think(2000, seed=0)
    kept = prompt < 16384  # TRL drops a pair whose prompt fills max_length
    for shared in (True, False):
        lengths = PairLengths.from_parts(prompt[kept], chosen[kept], rejected[kept], 16384, shared)
        step_plan = plan.StepPlan(128, 8, 0, tokens, None)
        widest = 0
        for mb in (mb for step in plan.plan_run(lengths, step_plan, 1)[0] for rank in step for mb in rank):
            units = (
                [int(lengths.tokens[i]) for i in mb]
                if shared
                else [int(lengths.chosen[i]) for i in mb] + [int(lengths.rejected[i]) for i in mb]
            )
            rows = packing.fill_rows(units, 4096, packing.row_width_bound(16384))
            row_width = max(sum(units[i] for i in row) for row in rows)
            assert row_width <= width and len(rows) * row_width**2 <= tokens * width
            widest = max(widest, row_width)
        assert widest > 16384  # the bound is reached for, not idle


def recipe_with(*args):
    return parse_args(["--config", SMOKE, "--output_dir", "/tmp/unused", *args])


def decide_forward(recipe, model_path: str, cuda: bool):
    """The forward for the model's config, on this machine's varlen FlashAttention (`choice.decide`)."""
    config = AutoConfig.from_pretrained(model_path, revision=recipe.model.model_revision)
    return choice.decide(recipe, config, cuda, choice.installed_varlen(cuda))


@pytest.mark.parametrize("attn", ["flex_attention", "flash_attention_2", "flash_attention_4"])
def test_an_attention_asked_for_is_refused_where_it_cannot_run(attn, tiny_model_dir):
    recipe = recipe_with("--model_name_or_path", tiny_model_dir, "--attn_implementation", attn)
    with pytest.raises(ConfigError, match=f"attn_implementation {attn} cannot run here: .*CPU"):
        decide_forward(recipe, tiny_model_dir, cuda=False)


def test_the_choice_per_device(tiny_model_dir, capsys):
    recipe = recipe_with("--model_name_or_path", tiny_model_dir)
    cpu = decide_forward(recipe, tiny_model_dir, cuda=False)
    assert (cpu.attention, cpu.packed, cpu.share_prompt, cpu.one_row) == ("sdpa", True, True, False)
    assert recipe.model.attn_implementation is None  # decided, not written into the recipe (stages.RunSpec)
    # On CUDA (the decision only: nothing runs): OLMo 3 shares prompts on FlexAttention, in one row per micro-batch.
    recipe = recipe_with("--model_name_or_path", tiny_model_dir)
    gpu = decide_forward(recipe, tiny_model_dir, cuda=True)
    assert (gpu.attention, gpu.packed, gpu.share_prompt, gpu.one_row) == ("flex_attention", True, True, True)
    # Prompts unshared by request: a varlen FlashAttention when installed (not here), else FlexAttention's block mask.
    recipe = recipe_with("--model_name_or_path", tiny_model_dir, "--share_prompt", "false")
    unshared = decide_forward(recipe, tiny_model_dir, cuda=True)
    assert (unshared.attention, unshared.share_prompt) == ("flex_attention", False)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Forward:")]
    assert len(lines) == 3 and "on flex_attention" in lines[1]  # one line per decision, with its reason
    collator = choice.collator(gpu, recipe.training)
    assert isinstance(collator, SharedPromptCollator) and collator.one_row and collator.pad_to_multiple_of == 128
    assert gpu.record()["layout"] == "shared prompts packing, one row per micro-batch"
