"""Sequence parallelism as the first half plans it (dpotrain/cluster/sequence_parallel.py): the groups are DeepSpeed's,
the same pairs make the same steps on any N, what cannot run is refused before anything loads, the memory plan holds
1/N of the positions per GPU, and a refusal names the N that fits (README "Long traces")."""

import copy
import json
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import train_dpo
from conftest import ROOT, spawn_ranks
from dpotrain import dry_run, stages
from dpotrain.cluster import engine as engines
from dpotrain.cluster import sequence_parallel
from dpotrain.data.pair_lengths import PairLengths
from dpotrain.forwards import choice
from dpotrain.hub import hub
from dpotrain.plan import memory, memory_advice, plan
from dpotrain.recipe import run_record
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError, run_cli

OLMO3_7B = str(ROOT / "configs" / "models" / "olmo3-7b")
LONG = ["--max_length", "65536", "--max_tokens_per_microbatch", "131072"]  # 64K traces, two whole pairs
H100_NODE = {"WORLD_SIZE": "8", "GPUS_PER_NODE": "8"}
no_gpu = pytest.mark.skipif(
    torch.cuda.is_available(), reason="plans against --gpu_memory_gib; a GPU here would be used instead"
)


@pytest.fixture
def think_dry_run(monkeypatch, capsys, tmp_path):
    """`train_dpo.py --dry-run --json` of configs/think.yaml for OLMo 3 7B on a login node (no GPU, no network), run
    in this process as the command runs it (`run_cli`: a refusal is its one line and exit code 2): the dry runs of a
    process share the memory plan's traces of the 7B's layers (`layer_costs`), which a process of their own each traced
    again. Its record goes under the test's folder, not the checkout's outputs/. Returns the record, or what the
    command ended with: `.returncode`, and `.stdout` (stdout, then stderr)."""

    def dry_run(*args, env=None):
        monkeypatch.chdir(ROOT)
        for name, value in {"WANDB_MODE": "offline", **(env or {})}.items():
            monkeypatch.setenv(name, value)
        command = ["--config", "configs/think.yaml", "--model_name_or_path", OLMO3_7B, "--dry-run", "--json", *args]
        with pytest.raises(SystemExit) as ended:
            run_cli(lambda: train_dpo.main([*command, "--output_dir", str(tmp_path / "think")]))
        printed = capsys.readouterr()
        if ended.value.code:
            return SimpleNamespace(returncode=ended.value.code, stdout=printed.out + printed.err)
        return json.loads(printed.out[printed.out.index("{\n") :])

    return dry_run


# --- the "Done when": 64K traces on one node of 8 x H100 ---


def test_a_step_the_groups_cannot_reach_is_refused_naming_data_parallel_ranks_not_processes(monkeypatch):
    """4 processes in groups of 2 are 2 data-parallel ranks. The refusals counted them as processes ("not reachable
    with 2 processes", while 4 ran) and named a launch that could not fix it: "run on a number of processes that
    divides 9", where 3 or 9 processes are no multiple of the group and 2 x 9 would be needed."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    zero2 = ["--accelerate_config", str(ROOT / "accelerate_config.yaml"), "--sequence_parallel_size", "2"]
    padded = ["--max_tokens_per_microbatch", "none", "--per_device_train_batch_size", "2"]
    ranks = "2 data-parallel ranks (4 processes / sequence_parallel_size 2)"
    with pytest.raises(ConfigError) as refused:
        stages.checks(smoke(*zero2, *padded, "--pairs_per_step", "9"))
    assert str(refused.value).startswith(f"pairs_per_step=9 is not reachable with {ranks} x per_device_train_batch")
    assert "run on 2 x a number that divides 9 processes," in str(refused.value)
    with pytest.raises(
        ConfigError, match=re.escape(f"pairs_per_step=1 gives some of the {ranks} no pair: use at least 2")
    ):
        stages.checks(smoke(*zero2, "--pairs_per_step", "1"))
    monkeypatch.setenv("WORLD_SIZE", "2")  # without a group: as before
    with pytest.raises(ConfigError, match="run on a number of processes that divides 9,"):
        stages.checks(
            smoke("--accelerate_config", str(ROOT / "accelerate_config.yaml"), *padded, "--pairs_per_step", "9")
        )


@pytest.mark.slow
@no_gpu
def test_64k_traces_fit_one_h100_node_with_a_group_of_four(think_dry_run):
    resolved = think_dry_run(*LONG, "--gpu_memory_gib", "79.6", "--sequence_parallel_size", "4", env=H100_NODE)
    assert isinstance(resolved, dict), resolved.stdout[-3000:]
    planned, derived = resolved["derived"]["memory"], resolved["derived"]
    assert planned["fits"] is True and planned["world_size"] == 8, planned
    assert planned["sequence_parallel"] == {"size": 4, "tokens_per_gpu": 32768, "data_parallel_size": 2}
    assert planned["per_gpu_gib"]["all_to_all"] > 0
    assert resolved["sequence_parallel_size"] == 4 and derived["data_parallel_size"] == 2
    text = dry_run.summary(run_record.of(resolved), None)
    assert "split over a group of 4 processes (--sequence_parallel_size 4): 2 data-parallel ranks" in text, text
    assert "128 pairs, over 2 data-parallel ranks" in text


@pytest.mark.slow
@no_gpu
def test_64k_traces_without_it_are_refused_naming_the_group_that_fits(think_dry_run):
    result = think_dry_run(*LONG, "--gpu_memory_gib", "79.6", env=H100_NODE)
    assert result.returncode == 2, result.stdout[-3000:]
    error = result.stdout.strip().splitlines()[-1]
    assert error.startswith("error: memory plan: DeepSpeed ZeRO-2 on 8 GPUs needs ~"), error
    # The first option: the smallest group that fits, nothing else changed (the pairs stay whole).
    assert "these fit: [1] add `--sequence_parallel_size 4` (~" in error, error
    offered = re.sub(r": `[^`]*`", "", error.split("these fit:")[1])  # an sbatch command, which repeats the command
    assert "--max_length" not in offered, error


@pytest.mark.slow
@no_gpu
def test_a_varlen_kernel_is_offered_the_group_that_fits(think_dry_run):
    """A recipe that names a varlen FlashAttention kernel is offered a group as flex and sdpa are (the split carries
    the whole row's cu_seq_lens); its plan holds no masks."""
    result = think_dry_run(
        *LONG, "--gpu_memory_gib", "79.6", "--attn_implementation", "flash_attention_3", env=H100_NODE
    )
    assert result.returncode == 2, result.stdout[-3000:]
    error = result.stdout.strip().splitlines()[-1]
    assert error.startswith("error: memory plan: DeepSpeed ZeRO-2 on 8 GPUs needs ~"), error
    assert "masks 0.0" in error and "these fit: [1] add `--sequence_parallel_size 4` (~" in error, error


@pytest.mark.slow
@no_gpu
def test_no_group_is_offered_to_an_attention_a_group_does_not_run(think_dry_run):
    """eager attention has no split (Ulysses takes boolean masks): a refusal names what fits without a group."""
    result = think_dry_run(*LONG, "--gpu_memory_gib", "79.6", "--attn_implementation", "eager", env=H100_NODE)
    assert result.returncode == 2, result.stdout[-3000:]
    error = result.stdout.strip().splitlines()[-1]
    assert error.startswith("error: memory plan: DeepSpeed ZeRO-2 on 8 GPUs needs ~"), error
    assert "--sequence_parallel_size" not in error, error


def test_a_refusal_weighs_groups_only_for_rows_and_attentions_a_group_splits():
    """The groups a refusal weighs (`Advisor.group_sizes`, the `sequence` lever): packed rows on an attention Ulysses
    splits (forwards/sequence_parallel.ATTENTION). None for eager, whether asked for or chosen by the forward where no
    attention is named (Gemma 2's), for padded rows, or for an attention asked for that no group runs (a Hub kernel
    that is not varlen FlashAttention). The dry run above goes through the whole refusal for eager asked for."""
    node = engines.Engine("zero2", "a node of 8 GPUs", gpus_per_node=8)

    def weighed(planned: str | None, *args) -> list[int]:
        advisor = memory_advice.Advisor(smoke(*args), 8, node, planned, plan=None, heads=(32, 8))
        assert ("sequence" in advisor.levers()) == bool(advisor.group_sizes(8)), (planned, args)
        return advisor.group_sizes(8)

    assert weighed(None) == weighed("sdpa") == weighed("flex_attention") == [2, 4, 8]
    varlen = "kernels-community/flash-attn3@v1"
    assert weighed(varlen, "--attn_implementation", varlen) == [2, 4, 8]
    assert weighed("eager") == []
    assert weighed(None, "--attn_implementation", "eager") == weighed("eager", "--attn_implementation", "eager") == []
    assert weighed("sdpa", "--padding_free", "false") == []
    sage = "kernels-community/sage-attention"
    assert weighed(sage, "--attn_implementation", sage) == weighed(None, "--attn_implementation", sage) == []


# --- the groups and the data-parallel degree ---


def _groups_worker(rank: int, world: int, n: int, port: int, out) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as groups

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    deepspeed.init_distributed("gloo", verbose=False)
    groups.initialize_sequence_parallel(n)
    mine = torch.tensor([sequence_parallel.data_parallel_rank(rank, n)])
    group = [torch.zeros(1, dtype=torch.long) for _ in range(n)]
    dist.all_gather(group, mine, group=groups.get_sequence_parallel_group())
    found = [[int(t) for t in group], groups.get_sequence_parallel_rank()]
    found.append(groups.get_sequence_data_parallel_world_size())
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(found, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_data_parallel_rank_is_one_of_deepspeeds_sequence_parallel_groups(tmp_path):
    """Every process of a DeepSpeed Ulysses group has the same data-parallel rank (the group reads one micro-batch),
    its place in the group is `sequence_parallel_rank`, and ZeRO's group spans the world (model states do not change
    with N)."""
    import socket

    world, n = 4, 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn_ranks(_groups_worker, (world, n, port, str(tmp_path)), world, tmp_path)
    found = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)}
    for rank, (group_dp_ranks, sp_rank, zero_world) in found.items():
        assert group_dp_ranks == [sequence_parallel.data_parallel_rank(rank, n)] * n, (rank, group_dp_ranks)
        assert sp_rank == sequence_parallel.sequence_parallel_rank(rank, n)
        assert zero_world == world
    assert sorted({sequence_parallel.data_parallel_rank(r, n) for r in range(world)}) == list(
        range(sequence_parallel.data_parallel_size(world, n))
    )


def smoke(*args):
    return parse_args(["--config", str(ROOT / "configs" / "smoke.yaml"), "--dry-run", *args])


def test_the_same_pairs_make_the_same_steps_on_any_group_size(monkeypatch):
    """4 processes in groups of 2 plan the steps, pairs per step and micro-batches of 2 processes without groups."""
    zero2 = ["--accelerate_config", str(ROOT / "accelerate_config.yaml"), "--pairs_per_step", "8"]
    records = {}
    for world, n in ((2, 1), (4, 2)):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        recipe = smoke(*zero2, "--sequence_parallel_size", str(n))
        found = stages.checks(recipe)
        stages.output_checks(recipe, found, hub.take_push_settings(recipe, found.engine))
        data = stages.load_data(recipe, found, say=False)
        records[n] = (found.data_parallel, data.steps, recipe.training.gradient_accumulation_steps)
    assert records[2] == records[1] and records[1][0] == 2, records


def test_a_packed_row_is_padded_to_a_multiple_of_the_group_and_counted_as_padding():
    lengths = PairLengths.from_parts(np.array([3, 4]), np.array([5, 6]), np.array([7, 2]), 64)
    one = plan.RowLayout("one_row")
    four = plan.RowLayout("one_row", multiple=4)
    tokens = one.positions(lengths, [0, 1])
    assert tokens == 3 + 5 + 3 + 7 + 4 + 6 + 4 + 2
    assert four.positions(lengths, [0, 1]) == -(-tokens // 4) * 4 > tokens
    flex = choice.ForwardChoice(True, False, 64, "flex_attention", sequence_parallel=4)
    assert (
        flex.pad_multiple == 128
        and choice.ForwardChoice(True, False, 64, "sdpa", sequence_parallel=3).pad_multiple == 3
    )
    assert choice.ForwardChoice(True, False, 64, "sdpa").pad_multiple is None


# --- refusals, before anything loads ---


@pytest.mark.parametrize(
    "world, n, config, message",
    [
        (8, 0, "accelerate_config.yaml", "sequence_parallel_size must be >= 1 (got 0)"),
        (
            8,
            3,
            "accelerate_config.yaml",
            "sequence_parallel_size 3 does not divide the 8 processes: use one of 1, 2, 4, 8",
        ),
        (8, 2, "configs/accelerate/fsdp2.yaml", "needs DeepSpeed's engine (Ulysses), not FSDP2: launch with DeepSpeed"),
        (1, 2, "none", "sequence_parallel_size 2 does not divide the 1 process: use one of 1,"),
    ],
)
def test_a_group_the_launch_cannot_form_is_refused(monkeypatch, world, n, config, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    recipe = smoke(
        "--accelerate_config", str(ROOT / config) if config != "none" else "none", "--sequence_parallel_size", str(n)
    )
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        stages.checks(recipe)


@pytest.mark.slow
@no_gpu
def test_heads_a_group_cannot_split_are_refused_by_the_dry_run(think_dry_run):
    result = think_dry_run("--sequence_parallel_size", "3", env={"WORLD_SIZE": "6"})
    assert result.returncode == 2, result
    error = result.stdout.strip().splitlines()[-1]
    assert error == (
        "error: sequence_parallel_size 3 does not split the model's 32 attention heads and 32 key/value "
        "heads over a group: use one of 1, 2 (dividing the heads and the 6 processes)"
    ), error


def test_deepspeeds_head_rule():
    """N divides the heads, and divides the key/value heads or is a multiple of them (DeepSpeed repeats those)."""
    assert sequence_parallel.splits_heads(8, 40, 8) and sequence_parallel.splits_heads(8, 32, 4)
    assert not sequence_parallel.splits_heads(3, 40, 8) and not sequence_parallel.splits_heads(16, 40, 8)
    assert not sequence_parallel.splits_heads(4, 32, 6)


def test_a_forward_that_cannot_split_is_refused_not_swapped():
    """N > 1 needs packed rows: padded ones (padding_free false) and eager attention are refused with what to change.
    A live reference model (precompute_ref_log_probs false, TR-DPO's sync_ref_model) packs and splits like the
    policy."""
    config = memory.model_config(smoke())[0]
    for args, why in (
        (["--padding_free", "false"], "padding_free is false"),
        (["--attn_implementation", "eager"], "eager has no split here"),
    ):
        recipe = smoke("--sequence_parallel_size", "2", *args)
        with pytest.raises(ConfigError, match=f"sequence_parallel_size 2 splits packed sequences, .*{why}"):
            choice.candidates(copy.deepcopy(config), recipe, cuda=False, varlen=None)
    for live in (
        [],
        ["--precompute_ref_log_probs", "false"],
        ["--precompute_ref_log_probs", "false", "--sync_ref_model", "true"],
    ):
        forwards, _ = choice.candidates(
            copy.deepcopy(config), smoke("--sequence_parallel_size", "2", *live), False, None
        )
        assert forwards and all(c.packed for c in forwards), live


def test_a_group_weighs_the_forwards_one_process_weighs_varlen_kernels_included():
    """On a GPU with FlashAttention installed a group weighs what one process weighs: flex_attention (block masks of
    the whole rows), the varlen kernel (the whole row's cu_seq_lens) and sdpa where flex cannot pack; a varlen kernel
    asked for is honoured."""
    config = memory.model_config(smoke())[0]
    alone, _ = choice.candidates(copy.deepcopy(config), smoke(), True, "flash_attention_2", check_kernels=False)
    split, _ = choice.candidates(
        copy.deepcopy(config), smoke("--sequence_parallel_size", "2"), True, "flash_attention_2", check_kernels=False
    )
    assert split == alone and {c.attention for c in split} == {"flex_attention", "flash_attention_2"}, split
    recipe = smoke("--sequence_parallel_size", "2", "--attn_implementation", "kernels-community/flash-attn3@v1")
    asked, _ = choice.candidates(copy.deepcopy(config), recipe, True, None, check_kernels=False)
    assert [(c.attention, c.share_prompt) for c in asked] == [("kernels-community/flash-attn3@v1", False)]
    forward = choice.ForwardChoice(True, False, 64, "flash_attention_4", sequence_parallel=4)
    assert forward.one_row and forward.pad_multiple == 4  # one row, padded to the group: the padding a segment


def test_a_hybrid_is_refused_under_a_group_with_one_line():
    """A hybrid's recurrent layers read the whole row's boundaries (cu_seq_lens, seq_idx) and carry state along it, so
    no group splits it (it packs only on a varlen kernel, which a group otherwise runs); a memory refusal offers
    none."""
    from transformers import AutoConfig

    hybrid = AutoConfig.for_model("olmo_hybrid")
    recipe = smoke("--sequence_parallel_size", "2")
    with pytest.raises(
        ConfigError,
        match="^sequence_parallel_size 2: olmo_hybrid's recurrent layers read the sequence "
        "boundaries of the whole row .* use --sequence_parallel_size 1 for hybrid "
        "models$",
    ):
        choice.candidates(hybrid, recipe, True, "flash_attention_2", check_kernels=False)
    asked = smoke("--padding_free", "true")  # a hybrid packs only when asked for (choice.hybrid_problem)
    assert choice.candidates(hybrid, asked, True, "flash_attention_2", check_kernels=False)[0][0].packed
    assert memory.splittable_heads(hybrid, recipe) is None
    assert memory.splittable_heads(memory.model_config(smoke())[0], recipe) == (4, 2)


def test_activation_checkpointing_is_refused_under_a_group_for_models_whose_attention_misses_the_models_inputs():
    """A checkpointed layer is recomputed in the backward, after the split forward returned: its attention knows the
    split from the model's kwargs, which StableLM's and Nemotron's layers do not hand on to their attention. Refused
    before anything loads, naming the fix (and no memory advice offers them a group); without checkpointing they split,
    and so does a model that hands them on."""
    from transformers import AutoConfig

    shape = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    checkpointed = smoke("--sequence_parallel_size", "2", "--activation_checkpointing", "true")
    for model_type in ("stablelm", "nemotron"):
        with pytest.raises(
            ConfigError,
            match=f"^sequence_parallel_size 2: {model_type}'s layers do not hand the model's inputs on to their "
            "attention, .* pass --activation_checkpointing false, or use --sequence_parallel_size 1$",
        ):
            choice.candidates(AutoConfig.for_model(model_type, **shape), checkpointed, True, None, check_kernels=False)
        assert memory.splittable_heads(AutoConfig.for_model(model_type, **shape), checkpointed) is None  # no advice
        plain = smoke("--sequence_parallel_size", "2")
        assert choice.candidates(AutoConfig.for_model(model_type, **shape), plain, True, None, check_kernels=False)[0]
    assert choice.candidates(AutoConfig.for_model("olmo3", **shape), checkpointed, True, None, check_kernels=False)[0]


def test_an_moe_model_whose_router_loss_trl_adds_is_refused_under_a_group_unless_it_is_turned_off():
    """TRL adds the router's load-balancing loss wherever the config HAS `output_router_logits` (False, its default,
    included) and a coefficient other than 0: OLMoE, Qwen3-MoE and Mixtral as shipped. The rule read the flag's value,
    so they were let through and stopped at step 1 in transformers' `load_balancing_loss_func` ("The size of tensor a
    (988) must match the size of tensor b (1976)": each process routes its own columns). Refused before anything
    loads, naming `--router_aux_loss_coef 0`, with which a group splits them (checked: Mixtral, 2 processes); the
    analyzer offers no group where the run would refuse it."""
    from transformers import AutoConfig

    from dpotrain.plan import long_traces

    shape = dict(num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=65536)
    olmoe = AutoConfig.for_model("olmoe", **shape)
    assert olmoe.output_router_logits is False and olmoe.router_aux_loss_coef == 0.01
    recipe = smoke("--sequence_parallel_size", "2")
    with pytest.raises(
        ConfigError,
        match=r"^sequence_parallel_size 2: TRL adds the MoE router's load-balancing loss \(router_aux_loss_coef "
        r"0.01\), which is not split over a group here; pass --router_aux_loss_coef 0 to train without it, or use "
        "--sequence_parallel_size 1$",
    ):
        choice.candidates(copy.deepcopy(olmoe), recipe, True, "flash_attention_2", check_kernels=False)
    assert memory.splittable_heads(olmoe, recipe) is None
    off = smoke("--sequence_parallel_size", "2", "--router_aux_loss_coef", "0")
    assert choice.candidates(copy.deepcopy(olmoe), off, True, "flash_attention_2", check_kernels=False)[0][0].packed
    assert memory.splittable_heads(olmoe, off) == (16, 16)

    # 64K traces on 4 GPUs of 60 GiB: ~107 GiB per GPU unsplit; a group of 4 carries them once the router loss is off
    zero2 = engines.from_config(str(ROOT / "accelerate_config.yaml"))
    gpu = ["--bf16", "true", "--gpu_memory_gib", "60"]
    lengths = {}
    for given in (smoke(*gpu), smoke(*gpu, "--router_aux_loss_coef", "0")):
        found = long_traces.carrying_groups(given, 4, zero2, [65536], model=(olmoe, None))
        lengths[given.training.router_aux_loss_coef] = found["lengths"][65536]["sequence_parallel_size"]
    assert lengths == {None: None, 0.0: 4}, lengths


@pytest.mark.parametrize(
    "model_type, rope",
    [
        ("phi3", dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[4.0] * 8)),
        ("llama", dict(rope_type="dynamic", factor=2.0)),
    ],
)
def test_a_rope_that_scales_by_the_longest_position_is_refused_under_a_group_with_one_line(model_type, rope):
    """longrope (Phi-3's 128K models) and dynamic NTK pick their frequencies from the largest position id a forward
    sees; a process of a group sees only its columns' (measured: a row whose first half stays under the original
    length scored 5.9e-3 (longrope) and 1.2e-3 (dynamic) off the unsplit row's log-probs, 0.0 without scaling), so no
    group splits them. Scalings fixed at load (llama3, yarn) split as they are."""
    from transformers import AutoConfig

    from dpotrain.forwards import sequence_parallel as split

    shape = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    scaled = AutoConfig.for_model(
        model_type, **shape, original_max_position_embeddings=64, rope_parameters=dict(rope_theta=1e4, **rope)
    )
    recipe = smoke("--sequence_parallel_size", "2")
    with pytest.raises(
        ConfigError,
        match=f"^sequence_parallel_size 2: {model_type}'s rope_type '{rope['rope_type']}' picks its frequencies "
        "from the largest position id .* use --sequence_parallel_size 1$",
    ):
        choice.candidates(scaled, recipe, True, "flash_attention_2", check_kernels=False)
    assert memory.splittable_heads(scaled, recipe) is None
    llama3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    fixed = AutoConfig.for_model(
        "llama", **shape, original_max_position_embeddings=64, rope_parameters=dict(rope_theta=1e4, **llama3)
    )
    assert split.model_problem(fixed, None) is None


# --- the memory plan per GPU ---


def test_the_all_to_all_of_multi_head_latent_attention_is_as_wide_as_its_queries():
    """DeepSeek V3's q and k are qk_head_dim (192) wide and its values (128) are padded to them for Ulysses, whose
    exchange was planned at its config's head_dim (64, the rotary part alone): a third of it."""
    from transformers import AutoConfig

    deepseek = AutoConfig.for_model("deepseek_v3")  # 128 heads, 128 key/value heads
    assert (deepseek.qk_head_dim, deepseek.v_head_dim, deepseek.head_dim) == (192, 128, 64)
    per_token = 2 * 192 * (2 * (128 + 2 * 128) + 2 * 128)  # bf16: q, k, v and the output, in both layouts
    assert memory.all_to_all_bytes(deepseek, 4096, 4) == 1024 * per_token


@no_gpu
def test_a_gpu_holds_a_quarter_of_the_positions_and_all_of_its_model_states():
    """N=4 at 131,072 tokens: activations and LM head of 32,768 tokens; model states, buffers and the masks as without
    groups (ZeRO shards over the world; attention sees every position); the all-to-all buffers on top."""
    args = [
        "--model_name_or_path",
        OLMO3_7B,
        "--memory_check",
        "false",
        "--activation_checkpointing_kwargs",
        '{"every_n_layers": 1}',
    ]
    zero2 = engines.from_config(str(ROOT / "accelerate_config.yaml"))
    grouped = memory.plan(parse_args([*_think(), *args, *LONG, "--sequence_parallel_size", "4"]), 8, zero2, "sdpa")
    quarter = memory.plan(
        parse_args([*_think(), *args, "--max_length", "16384", "--max_tokens_per_microbatch", "32768"]),
        8,
        zero2,
        "sdpa",
    )
    whole = memory.plan(parse_args([*_think(), *args, *LONG]), 8, zero2, "sdpa")
    g, q, w = grouped["per_gpu_gib"], quarter["per_gpu_gib"], whole["per_gpu_gib"]
    assert g["activations"] == q["activations"] < w["activations"] and g["lm_head"] == q["lm_head"] < w["lm_head"]
    assert g["model_states"] == w["model_states"] and g["engine_buffers"] == w["engine_buffers"]
    assert g["attention_masks"] == w["attention_masks"] > q["attention_masks"]
    # q, k, v and the output in both layouts, one layer at a time: bf16 x 32,768 x 128 x (2 x (32 + 64) + 2 x 32).
    assert g["all_to_all"] == round(2 * 32768 * 128 * (2 * 96 + 64) / 2**30, 1) and "all_to_all" not in w


def _think():
    return ["--config", str(ROOT / "configs" / "think.yaml"), "--dry-run"]


def test_the_dry_run_records_the_data_parallel_degree(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    recipe = smoke("--accelerate_config", str(ROOT / "accelerate_config.yaml"), "--sequence_parallel_size", "2")
    assert stages.checks(recipe).record() == {
        "world_size": 4,
        "world_size_source": "environment (WORLD_SIZE)",
        "data_parallel_size": 2,
        "gradient_clipping": {"max_grad_norm": 1.0, "clipped_by": engines.CLIPPED_BY["zero2"]},
    }


@pytest.mark.slow
@no_gpu
def test_the_analyzer_says_which_group_carries_a_max_length(tmp_path):
    """Asked about 64K traces for the think recipe on one node of 8 H100s, the analyzer names the group that carries
    them, from the same memory plan as the dry run (OLMo 3 7B's config, with the built-in tokenizer beside it)."""
    import shutil
    import subprocess

    from conftest import python
    from dpotrain.data import builtin

    model = tmp_path / "olmo3-7b"
    builtin.build_tokenizer().save_pretrained(model)
    shutil.copy(ROOT / "configs" / "models" / "olmo3-7b" / "config.json", model / "config.json")
    report = tmp_path / "report.json"
    # The bundled answers hold no thinking trace, which think.yaml's olmo_thinker template opens: the model's own
    # template measures them (the memory plan is what is tested).
    result = subprocess.run(
        [
            python(),
            str(ROOT / "scripts" / "analyze_dataset.py"),
            str(ROOT / "data" / "smoke_prefs.jsonl"),
            "--config",
            "configs/think.yaml",
            "--tokenizer",
            str(model),
            "--chat_template_path",
            str(model / "chat_template.jinja"),
            "--gpu_memory_gib",
            "79.6",
            "--candidates",
            "65536",
            "131072",
            "--sample",
            "50",
            "--json",
            str(report),
        ],
        cwd=ROOT,
        env={**os.environ, **H100_NODE, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    memory_report = json.loads(report.read_text())["memory"]
    assert memory_report["lengths"]["65536"]["sequence_parallel_size"] == 4, memory_report
    assert memory_report["lengths"]["16384"]["sequence_parallel_size"] == 1, memory_report  # the recipe's own
    assert "max_length 65536 fits with --sequence_parallel_size 4 (~" in result.stdout, result.stdout[-2000:]
    # Past OLMo 3 7B's 65,536 positions (a sample: the data's longest is not known): training would refuse it
    assert memory_report["lengths"]["131072"] == {"past_positions": 65536}, memory_report
    assert "max_length 131072 reaches past the model's 65,536 positions (training refuses it)" in result.stdout


def test_a_groups_reference_micro_batch_grows_less_than_one_processs():
    """The reference stage's forward-only micro-batch under a group: a GPU holds 1/N of its positions but the whole
    rows' masks and the all-to-all's buffers, as in training, so it grows less than without a group. OLMo 3 7B, 64K
    traces, every layer checkpointed, on flex: 3x training's tokens alone, 2x in a group of 4."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(OLMO3_7B)
    assert memory.forward_only_multiple(config, 131072, 65536, "flex_attention", True) == 3
    assert memory.forward_only_multiple(config, 131072, 65536, "flex_attention", True, 4) == 2


def test_a_model_with_attention_sinks_is_refused_under_a_group_even_without_its_router_loss():
    """gpt-oss's sinks are one value per head of a layer, which its attention joins to the scores of every head it
    computes: under a group each process computes a slice of the heads, and the first layer would stop on the shapes.
    Refused before anything loads; its router loss turned off does not lift it."""
    from transformers import AutoConfig

    from dpotrain.forwards import sequence_parallel as split

    gpt_oss = AutoConfig.for_model("gpt_oss", num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4)
    assert split.model_problem(gpt_oss, 0.0) == (
        "gpt_oss's attention sinks hold one value for each head of a layer, and a group gives each process a slice of "
        "the heads; use --sequence_parallel_size 1"
    )
    with pytest.raises(ConfigError, match="^sequence_parallel_size 2: gpt_oss's attention sinks"):
        choice.candidates(gpt_oss, smoke("--sequence_parallel_size", "2", "--router_aux_loss_coef", "0"), True, None)
    granite_swa = AutoConfig.for_model("granite_swa", num_attention_heads=16, num_key_value_heads=4)
    assert split.model_problem(granite_swa, None).startswith("granite_swa's attention sinks")
