"""Sequence parallelism as it runs (`--sequence_parallel_size N`, dpotrain/forwards/sequence_parallel.py): 2 processes
splitting every packed row in halves train the trajectory of 1 process (loss 1e-4 relative per step, weights 1e-5,
fp32), through DeepSpeed Ulysses' all-to-all on gloo: multi-turn pairs with shared prompts and a cached reference on
ZeRO-2 (and that group, preempted at step 1, resumes to the same trajectory); plain pairs unshared, with evaluation,
activation checkpointing and a live reference model synced from the policy (TR-DPO), in one launch on ZeRO-3 (all on
sdpa, CPU's training attention); and 4 processes in 2 groups of 2 train what 2 processes without a group train.
On flex_attention, forward only (no flex backward on CPU): a group of 2 scores what 1 process scores. On a varlen
FlashAttention kernel (a PyTorch stand-in registered under its name: CPU runs no FlashAttention), a group of 2 scores
and differentiates what 1 process does. Each 2-process launch costs ~60 s on 2 cores; the five scoring cases (flex,
StableLM, three varlen models) share one pair of ranks (`split_scores`). The plan's side (groups, steps, memory,
refusals): tests/test_sequence_parallel_plan.py."""

import itertools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, accelerate_launch, launch_env, python, rank_python, smoke_command, spawn_ranks
from dpotrain.forwards import packing, sequence_parallel
from dpotrain.recipe.errors import plural
from dpotrain.train.preemption import STOPPED_EXIT

# An SFT term: its totals (the step's pairs and chosen tokens) are counted on every process of a group, as pairs are in
# the loss's weight, so the group's N cancels in the SFT term too (losses.SftOverStep).
SFT_TERM = ["--loss_type", "sigmoid_norm", "sft", "--loss_weights", "1.0", "0.5"]
STEPS = ["--max_steps", "4", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none"]


def train(out, model_dir, *args, processes=1, config="accelerate_config.yaml", env=(), exit_code=0):
    launcher = [python()]
    if processes > 1:
        launcher = [
            *accelerate_launch(),
            "--config_file",
            str(ROOT / config),
            "--num_processes",
            str(processes),
            *rank_python(),
        ]
    env = launch_env(f"{out}-cache", **dict(env))
    cmd = smoke_command(launcher, model_dir, "--output_dir", str(out), *STEPS, *args)
    result = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900
    )
    assert result.returncode == exit_code, result.stdout[-4000:]
    return result.stdout


def records(out) -> dict:
    """{(step, "train" | "eval"): record} of metrics.jsonl."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {(r["step"], "eval" if "eval_loss" in r else "train"): r for r in map(json.loads, lines)}


def assert_same_trajectory(one, split, log: str, model_dir, group=True, groups=1) -> None:
    """`split` trained what `one` trained; `group`: `split`'s last launch ran `groups` groups of 2, as many as `one`
    had processes (else processes of their own: its micro-batches are dealt to 2 data-parallel ranks, so the plan's
    per-rank counts differ)."""
    if group:
        line = f"Sequence parallel: {plural(groups, 'group')} of 2 processes, each process 1/2 of every packed row"
        assert line in log
    else:
        assert "Sequence parallel" not in log
    want, got = records(one), records(split)
    assert list(got) == list(want)
    for key, record in want.items():
        for metric in ("loss", "eval_loss", "grad_norm", "logps/chosen", "rewards/margins", "num_tokens"):
            if metric in record:
                assert abs(got[key][metric] - record[metric]) <= 1e-4 * max(1, abs(record[metric])), (key, metric)
    # The group read one micro-batch at a time: the plan is the one of a single data-parallel rank
    batching = [json.loads((d / "resolved_config.json").read_text())["derived"]["batching"] for d in (one, split)]
    assert not group or batching[1]["micro_batches_per_step"] == batching[0]["micro_batches_per_step"]
    wa, wb = load_file(str(one / "model.safetensors")), load_file(str(split / "model.safetensors"))
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-5
    start = load_file(str(Path(model_dir) / "model.safetensors"))
    assert all(float((wb[k] - start[k]).abs().max()) > 0 for k in wb)  # every tensor trained, not left as it was


@pytest.fixture(scope="module")
def zero2_group(tmp_path_factory, tiny_model_dir) -> dict:
    """The ZeRO-2 runs on multi-turn pairs with shared prompts, each launched once for the tests below: `one` process;
    a group of 2 (`split`); a group `stopped` at step 1 and rerun with the same command; and that checkpoint resumed
    by 2 processes without a group (`regrouped`: 2 data-parallel ranks, which the 4 processes in 2 groups are compared
    with too). The stop file is there before the run starts (tests/test_mixture.py's pattern) and the reference comes
    from the uninterrupted group's cache (so the reference stage has nothing to stop). Their folders and logs, and the
    stop file's marker as the stopped run left it."""
    folder = tmp_path_factory.mktemp("zero2-group")
    one, split, stopped, stop_file = folder / "one", folder / "split", folder / "stopped", folder / "stop"
    runs = {"folder": folder, "one": one, "split": split, "stopped": stopped, "regrouped": folder / "regrouped"}
    train(one, tiny_model_dir)
    runs["split_log"] = train(split, tiny_model_dir, "--sequence_parallel_size", "2", processes=2)
    stop_file.touch()
    env = {"DPOTRAIN_STOP_FILE": str(stop_file), "DPOTRAIN_CACHE": f"{split}-cache"}
    # torchrun exits 1 when its workers exit STOPPED_EXIT (saved, not finished); the marker is what requeues the job
    runs["stop_log"] = train(
        stopped, tiny_model_dir, "--sequence_parallel_size", "2", processes=2, env=env, exit_code=1
    )
    runs["checkpointed"] = stop_file.with_name("stop.checkpointed").read_text()
    stop_file.unlink()
    shutil.copytree(stopped, runs["regrouped"])  # the same checkpoint, resumed below without a group
    runs["rerun_log"] = train(stopped, tiny_model_dir, "--sequence_parallel_size", "2", processes=2, env=env)
    # Resumed on another N: the group's checkpoint goes on as 2 processes of their own (2 data-parallel ranks; the
    # same world size, so ZeRO's partitions agree). N changes how the work is split, not what is computed.
    runs["regrouped_log"] = train(
        runs["regrouped"], tiny_model_dir, "--sequence_parallel_size", "1", processes=2, env=env
    )
    return runs


@pytest.mark.slow
def test_two_processes_splitting_rows_train_what_one_process_trains_zero2_shared_prompts(zero2_group, tiny_model_dir):
    """2 processes splitting rows train what 1 process trains (ZeRO-2, shared prompts); and a group preempted at step 1
    resumes from its checkpoint to the uninterrupted group's trajectory, and so does its checkpoint resumed by 2
    processes without a group (the runs: `zero2_group`)."""
    runs = zero2_group
    one, split, stopped, regrouped = runs["one"], runs["split"], runs["stopped"], runs["regrouped"]
    assert "prompts shared" in runs["split_log"]
    assert_same_trajectory(one, split, runs["split_log"], tiny_model_dir)

    # Both ranks leave together after the checkpoint; torchrun still SIGTERMs one that is shutting down when the other
    # has exited first, so each rank reads 75 or -15 (never a failure of its own), and the first to exit read 75.
    codes = re.findall(r"exitcode  : (-?\d+) ", runs["stop_log"])
    assert str(STOPPED_EXIT) in codes and set(codes) <= {str(STOPPED_EXIT), "-15"}, runs["stop_log"][-4000:]
    assert runs["checkpointed"].startswith(f"checkpoint {stopped}/checkpoint-1 ")
    log = runs["rerun_log"]
    assert f"Resuming from {stopped}/checkpoint-1" in log
    lines = [json.loads(line) for line in (stopped / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4]  # step 1 once: the rerun went on, not over
    assert_same_trajectory(split, stopped, log, tiny_model_dir)

    log = runs["regrouped_log"]
    assert f"Resuming from {regrouped}/checkpoint-1" in log
    lines = [json.loads(line) for line in (regrouped / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4]
    assert_same_trajectory(split, regrouped, log, tiny_model_dir, group=False)
    # Another world size cannot: ZeRO's optimizer state is partitioned over the 2 processes that wrote it. Refused
    # before anything loads, not DeepSpeed's traceback after the weights load.
    log = train(
        runs["folder"] / "fewer",
        tiny_model_dir,
        "--resume_from_checkpoint",
        str(regrouped / "checkpoint-1"),
        exit_code=2,
    )
    assert "partitioned over 2 processes, and this run has 1: resume it on 2 processes" in log.splitlines()[-1]


@pytest.mark.slow
def test_two_processes_splitting_rows_train_what_one_process_trains_zero3_unshared_with_a_live_reference(
    tmp_path, tiny_model_dir, splits
):
    """ZeRO-3 (weights sharded over both processes of the group), prompts unshared, with evaluation, and an SFT term
    beside the DPO loss (`SFT_TERM`: its step totals counted on both processes of the group, which must cancel), with
    activation checkpointing as the GPU recipes train: each layer's attention is recomputed in the backward, after
    the split forward returned, and must be split again (it ran unsplit on the local half of the row, and the first
    backward stopped: "The size of tensor a (298) must match the size of tensor b (596)").
    And a live reference model, synced from the policy (TR-DPO: `sync_ref_model`, every 2 of the 4 steps, so steps 3-4
    train against a reference that is no longer the start): no reference stage, the reference scored at every
    micro-batch in the same split as the policy, no grad, by its own DeepSpeed ZeRO-3 engine (TRL's
    `prepare_deepspeed`), whose weights are sharded too, so both processes of the group run its gathers together.
    One launch for all of these (each 2-process launch costs ~60 s)."""
    args = [
        "--dataset_name",
        str(splits),
        "--share_prompt",
        "false",
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "2",
        "--activation_checkpointing",
        "true",
        *SFT_TERM,
        "--precompute_ref_log_probs",
        "false",
        "--sync_ref_model",
        "true",
        "--ref_model_sync_steps",
        "2",
    ]
    one_log = train(tmp_path / "one", tiny_model_dir, *args)
    log = train(
        tmp_path / "split",
        tiny_model_dir,
        *args,
        "--sequence_parallel_size",
        "2",
        processes=2,
        config="configs/accelerate/zero3.yaml",
    )
    for output in (one_log, log):
        assert "Forward: unshared packing, balanced rows on sdpa" in output
        assert "reference log-probs (train)" not in output  # no reference stage: the live model scores each step
    forward = json.loads((tmp_path / "split" / "resolved_config.json").read_text())["derived"]["forward"]
    assert forward["packed"] and forward["sequence_parallel"] == 2
    assert (2, "eval") in records(tmp_path / "split")
    assert_same_trajectory(tmp_path / "one", tmp_path / "split", log, tiny_model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zero2-shared", pytest.param("zero3-unshared", marks=pytest.mark.extended)])
def test_four_processes_in_two_groups_train_what_two_processes_train(tmp_path, tiny_model_dir, splits, layout, request):
    """4 processes in 2 groups of 2 (2 data-parallel ranks, each group splitting its micro-batches in halves) train
    what 2 processes without a group train (2 data-parallel ranks): the sampler deals micro-batches to groups, not to
    processes, and the engine averages gradients over all 4 processes, the groups' sums giving the 2 ranks' mean.
    Multi-turn pairs with shared prompts on ZeRO-2 (in CI), plain pairs unshared on ZeRO-3 (`-m extended`); the cached
    reference is scored by the groups too. The second group's gradient gather failed on gloo before (torch's
    all-gather backward scatters from global ranks: `sequence_parallel._GatherColumns`). On ZeRO-2 the 2 processes are
    `zero2_group`'s regrouped run (its step 1 trained by a group, which the test above proves the same step)."""
    args, config = [], "accelerate_config.yaml"
    if layout == "zero3-unshared":
        args, config = ["--dataset_name", str(splits), "--share_prompt", "false"], "configs/accelerate/zero3.yaml"
        two = tmp_path / "two"
        train(two, tiny_model_dir, *args, processes=2, config=config)
    else:  # a launch of 2 processes less: the ZeRO-2 runs' own, asked for here only (the extended case does not)
        two = request.getfixturevalue("zero2_group")["regrouped"]
    log = train(tmp_path / "four", tiny_model_dir, *args, "--sequence_parallel_size", "2", processes=4, config=config)
    assert ("prompts shared" in log) == (layout == "zero2-shared")
    assert_same_trajectory(two, tmp_path / "four", log, tiny_model_dir, groups=2)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fused_model(model_dir, attention):
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention).eval()
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    return model


def shared_prompt_batch(multiple):
    """Four pairs packed with shared prompts, prompts longer than the tiny OLMo 3's 128-token sliding window, rows
    padded to whole FlexAttention tiles (a multiple of the group too): what the reference stage scores."""
    from dpotrain.forwards.shared_prompt import SharedPromptCollator

    g = torch.Generator().manual_seed(0)
    pairs = [
        {
            "prompt_ids": torch.randint(5, 800, (p,), generator=g).tolist(),
            "chosen_ids": torch.randint(5, 800, (c,), generator=g).tolist(),
            "rejected_ids": torch.randint(5, 800, (r,), generator=g).tolist(),
        }
        for p, c, r in ((150, 40, 90), (30, 200, 20), (1, 7, 9), (400, 5, 3))
    ]
    return SharedPromptCollator(1024, hidden_size=64, pad_to_multiple_of=multiple)(pairs)


def score_split_on_flex(rank: int, model_dir: str, out: str, attention: str = "flex_attention") -> None:
    """One process of a group of 2 (`score_every_case`): the per-token log-probs of the same packed micro-batch, each
    process running its half of the columns on flex_attention (or `attention`) through DeepSpeed's all-to-all, as the
    reference stage scores it."""
    from dpotrain.forwards import flex

    flex.BACKEND = "eager"  # dynamo traces flex as on a GPU; inductor's CPU code for flex fails to compile (torch 2.13)
    flex.install()
    torch.manual_seed(0)
    model = fused_model(model_dir, attention)
    sequence_parallel.set_up(2, model)
    batch = shared_prompt_batch(128)
    stand_in = packing.PackedModel(model, batch, sequence_parallel.forward)
    with torch.no_grad():
        split = stand_in(fused_lm_head=True).log_probs
        whole = packing.unpack_outputs(packing.forward(model, batch), batch).log_probs  # outside a split: no group
    torch.save({"split": split, "whole": whole, "width": batch["input_ids"].shape[1]}, f"{out}/rank{rank}.pt")


def leave_split() -> None:
    """Undo `sequence_parallel.set_up` in this process (its group and the attention wrapper it put in transformers'
    table), which a run does once for its one model: the next case's model gets a group and a wrapper of its own."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name, function in list(ALL_ATTENTION_FUNCTIONS.items()):
        if isinstance(function, sequence_parallel._Attention):
            ALL_ATTENTION_FUNCTIONS[name] = function.original
    sequence_parallel._group.clear()


def score_every_case(rank: int, port: int, cases: tuple) -> None:
    """One process of a group of 2 (gloo) running each case in turn, `(scorer, model folder, results folder, *more)`:
    one pair of ranks for all, not a launch of 2 fresh ranks each."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
    )
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    scorers = {"flex": score_split_on_flex, "varlen": score_split_on_varlen}
    for scorer, model_dir, out, *more in cases:
        try:
            scorers[scorer](rank, model_dir, out, *more)
        except Exception as error:
            error.add_note(f"in the case whose results go to {out}")
            raise
        leave_split()


@pytest.fixture(scope="module")
def split_scores(tmp_path_factory, tiny_model_dir) -> dict:
    """The scoring cases of a group of 2 below, run by one launch of 2 ranks (`score_every_case`): flex_attention on
    the tiny OLMo 3, StableLM on sdpa, and a varlen kernel on the tiny OLMo 3, DeepSeek V3's MLA and Gemma 4.
    {case: the folder its ranks wrote their results to}."""
    from test_architectures import FAMILIES

    from conftest import tiny_model

    folder = tmp_path_factory.mktemp("split")
    models = {
        "stablelm": ("stablelm", {}),
        "mla": ("deepseek_v3", FAMILIES["deepseek_v3"] | {"v_head_dim": 8}),
        "gemma4_text": ("gemma4_text", FAMILIES["gemma4_text"]),
    }
    dirs = {"olmo3": tiny_model_dir}
    dirs |= {
        case: tiny_model(kind, folder / f"{case}-model", tiny_model_dir, **shape)
        for case, (kind, shape) in models.items()
    }
    outs = {case: folder / case for case in ("flex", "stablelm", "olmo3", "mla", "gemma4_text")}
    for out in outs.values():
        out.mkdir()
    cases = (
        ("flex", tiny_model_dir, str(outs["flex"])),
        ("flex", dirs["stablelm"], str(outs["stablelm"]), "sdpa"),
        *(("varlen", dirs[case], str(outs[case])) for case in ("olmo3", "mla", "gemma4_text")),
    )
    spawn_ranks(score_every_case, (free_port(), cases), 2, folder)
    return outs


@pytest.mark.slow
def test_two_processes_splitting_rows_on_flex_attention_score_what_one_process_scores(split_scores, tiny_model_dir):
    """flex_attention under N=2, forward only (CPU has no flex backward): each process holds half of every packed row,
    the project's block masks of the WHOLE rows (shared prompts, sliding windows) pass through the all-to-all unchanged,
    and the gathered per-token log-probs equal one process's on flex and on sdpa to fp32 noise."""
    got = [torch.load(split_scores["flex"] / f"rank{rank}.pt") for rank in (0, 1)]
    assert got[0]["width"] % 128 == 0 and got[0]["width"] >= 256  # every process held a part of a real row
    batch = shared_prompt_batch(128)
    with torch.no_grad():
        sdpa = packing.unpack_outputs(packing.forward(fused_model(tiny_model_dir, "sdpa"), batch), batch).log_probs
    mask = packing.padded_view(batch)["completion_mask"][:, 1:].bool()  # the positions the loss reads
    assert int(mask.sum()) == 374  # every completion token of the four pairs
    for result in got:  # both processes of the group hold the whole rows' log-probs
        assert result["split"].shape == sdpa.shape
        assert (result["split"] - result["whole"])[mask].abs().max() < 1e-5
        assert (result["split"] - sdpa)[mask].abs().max() < 1e-4
    assert torch.equal(got[0]["split"], got[1]["split"])


@pytest.mark.slow
def test_a_model_whose_layers_keep_the_models_inputs_from_attention_splits_its_rows_too(split_scores):
    """StableLM's layers call their attention without the model's kwargs, so the split reaches its attention as state
    set around the forward, not as the kwarg a checkpointed layer's recompute reads (`sequence_parallel.SPLIT`; under a
    group with activation checkpointing it is refused): a group of 2 scores on sdpa what 1 process scores. With the
    kwarg alone its attention ran unsplit on half of the row ("The size of tensor a (180) must match ... (360)")."""
    batch = shared_prompt_batch(128)
    mask = packing.padded_view(batch)["completion_mask"][:, 1:].bool()
    for rank in (0, 1):
        result = torch.load(split_scores["stablelm"] / f"rank{rank}.pt")
        assert (result["split"] - result["whole"])[mask].abs().max() < 1e-5


def varlen_reference(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    cu_seq_lens_q=None,
    cu_seq_lens_k=None,
    **kwargs,
):
    """What a varlen FlashAttention kernel computes, in PyTorch with autograd (CPU has no FlashAttention): causal
    attention within each segment of the row that `cu_seq_lens_q/k` bound, in the layer's sliding window if it has one.
    Like the kernel it takes the boundaries from the kwargs only, and writes only the positions its segments cover: the
    rest are NaN here (the kernel leaves the memory it allocated as it was). A mask must not reach it: transformers'
    `_flash_attention_forward` would unpad by a mask instead of taking `cu_seq_lens`."""
    assert attention_mask is None, "a mask reached the varlen kernel, which would then ignore cu_seq_lens"
    assert cu_seq_lens_q is not None and torch.equal(cu_seq_lens_q, cu_seq_lens_k), "no cu_seq_lens reached the kernel"
    rows, heads, width, dim = query.shape
    assert rows == 1, "a varlen kernel takes one row"
    key, value = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (key, value))  # grouped key/value heads
    bounds = cu_seq_lens_q.tolist()
    parts = []
    for start, end in itertools.pairwise(bounds):
        i = torch.arange(end - start)
        allowed = i[:, None] >= i[None, :]
        if sliding_window is not None:
            allowed &= i[:, None] - i[None, :] < sliding_window
        scores = query[:, :, start:end] @ key[:, :, start:end].transpose(-1, -2) * (scaling or dim**-0.5)
        parts.append(scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ value[:, :, start:end])
    parts.append(torch.full_like(value[:, :, bounds[-1] :], float("nan")))  # never written
    return torch.cat(parts, dim=2).transpose(1, 2), None


def varlen_batch():
    """Three pairs of uneven lengths (two sequences longer than the tiny OLMo 3's 128-token sliding window) in one row,
    729 positions padded to 730 for a group of 2: the padding is a segment of its own."""
    g = torch.Generator().manual_seed(1)
    pairs = [
        {
            "prompt_ids": torch.randint(5, 800, (p,), generator=g).tolist(),
            "chosen_ids": torch.randint(5, 800, (c,), generator=g).tolist(),
            "rejected_ids": torch.randint(5, 800, (r,), generator=g).tolist(),
        }
        for p, c, r in ((150, 40, 91), (30, 200, 21), (1, 7, 8))
    ]
    return packing.PackedPreferenceCollator(1024, one_row=True, hidden_size=64, pad_to_multiple_of=2)(pairs)


def scores_and_grads(model, stand_in, batch):
    """The per-token log-probs of `stand_in`'s forward (TRL's padded layout) and the gradients of their sum over the
    completion tokens (what the loss reads) in every parameter of `model`."""
    model.zero_grad()
    log_probs = stand_in(fused_lm_head=True).log_probs
    mask = packing.padded_view(batch)["completion_mask"][:, 1:]
    (log_probs * mask).sum().backward()
    return log_probs.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def score_split_on_varlen(rank: int, model_dir: str, out: str) -> None:
    """One process of a group of 2 (`score_every_case`) running `varlen_reference` as transformers' flash_attention_2:
    the split forward's log-probs and gradients; on rank 0 also the same kernel's and sdpa's on the whole row,
    unsplit."""
    from transformers import AttentionInterface

    # The name, so that transformers takes its FlashAttention mask path (no mask for packed rows) and the project its
    # varlen one (`packing.one_row`); the kernel, this process's stand-in.
    AttentionInterface.register("flash_attention_2", varlen_reference)
    model = fused_model(model_dir, "sdpa")
    model.config._attn_implementation = "flash_attention_2"
    sequence_parallel.set_up(2, model)
    batch = varlen_batch()
    split = scores_and_grads(model, packing.PackedModel(model, batch, sequence_parallel.forward), batch)
    result = {"split": split, "width": batch["input_ids"].shape[1]}
    if rank == 0:  # outside a split the wrapper calls the kernel alone, on the whole row: one process
        result["whole"] = scores_and_grads(model, packing.PackedModel(model, batch), batch)
        sdpa = fused_model(model_dir, "sdpa")
        result["sdpa"] = scores_and_grads(sdpa, packing.PackedModel(sdpa, batch), batch)
    torch.save(result, f"{out}/rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["olmo3", "mla", "gemma4_text"])
def test_two_processes_splitting_a_row_on_a_varlen_kernel_score_and_train_what_one_process_does(split_scores, model):
    """A varlen FlashAttention kernel under N=2 (a PyTorch stand-in: CPU runs no FlashAttention): each process holds
    half of the row, the whole row's cu_seq_lens (the padding a segment of its own) reach the kernel through Ulysses'
    all-to-all, and the gathered per-token log-probs and the gradients (summed over the group and divided by its 2
    processes, as DeepSpeed averages them) are one process's with the same kernel, to fp32 noise; that kernel gives
    sdpa's on the whole row. `mla`: DeepSeek V3's multi-head latent attention, whose queries and keys (16 wide) are
    neither its config's head_dim (8, the rotary part) nor as wide as its values (8, as DeepSeek V3's 192 and 128):
    Ulysses was built for the config's head_dim and stopped at the first layer ("query input tensor does not match the
    required shape"); its one width for q, k and v is now the query's, the values padded to it and cut back.
    `gemma4_text`: Gemma 4's full-attention layers are twice as wide as its sliding ones and have 1 key/value head of
    their own (2 in sliding layers; with 2 processes each gets a copy of it), which Ulysses' one shape refused."""
    got = [torch.load(split_scores[model] / f"rank{rank}.pt") for rank in (0, 1)]
    assert got[0]["width"] == 730  # 729 positions and a padding segment
    mask = packing.padded_view(varlen_batch())["completion_mask"][:, 1:].bool()
    assert int(mask.sum()) == 367  # every completion token of the three pairs
    (whole, whole_grads), (sdpa, sdpa_grads) = got[0]["whole"], got[0]["sdpa"]
    assert (whole - sdpa)[mask].abs().max() < 1e-5  # the stand-in is the kernel sdpa's masks describe
    for name, g in sdpa_grads.items():
        assert (whole_grads[name] - g).abs().max() <= 1e-5 + 1e-4 * g.abs().max(), name
    for result in got:  # both processes of the group hold the whole row's log-probs
        assert (result["split"][0] - whole)[mask].abs().max() < 1e-5
    assert torch.equal(got[0]["split"][0], got[1]["split"][0])
    for name, g in whole_grads.items():
        mean = (got[0]["split"][1][name] + got[1]["split"][1][name]) / 2
        assert torch.isfinite(mean).all() and (mean - g).abs().max() <= 1e-5 + 1e-4 * g.abs().max(), name


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 or more CUDA GPUs (sequence_parallel_size 2 splits a row over two)"
)
@pytest.mark.parametrize("attention", ["flex_attention", "sdpa", "varlen"])
def test_on_two_gpus_splitting_rows_in_bf16_trains_what_one_gpu_trains(tmp_path, tiny_model_dir, attention):
    """bf16 on GPUs, each attention a group runs (flex's backward and the varlen FlashAttention kernels under a group
    run only here: CPU has neither): the all-to-all and the gathers over NCCL. `varlen`: the fastest one installed
    (FA4, FA3, FA2). bf16 sums in another order round differently: the losses agree to 1e-2 relative, not to fp32's
    1e-4."""
    model_dir = tiny_model_dir
    if attention == "varlen":
        from dpotrain.forwards import choice

        attention = choice.installed_varlen(cuda=True)
        if attention is None:
            pytest.skip("no varlen FlashAttention kernel is installed (FA4: pip install -r requirements-gpu.txt)")
        model_dir = with_head_dim_64(tiny_model_dir, tmp_path / "model")
    args = ["--bf16", "true", "--attn_implementation", attention]
    train(tmp_path / "one", model_dir, *args)
    log = train(tmp_path / "split", model_dir, *args, "--sequence_parallel_size", "2", processes=2)
    assert f"Sequence parallel: 1 group of 2 processes, each process 1/2 of every packed row; {attention}" in log
    want, got = records(tmp_path / "one"), records(tmp_path / "split")
    assert list(got) == list(want)
    for key, record in want.items():
        assert abs(got[key]["loss"] - record["loss"]) <= 1e-2 * max(1, abs(record["loss"])), key


def with_head_dim_64(tiny_model_dir, folder) -> str:
    """The tiny OLMo 3 (4 heads, 2 key/value heads, its tokenizer) at hidden size 256: heads of 64, a size every
    FlashAttention kernel takes (the tiny model's 16 is below what some build for)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.hidden_size, config.intermediate_size = 256, 512
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return str(folder)
