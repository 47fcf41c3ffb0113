"""The forward follows the data (dpotrain/forwards/cost.py, choice.py): on think-shaped pairs (a short prompt, long
answers) sharing saves little and FlashAttention 4's varlen kernel wins; on multi-turn pairs (the history most of a
pair) shared prompts on FlexAttention win; and the memory plan, the run's memory check and the dry run plan for the
forward chosen, not for sdpa's dense masks. The CUDA decisions are decisions only: nothing runs on a GPU here."""

import copy
import dataclasses
import json
import re
import shutil
import sys

import numpy as np
import pytest
from transformers import AutoConfig

import train_dpo
from conftest import ROOT
from dpotrain import resolve, stages
from dpotrain.cluster import engine as engines
from dpotrain.data import lengths as analyzer
from dpotrain.forwards import choice, cost
from dpotrain.plan import memory
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError

sys.path.insert(0, str(ROOT / "benchmarks"))
from attention import lengths_of  # noqa: E402  (the benchmark's multi-turn mix)

OLMO3_7B = str(ROOT / "configs" / "models" / "olmo3-7b")  # a shipped config.json
FA4 = "flash_attention_4"


def think_mix(n: int = 2000, seed: int = 0) -> cost.TokenCounts:
    """Think-shaped pairs as measured on the H100: a prompt of ~250 tokens, answers of ~2,500-3,500."""
    rng = np.random.default_rng(seed)
    prompt = np.maximum(1, rng.lognormal(np.log(250), 0.3, n)).astype(np.int64)
    return cost.TokenCounts(prompt, rng.integers(2500, 3500, n), rng.integers(2500, 3500, n), "think-like")


def multiturn_mix(n: int = 2000, seed: int = 0) -> cost.TokenCounts:
    """The benchmark's multi-turn pairs (benchmarks/attention.py): a history of ~3,000 tokens, answers of ~300."""
    prompt, chosen, rejected = lengths_of("multiturn", n, 4096, seed)
    return cost.TokenCounts(prompt, chosen, rejected, "multi-turn")


def think_recipe(*args):
    return parse_args(
        [
            "--config",
            str(ROOT / "configs" / "think.yaml"),
            "--model_name_or_path",
            OLMO3_7B,
            "--output_dir",
            "/tmp/unused",
            "--dry-run",
            *args,
        ]
    )


def decide(lengths, cuda=True, varlen=FA4, *args):
    recipe = think_recipe(*args)
    config = AutoConfig.from_pretrained(OLMO3_7B, revision=recipe.model.model_revision)
    return choice.decide(recipe, config, cuda, varlen, lengths), recipe


def test_the_choice_follows_the_data(capsys):
    think, multiturn = think_mix(), multiturn_mix()
    assert np.median(multiturn.prompt / (multiturn.prompt + multiturn.chosen)) > 0.85  # the history most of a pair
    # With FA4 installed: think-shaped pairs on FA4 varlen (sharing saves ~4% of positions, flex trains at 25.0% MFU
    # against FA4's 32.4%), multi-turn pairs with shared prompts on flex.
    on_think, recipe = decide(think)
    assert (on_think.attention, on_think.share_prompt, on_think.one_row) == (FA4, False, True)
    assert recipe.model.attn_implementation is None  # decided, not written into the recipe (stages.RunSpec)
    on_multiturn, _ = decide(multiturn)
    assert (on_multiturn.attention, on_multiturn.share_prompt) == ("flex_attention", True)
    # Each names the other as the runner-up, with both estimates (H100-seconds per 1,000 pairs).
    think_est = [e["estimate"] for e in on_think.decision["estimates"]]
    assert on_think.record()["runner_up"]["forward"] == "shared prompts on flex_attention"
    assert on_multiturn.record()["runner_up"]["forward"] == f"unshared on {FA4}"
    assert 1.15 < think_est[1] / think_est[0] < 1.35  # 0.324 / 0.250 = 1.30, less the ~4% sharing saves
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Forward:")]
    assert len(lines) == 2
    want = (
        rf"Forward: unshared packing, one row per micro-batch on {FA4}: cheapest measured: est\. [\d.,]+ against "
        r"[\d.,]+ for shared prompts on flex_attention \(H100-seconds per 1,000 pairs\), from think-like \(1,024 "
        r"of its 2,000 pairs weighed\)\."
    )
    assert re.fullmatch(want, lines[0]), lines[0]
    # Without a varlen kernel: shared prompts on flex for both, by far on multi-turn pairs, narrowly on think's.
    for mix, (low, high) in ((think, (1.0, 1.1)), (multiturn, (1.5, 2.5))):
        chosen, _ = decide(mix, varlen=None)
        assert (chosen.attention, chosen.share_prompt) == ("flex_attention", True)
        estimates = chosen.decision["estimates"]
        assert estimates[1]["forward"] == "unshared on flex_attention"
        assert low < estimates[1]["estimate"] / estimates[0]["estimate"] < high
    # The CPU: sdpa's dense rows for both, unshared on think-shaped pairs (a shared pair is a unit twice as wide, and
    # a dense mask costs its whole row), shared on multi-turn pairs: one kernel, its layouts ranked by their work.
    assert not decide(think, cuda=False)[0].share_prompt
    cpu_multiturn = decide(multiturn, cuda=False)[0]
    assert (cpu_multiturn.attention, cpu_multiturn.share_prompt, cpu_multiturn.one_row) == ("sdpa", True, False)
    assert cpu_multiturn.reason.startswith("by the documented order, then the least work: est. ")
    assert cpu_multiturn.decision["unit"] == "TFLOP per 1,000 pairs, all on sdpa"


def test_only_kernels_whose_speed_was_measured_are_weighed_the_rest_by_the_documented_order():
    """The cost model ranks FlashAttention 4 and FlexAttention (their speeds measured on an H100, cost.SPEED) against
    each other; FlashAttention 3 and 2 were never measured, so they follow the documented order (after flex) and are
    recorded as not weighed; named in the recipe, a kernel is honoured and its layouts ranked by their work alone."""
    assert set(cost.SPEED) == {FA4, "flex_attention"}
    think, multiturn = think_mix(), multiturn_mix()
    for varlen in ("flash_attention_3", "flash_attention_2"):
        for mix in (think, multiturn):
            chosen, _ = decide(mix, True, varlen)
            assert (chosen.attention, chosen.share_prompt) == ("flex_attention", True), varlen
            assert chosen.decision["by"] == "cheapest measured"
            assert chosen.decision["not_weighed"] == [f"unshared on {varlen}"]
            assert chosen.reason.endswith(f"; not weighed (speed not measured): unshared on {varlen}")
            assert {e["forward"] for e in chosen.decision["estimates"]} == {
                "shared prompts on flex_attention",
                "unshared on flex_attention",
            }
        config = memory.model_config(think_recipe())[0]
        listed, _ = choice.candidates(copy.deepcopy(config), think_recipe(), True, varlen, check_kernels=False)
        assert [c.describe() for c in listed] == [
            "shared prompts on flex_attention",
            "unshared on flex_attention",
            f"unshared on {varlen}",
        ]
    asked, _ = decide(think, True, FA4, "--attn_implementation", "sdpa")
    assert asked.attention == "sdpa" and asked.decision["unit"] == "TFLOP per 1,000 pairs, all on sdpa"
    assert asked.reason.startswith("as the recipe names it, then the least work: est. ")
    padded, _ = decide(think, True, FA4, "--padding_free", "false")
    assert padded.reason.startswith("the only candidate: est. ") and padded.decision["by"] == "the only candidate"


def test_the_decision_is_a_function_of_the_lengths():
    """Every rank decides alone from the same lengths: the same record (the rank agreement digests it)."""
    think = think_mix()
    first, second = (decide(copy.deepcopy(think))[0].record() for _ in range(2))
    assert first == second and first["decision"]["lengths_from"].startswith("think-like")
    reordered = cost.TokenCounts(think.prompt[::-1], think.chosen[::-1], think.rejected[::-1], "think-like")
    assert decide(reordered)[0].attention == FA4  # another sample of the same mix: the same winner


@pytest.mark.parametrize(
    "live",
    [["--precompute_ref_log_probs", "false"], ["--precompute_ref_log_probs", "false", "--sync_ref_model", "true"]],
    ids=["live_reference", "tr_dpo"],
)
def test_a_live_reference_model_packs_and_its_forward_is_counted(live):
    """A live reference model (TR-DPO's too) takes the packed forwards the cached reference takes, ranked the same:
    its no-grad forward of the same rows is a 4th forward beside training's 3 for every candidate, so each estimate
    is 4/3 of the cached reference's."""
    for mix in (think_mix(), multiturn_mix()):
        cached, _ = decide(mix)
        with_ref, recipe = decide(mix, True, FA4, *live)
        assert with_ref.packed and recipe.training.padding_free and not recipe.training.precompute_ref_log_probs
        assert (with_ref.attention, with_ref.share_prompt) == (cached.attention, cached.share_prompt)
        pairs = zip(cached.decision["estimates"], with_ref.decision["estimates"], strict=True)
        for plain, live_ in pairs:
            assert plain["forward"] == live_["forward"]
            assert live_["estimate"] == pytest.approx(plain["estimate"] * 4 / 3, rel=1e-3)


def test_an_option_in_the_recipe_is_honoured_or_refused_never_replaced():
    think, multiturn = think_mix(), multiturn_mix()
    forced, _ = decide(think, True, FA4, "--attn_implementation", "flex_attention")
    assert (forced.attention, forced.share_prompt) == ("flex_attention", True)  # only flex weighed: shared wins
    shared, _ = decide(think, True, FA4, "--share_prompt", "true")
    assert (shared.attention, shared.share_prompt) == ("flex_attention", True)
    unshared, _ = decide(multiturn, True, FA4, "--share_prompt", "false")
    assert (unshared.attention, unshared.share_prompt) == (FA4, False)
    padded, recipe = decide(think, True, FA4, "--padding_free", "false")
    assert not padded.packed and not recipe.training.padding_free and padded.attention == "sdpa"
    with pytest.raises(ConfigError, match="share_prompt needs packed sequences, .*: padding_free is false"):
        decide(think, True, FA4, "--padding_free", "false", "--share_prompt", "true")
    with pytest.raises(ConfigError, match=f"attn_implementation {FA4} cannot run here: .*not installed"):
        decide(think, True, FA4, "--attn_implementation", FA4)  # asked for on a machine without it
    with pytest.raises(ConfigError, match="attn_implementation flex_attention cannot run here: .*CPU"):
        decide(think, False, None, "--attn_implementation", "flex_attention")


def h100_zero2(world: int = 16):
    """The think recipe on 2 nodes of 8 x H100 under ZeRO-2, as scripts/launch.sh plans it."""
    recipe = think_recipe("--gpu_memory_gib", "79.6")
    return recipe, dataclasses.replace(engines.from_config(str(ROOT / "accelerate_config.yaml")), gpus_per_node=8)


def test_the_memory_plan_and_the_runs_check_use_the_chosen_forward():
    """sdpa's dense masks do not fit an H100 (the plan before the forward was decided from the data); the forward
    the run chooses does, and its memory check plans for it."""
    recipe, zero2 = h100_zero2()
    with pytest.raises(ConfigError, match=r"needs ~81.6 GiB per GPU .*masks 8.0"):
        memory.plan(copy.deepcopy(recipe), 16, zero2, attention="sdpa")
    # What the run's forward and memory stages make once the data set is read (here with the lengths given: no
    # tokenizer ships with the config); without FlashAttention 4, so the forward is shared prompts on flex (with it,
    # FA4: no mask at all).
    r = copy.deepcopy(recipe)
    machines = {"H100 without FA4": (True, None)}
    launch = stages.Launch(16, "2 nodes of 8", zero2, machines, dry_run=False, batch=resolve.decide_batch(r, 16))
    pair_lengths = stages.Lengths(None, think_mix(), None, None, max_length=r.training.max_length)
    model = memory.model_config(r, r.model.model_name_or_path, local_only=True)
    forward = stages.decide_forward(r, launch, r.model.model_name_or_path, pair_lengths, model)
    planned = stages.plan_memory(r, launch, stages.Data(None, None, {}, {}), pair_lengths, forward, model)
    assert forward.planned.attention == "flex_attention" == forward.record()["attention"] == planned.attention
    assert planned.fits is True and planned.total_gib == 72.8
    assert planned.per_gpu_gib["attention_masks"] == 0.0  # a block mask's few MiB
    assert choice.lightest_attention(memory.model_config(recipe)[0], recipe) == "flex_attention"


def test_a_login_node_dry_run_plans_for_what_the_gpus_will_run(tmp_path, capsys, monkeypatch):
    """Without cached lengths: the candidates of both kernel sets, and a plan that fits (refused before, for sdpa)."""
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("GPUS_PER_NODE", "8")
    train_dpo.main(
        [
            "--config",
            str(ROOT / "configs" / "think.yaml"),
            "--model_name_or_path",
            OLMO3_7B,
            "--output_dir",
            str(tmp_path / "t"),
            "--gpu_memory_gib",
            "79.6",
            "--dry-run",
        ]
    )
    out = capsys.readouterr().out
    assert "fits one 79.6 GiB GPU (H100 80GB)" in out and "~72.8 GiB" in out
    forward = json.loads((tmp_path / "t.dry-run.json").read_text())["derived"]["forward"]
    assert forward["with FlashAttention 4 installed"]["candidates"][:2] == [
        "shared prompts on flex_attention",
        f"unshared on {FA4}",
    ]
    assert forward["without"]["candidates"] == ["shared prompts on flex_attention", "unshared on flex_attention"]


def test_a_dry_run_with_the_analyzers_lengths_states_both_decisions(tmp_path, capsys, tiny_model_dir):
    """The analyzer's cached lengths of a local data set (think-shaped): the dry run says what the GPU nodes will run
    with FlashAttention 4 installed and without, and records winner, runner-up and estimates."""
    from transformers import AutoTokenizer

    data = tmp_path / "pairs.jsonl"
    shutil.copy(ROOT / "data" / "smoke_prefs.jsonl", data)
    think = think_mix(384)
    measured = analyzer.Measured(np.arange(384), think.prompt, think.chosen, think.rejected, [], True)
    # keyed as the smoke recipe reads the pairs: `assistant_turns: all` (lengths.turns_key)
    identity = analyzer.dataset_identity(str(data), "train", None, local_only=True, assistant_turns="all")
    analyzer.save_cache(measured, {}, identity, AutoTokenizer.from_pretrained(tiny_model_dir))
    train_dpo.main(
        [
            "--config",
            str(ROOT / "configs" / "smoke.yaml"),
            "--dataset_name",
            str(data),
            "--max_length",
            "16384",
            "--max_tokens_per_microbatch",
            "65536",
            "--bf16",
            "true",
            "--gpu_memory_gib",
            "79.6",
            "--output_dir",
            str(tmp_path / "run"),
            "--dry-run",
        ]
    )
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  forward:"))
    assert re.search(
        rf"with FlashAttention 4 installed: unshared packing, one row per micro-batch on {FA4} \(cheapest measured: "
        r"est\. [\d.,]+ against [\d.,]+ for shared prompts on flex_attention, H100-seconds per 1,000 pairs\); "
        r"without: shared prompts packing, one row per micro-batch on flex_attention",
        line,
    ), line
    derived = json.loads((tmp_path / "run.dry-run.json").read_text())["derived"]
    with_fa4 = derived["forward"]["with FlashAttention 4 installed"]
    assert with_fa4["winner"]["forward"] == f"unshared on {FA4}"
    assert with_fa4["runner_up"]["forward"] == "shared prompts on flex_attention"
    assert derived["forward"]["planned_for"] == "without"  # the heavier masks: flex's block mask
    assert derived["memory"]["attention"] == "flex_attention"
    assert derived["batching"]["forward"].startswith("packed, prompts shared")  # the step plan for that forward


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma2"])
def test_sdpa_asked_for_a_model_without_it_is_refused_in_one_line(model_type):
    """--attn_implementation sdpa on a model class transformers gives no sdpa (GPT-OSS's attention sinks, Gemma 2's
    soft-capping) ran the data stages, then stopped in from_pretrained with transformers' ValueError traceback."""
    recipe = parse_args(["--config", str(ROOT / "configs" / "smoke.yaml"), "--attn_implementation", "sdpa"])
    with pytest.raises(ConfigError, match=rf"^attn_implementation sdpa cannot run here: {model_type}'s .*eager"):
        choice.candidates(AutoConfig.for_model(model_type), recipe, False, None)
    eager = parse_args(["--config", str(ROOT / "configs" / "smoke.yaml"), "--attn_implementation", "eager"])
    forwards, _ = choice.candidates(AutoConfig.for_model(model_type), eager, False, None)
    assert {c.attention for c in forwards} == {"eager"}


def test_heads_wider_than_flashattentions_kernels_take_run_on_sdpa():
    """Gemma 4's full-attention layers are 512 wide (global_head_dim) and FlashAttention's kernels take up to 256
    ("FlashAttention only supports head dimensions up to 256"); FlexAttention's training kernels at that width were
    never run on a GPU here. Now that Gemma 4 packs, a GPU run would have chosen one of them and stopped at its first
    forward: its packed rows run on sdpa, and a FlashAttention kernel asked for is refused in one line. Gemma 3's
    256-wide heads and DeepSeek V3's (192 for queries and keys) keep every kernel."""
    smoke = ["--config", str(ROOT / "configs" / "smoke.yaml")]
    gemma4 = AutoConfig.for_model("gemma4_text")
    assert choice.widest_head(gemma4) == 512
    forwards, notes = choice.candidates(copy.deepcopy(gemma4), parse_args(smoke), True, FA4, check_kernels=False)
    assert {(c.attention, c.packed) for c in forwards} == {("sdpa", True)}
    assert notes == [
        "Note: gemma4_text's widest attention heads are 512 wide: FlashAttention's kernels take up to 256 and "
        "FlexAttention's were never run that wide here, so it runs on sdpa."
    ]
    for kernel in ("flash_attention_2", "kernels-community/flash-attn3@v1"):
        with pytest.raises(
            ConfigError,
            match=rf"^attn_implementation {kernel} cannot run gemma4_text: its widest attention heads are 512 wide, "
            r"and FlashAttention's kernels take up to 256; leave --attn_implementation out \(sdpa is then chosen\)$",
        ):
            choice.candidates(copy.deepcopy(gemma4), parse_args([*smoke, "--attn_implementation", kernel]), True, FA4)
    for model_type, width in (("gemma3_text", 256), ("deepseek_v3", 192)):
        config = AutoConfig.for_model(model_type)
        assert choice.widest_head(config) == width
        forwards, notes = choice.candidates(copy.deepcopy(config), parse_args(smoke), True, FA4, check_kernels=False)
        assert {c.attention for c in forwards} >= {FA4, "flex_attention"} and not notes, forwards


def test_a_kernel_that_drops_attention_sinks_is_never_chosen_for_a_model_with_them():
    """gpt-oss's (and Granite SWA's) learnable attention sinks reach FlashAttention 4 (`learnable_sink`) and vLLM's FA3
    (`s_aux`); transformers drops them without a word for FA2 and Dao's FA3, whose rows would then train another
    attention, padded or packed. Installed, such a kernel is not weighed for it (said); asked, it is refused in one
    line. FA4 and flex stay; a model without sinks keeps every kernel."""
    smoke = ["--config", str(ROOT / "configs" / "smoke.yaml")]
    gpt_oss = AutoConfig.for_model("gpt_oss")
    forwards, notes = choice.candidates(copy.deepcopy(gpt_oss), parse_args(smoke), True, "flash_attention_2")
    assert {c.attention for c in forwards} == {"flex_attention"}, forwards
    assert notes[0] == (
        "Note: flash_attention_2 takes no attention sinks, which gpt_oss has: it is not weighed (flash_attention_4 "
        "takes them)."
    )
    forwards, _ = choice.candidates(copy.deepcopy(gpt_oss), parse_args(smoke), True, FA4, check_kernels=False)
    assert {c.attention for c in forwards} == {FA4, "flex_attention"}, forwards
    for kernel in ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn3@v1"):
        with pytest.raises(
            ConfigError,
            match=rf"^attn_implementation {kernel} cannot run gpt_oss: its kernel takes no attention sinks, which "
            r"transformers then drops without a word; use flash_attention_4 or flex_attention, or leave "
            r"--attn_implementation out$",
        ):
            choice.candidates(copy.deepcopy(gpt_oss), parse_args([*smoke, "--attn_implementation", kernel]), True, FA4)
    asked = parse_args([*smoke, "--attn_implementation", "kernels-community/vllm-flash-attn3"])
    forwards, _ = choice.candidates(copy.deepcopy(gpt_oss), asked, True, FA4, check_kernels=False)
    assert {c.attention for c in forwards} == {"kernels-community/vllm-flash-attn3"}
    # Read from the model's code, not a list of types: Granite SWA packs, and has them too
    granite_swa = AutoConfig.for_model("granite_swa")
    forwards, notes = choice.candidates(granite_swa, parse_args(smoke), True, "flash_attention_2", check_kernels=False)
    assert "flash_attention_2" not in {c.attention for c in forwards} and "granite_swa has" in notes[0], notes
    olmo3 = AutoConfig.for_model("olmo3")
    forwards, _ = choice.candidates(olmo3, parse_args(smoke), True, "flash_attention_2", check_kernels=False)
    assert "flash_attention_2" in {c.attention for c in forwards}


def test_the_notes_of_the_choice_are_said_by_the_main_process_alone(capsys, monkeypatch):
    """`choice.decide` runs on every rank (each chooses from its node's machine): its "Note:" lines were printed by
    each, 32 times in a 4-GPU x 8-node job's log, where its `Forward:` line was printed once. Now both by the main
    process alone (RANK 0), as the run's other notes are."""
    recipe = think_recipe()
    config = AutoConfig.from_pretrained(OLMO3_7B)
    config.output_router_logits, config.router_aux_loss_coef = False, 0.01  # a router's loss: no shared prompt
    choice.decide(recipe, copy.deepcopy(config), False, None, think_mix())
    said = capsys.readouterr().out
    assert "Note: each pair's prompt is computed twice (unshared packing): olmo3's router auxiliary loss" in said
    assert "Forward:" in said
    monkeypatch.setenv("RANK", "1")
    chosen = choice.decide(recipe, copy.deepcopy(config), False, None, think_mix())
    assert not chosen.share_prompt and capsys.readouterr().out == ""  # the same choice, said by rank 0 alone


def test_flex_attention_is_never_chosen_for_attention_dropout_kept_in_training():
    """FlexAttention takes no dropout (`flex.attention` raises "flex_attention does not support attention dropout"),
    and transformers' attention layers hand it their `attention_dropout` in training. With `--disable_dropout false` on
    a model whose config drops out in attention (`attention_dropout`, GPT-2's `attn_pdrop`, or `model_init_kwargs:
    {attention_dropout: 0.1}`), a GPU run chose shared prompts on flex, scored the reference stage (eval mode: no
    dropout), then ended at its first training forward in that ValueError's traceback. Now flex is not weighed for it
    (said), and asked for, it is refused in one line before anything loads; with dropout off (TRL's default) flex
    stays."""
    smoke = ["--config", str(ROOT / "configs" / "smoke.yaml")]
    kept = [*smoke, "--disable_dropout", "false"]
    dropping = AutoConfig.for_model("olmo3", attention_dropout=0.1)
    forwards, notes = choice.candidates(copy.deepcopy(dropping), parse_args(kept), True, None, check_kernels=False)
    assert "flex_attention" not in {c.attention for c in forwards} and forwards, forwards
    assert {c.attention for c in forwards} == {"sdpa"} and any(c.share_prompt for c in forwards)
    assert notes == [
        "Note: flex_attention takes no attention dropout, which olmo3 trains with here (attention_dropout 0.1, "
        "disable_dropout false): it is not weighed."
    ]
    with pytest.raises(
        ConfigError,
        match=r"^attn_implementation flex_attention cannot run olmo3 here: its kernel takes no attention dropout, "
        r"and olmo3 trains with attention_dropout 0.1 \(disable_dropout false\): pass --disable_dropout true, or "
        r"leave --attn_implementation out$",
    ):
        asked = parse_args([*kept, "--attn_implementation", "flex_attention"])
        choice.candidates(copy.deepcopy(dropping), asked, True, None, check_kernels=False)
    olmo3 = AutoConfig.for_model("olmo3")  # none in its config: one given as a config override counts
    overridden = parse_args([*kept, "--model_init_kwargs", '{"attention_dropout": 0.1}'])
    forwards, notes = choice.candidates(copy.deepcopy(olmo3), overridden, True, None, check_kernels=False)
    assert "flex_attention" not in {c.attention for c in forwards} and "attention_dropout 0.1" in notes[0]
    for config, args in ((dropping, smoke), (olmo3, kept)):  # dropout off, or none to keep
        forwards, notes = choice.candidates(copy.deepcopy(config), parse_args(args), True, None, check_kernels=False)
        assert "flex_attention" in {c.attention for c in forwards} and not notes


def test_flashattention_3_and_4_are_never_chosen_for_attention_dropout_kept_in_training():
    """FlashAttention 3 and 4 have no dropout argument, and transformers hands a kernel only the arguments its signature
    names (`_process_flash_attention_kwargs`): with `--disable_dropout false` on a model that drops out in attention, a
    GPU with FA4 installed trained on it without attention dropout, while resolved_config.json and `derived.dropout`
    said it was on. Now neither is weighed for such a run (said), and named, each is refused in one line; FA2, whose
    kernel takes `dropout_p`, stays, as every kernel does with dropout off."""
    smoke = ["--config", str(ROOT / "configs" / "smoke.yaml")]
    kept = [*smoke, "--disable_dropout", "false"]
    dropping = AutoConfig.for_model("olmo3", attention_dropout=0.1)
    forwards, notes = choice.candidates(copy.deepcopy(dropping), parse_args(kept), True, FA4, check_kernels=False)
    assert {c.attention for c in forwards} == {"sdpa"}, forwards
    assert notes[0] == (
        "Note: flash_attention_4 takes no attention dropout, which olmo3 trains with here (attention_dropout 0.1, "
        "disable_dropout false): it is not weighed."
    )
    forwards, _ = choice.candidates(copy.deepcopy(dropping), parse_args(kept), True, "flash_attention_3", False)
    assert {c.attention for c in forwards} == {"sdpa"}, forwards
    forwards, notes = choice.candidates(copy.deepcopy(dropping), parse_args(kept), True, "flash_attention_2", False)
    assert {c.attention for c in forwards} == {"flash_attention_2"}, forwards  # takes dropout_p; flex's note alone
    for kernel in ("flash_attention_3", FA4, "kernels-community/flash-attn3@v1", "kernels-community/vllm-flash-attn3"):
        with pytest.raises(ConfigError, match=rf"^attn_implementation {kernel} cannot run olmo3 here: its kernel"):
            asked = parse_args([*kept, "--attn_implementation", kernel])
            choice.candidates(copy.deepcopy(dropping), asked, True, FA4, check_kernels=False)
    forwards, notes = choice.candidates(copy.deepcopy(dropping), parse_args(smoke), True, FA4, check_kernels=False)
    assert FA4 in {c.attention for c in forwards} and not notes  # dropout off (TRL's default): every kernel
