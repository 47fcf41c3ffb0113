"""Odd world sizes and data that does not divide, on real `accelerate launch`es of 3 processes (DDP on gloo): what
must be the same on every rank is checked before the model loads, and a refusal is one line on each rank."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import datasets
import pytest

from conftest import (
    PAUSE_AT,
    ROOT,
    accelerate_launch,
    ddp_config,
    launch_env,
    pause_env,
    python,
    rank_python,
    signal_paused,
    smoke_command,
)


def launch(
    tmp_path, processes: int, model_dir: str, data, *args, out="run", config=None
) -> subprocess.CompletedProcess:
    """`accelerate launch --num_processes N train_dpo.py` of the smoke recipe under plain DDP (or `config`'s engine);
    1: `python train_dpo.py`."""
    if config is None:
        config = ddp_config(tmp_path, processes)
    env = launch_env(tmp_path / "cache")
    launcher = [*accelerate_launch(), "--config_file", str(config), "--num_processes", str(processes), *rank_python()]
    launcher = launcher if processes > 1 else [python()]
    cmd = smoke_command(
        launcher,
        model_dir,
        "--dataset_name",
        str(data),
        "--output_dir",
        str(tmp_path / out),
        "--report_to",
        "none",
        *args,
    )
    return subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300
    )


@pytest.mark.slow
@pytest.mark.parametrize("truncation", ["keep_start", "keep_end"])
def test_a_held_out_split_smaller_than_the_ranks_is_refused_in_one_line_before_the_model_loads(
    truncation, tmp_path, tiny_model_dir
):
    """1 held-out pair on 3 processes. Under keep_end the run loaded the model, scored the reference on every pair
    and was refused at its first evaluation; under keep_start it was refused early, but blamed max_length ("the
    trainer drops a pair whose prompt alone fills max_length ...; hold out pairs with shorter prompts"), though no
    pair was dropped."""
    from dpotrain.data import builtin

    rows = builtin.make_preference_rows(14, seed=13)
    data = tmp_path / "pairs"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:13]), "test": datasets.Dataset.from_list(rows[13:])}
    ).save_to_disk(data)
    args = ["--max_steps", "2", "--pairs_per_step", "4", "--eval_strategy", "steps", "--eval_steps", "1"]
    result = launch(tmp_path, 3, tiny_model_dir, data, *args, "--truncation_mode", truncation)
    assert result.returncode == 1, result.stdout[-3000:]
    # One line, the first rank's to meet it (every rank checks inside one gather, collectives.every_rank: it was
    # written once per rank), starting a line of the log the three ranks share, also where it lands after the main
    # process's progress bar, which ends its line only as it closes ("Reading test pairs: 100%|...| 1/1 [...]error:
    # the evaluation split ...").
    errors = re.findall(r"^error: .*", result.stdout, re.MULTILINE)
    want = (
        "error: the evaluation split has 1 pair, fewer than the 3 processes that evaluate (each needs one): hold out "
        "at least 3 pairs, launch fewer processes, or set no eval_strategy"
    )
    assert errors == [want], result.stdout[-3000:]
    assert "reference log-probs" not in result.stdout


@pytest.mark.slow
def test_held_out_pairs_the_ranks_cannot_share_equally_are_evaluated_one_a_batch(tmp_path, tiny_model_dir):
    """5 held-out pairs on 2 processes at per_device_eval_batch_size 1: rank 1's third batch was empty, a traceback
    ("max() arg is an empty sequence") at the first evaluation, after training. It runs a filler, not counted."""
    from dpotrain.data import builtin

    rows = builtin.make_preference_rows(17, seed=13)
    data = tmp_path / "pairs"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:12]), "test": datasets.Dataset.from_list(rows[12:])}
    ).save_to_disk(data)
    args = ["--max_steps", "2", "--pairs_per_step", "4", "--eval_strategy", "steps", "--eval_steps", "2"]
    result = launch(tmp_path, 2, tiny_model_dir, data, *args, "--per_device_eval_batch_size", "1")
    assert result.returncode == 0, result.stdout[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [2]


@pytest.mark.parametrize(
    "rows, kept, ranks, max_steps, refused",
    [
        (7, None, 1, -1, "where the 7 pairs make 2 steps an epoch"),  # no pair dropped
        (9, 7, 1, -1, "where the 7 pairs it trains (of 9 rows: 2 dropped at max_length) make 2 steps an epoch"),
        (7, 6, 1, -1, None),  # 6 pairs kept: 2 steps on any number of ranks (the 7 rows: 2 on 3, 3 on one)
        (7, None, 3, -1, None),  # the ranks it was trained on
        (7, None, 1, 1, None),  # the run ends at step 1, before the steps differ
        (7, None, 1, 2, "where the 7 pairs make 2 steps an epoch"),  # its step 2 is 4 pairs on 3 ranks, 3 on one
    ],
)
def test_a_checkpoint_resumed_on_ranks_that_cut_its_epoch_into_other_steps_is_refused(
    rows, kept, ranks, max_steps, refused, tmp_path
):
    """7 pairs of 3 a step: on 3 ranks the last pair joins step 2 (steps of 3 and 4 pairs), on one process it is a
    step of its own (3 steps). Step 1's checkpoint of a 3-rank run resumed on one process was honoured in silence: its
    step 2 trained 3 pairs, not 4, and a step 3 followed, on a 3-step learning-rate schedule. The epoch is cut from the
    pairs the checkpoint's run kept (its record's `pairs_trained`), not the rows. The record is the one a 3-rank launch
    writes; test_a_resume_on_other_ranks_is_judged_on_the_pairs_training_keeps launches the run and its resume."""
    from types import SimpleNamespace

    from dpotrain import resolve
    from dpotrain.recipe.errors import ConfigError

    checkpoint = tmp_path / "run" / "checkpoint-1"
    checkpoint.mkdir(parents=True)
    batching = {"pairs_trained": {"of": kept}} if kept is not None else {}
    derived = {"data_parallel_size": 3, "batching": batching}
    (checkpoint / "resolved_config.json").write_text(json.dumps({"derived": derived}))
    training = SimpleNamespace(max_steps=max_steps, num_train_epochs=1.0)
    if refused is None:
        resolve.check_resumed_ranks(str(checkpoint), training, 3, ranks, rows)
        return
    with pytest.raises(ConfigError) as error:
        resolve.check_resumed_ranks(str(checkpoint), training, 3, ranks, rows)
    assert str(error.value) == (
        f"checkpoint {str(checkpoint)!r} was trained on 3 data-parallel processes, {refused}, and on 1 they make 3 (a "
        "last step of fewer pairs than processes joins the one before it): the steps past it would train other "
        f"pairs, on another learning-rate schedule; resume it on 3 processes, or start a new run from a copy of its "
        f"weights (cp -r {checkpoint} <new folder>, then --model_name_or_path <new folder> and a new --output_dir)"
    )


@pytest.mark.slow
@pytest.mark.parametrize("config", [None, ROOT / "configs" / "accelerate" / "fsdp2.yaml"], ids=["ddp", "fsdp2"])
def test_a_run_resumed_in_its_second_epoch_on_3_ranks_trains_that_epochs_steps(config, tmp_path, tiny_model_dir):
    """13 pairs of 4 a step on 3 ranks: epochs of 3 steps. Resumed from step 4 (one step into epoch 1), the run
    trained epoch 0's steps 2 and 3 again: accelerate's skip_first_batches wraps the BatchSamplerShard of a launch of
    several processes, which passes no set_epoch on to the step sampler (one process has no such wrapper). The losses
    and weights now equal the uninterrupted run's, under DDP and under FSDP2 (its sharded checkpoint)."""
    from safetensors.torch import load_file

    from dpotrain.data import builtin

    data = tmp_path / "pairs.jsonl"
    datasets.Dataset.from_list(builtin.make_preference_rows(13, seed=13)).to_json(data)
    args = ["--pairs_per_step", "4", "--max_steps", "6", "--save_steps", "2", "--max_length", "512"]
    args += ["--logging_steps", "1", "--save_total_limit", "5"]
    whole = launch(tmp_path, 3, tiny_model_dir, data, *args, out="whole", config=config)
    assert whole.returncode == 0, whole.stdout[-3000:]
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoint-6")
    (tmp_path / "resumed" / "run_complete.json").unlink()
    resumed = launch(tmp_path, 3, tiny_model_dir, data, *args, out="resumed", config=config)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"Resuming from {tmp_path}/resumed/checkpoint-4" in resumed.stdout

    def losses(out) -> dict:
        return {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / out / "metrics.jsonl").open()) if "loss" in r}

    assert list(losses("whole")) == [1, 2, 3, 4, 5, 6]
    assert losses("resumed") == pytest.approx(losses("whole"), abs=1e-6)
    a, b = (load_file(str(tmp_path / out / "model.safetensors")) for out in ("whole", "resumed"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("rows,long_prompts", [(9, 2), (7, 1)])
def test_a_resume_on_other_ranks_is_judged_on_the_pairs_training_keeps(rows, long_prompts, tmp_path, tiny_model_dir):
    """keep_start drops a pair whose prompt alone fills max_length, so the epoch is cut from the pairs kept, not the
    rows. 9 rows, 2 dropped: 7 pairs of 3 a step are 2 steps on 3 ranks and 3 on one, and the resume on one process
    was honoured in silence (9 rows make 3 steps either way). 7 rows, 1 dropped: 6 pairs are 2 steps on any number of
    ranks, and the resume was refused (7 rows make 2 steps on 3 ranks, 3 on one). The launched path of
    `resolve.check_resumed_ranks`, whose cases test_a_checkpoint_resumed_on_ranks_that_cut_its_epoch_... holds."""
    from dpotrain.data import builtin

    pairs = builtin.make_preference_rows(rows, seed=13)
    for row in pairs[:long_prompts]:  # a prompt past max_length 512: TRL drops the pair
        for side in ("chosen", "rejected"):
            row[side][-2]["content"] += " word" * 600
    data = tmp_path / "pairs.jsonl"
    datasets.Dataset.from_list(pairs).to_json(data)
    args = ["--pairs_per_step", "3", "--save_steps", "1", "--max_length", "512"]
    trained = launch(tmp_path, 3, tiny_model_dir, data, *args)
    assert trained.returncode == 0, trained.stdout[-3000:]
    # The libraries' bars are the main process's alone (every rank loads the model and maps the data: 3 of each)
    for bar in ("Loading weights", "Labeling every assistant turn"):
        assert trained.stdout.count(f"{bar}: 100%") == 1, trained.stdout[-3000:]
    checkpoint = tmp_path / "run" / "checkpoint-1"
    resumed = launch(tmp_path, 1, tiny_model_dir, data, *args, "--resume_from_checkpoint", str(checkpoint), out="one")
    errors = [line for line in resumed.stdout.splitlines() if line.startswith("error:")]
    if rows - long_prompts == 7:
        assert resumed.returncode == 2, resumed.stdout[-3000:]
        assert errors == [
            f"error: checkpoint {str(checkpoint)!r} was trained on 3 data-parallel processes, where the 7 pairs it "
            "trains (of 9 rows: 2 dropped at max_length) make 2 steps an epoch, and on 1 they make 3 (a last step of "
            "fewer pairs than processes joins the one before it): the steps past it would train other pairs, on "
            "another learning-rate schedule; resume it on 3 processes, or start a new run from a copy of its weights "
            f"(cp -r {checkpoint} <new folder>, then --model_name_or_path <new folder> and a new --output_dir)"
        ], resumed.stdout[-3000:]
        assert "reference log-probs" not in resumed.stdout  # refused with the data, before the reference stage
    else:
        assert resumed.returncode == 0 and not errors, resumed.stdout[-3000:]
        assert json.loads((tmp_path / "one" / "run_complete.json").read_text())["global_step"] == 2


@pytest.mark.slow
def test_sigterm_to_one_rank_in_the_reference_stage_stops_every_rank_and_the_rerun_finishes(tmp_path, tiny_model_dir):
    """Slurm signals every process of a job, but a node's own preemption or an `scancel --signal` of one task signals
    one rank: rank 1 alone, stopped by itself after its first part of the reference stage is saved, is sent SIGTERM.
    Every rank stops at the stage's next stop check (its request reaches the others in that collective), saves its
    scored pairs and exits 75; the rerun reuses them and trains to the end."""
    from dpotrain.data import builtin
    from dpotrain.train.preemption import STOPPED_EXIT

    data = tmp_path / "pairs.jsonl"
    datasets.Dataset.from_list(builtin.make_preference_rows(72, seed=11)).to_json(data)
    config = ddp_config(tmp_path, 3)
    cache, paused = tmp_path / "cache", tmp_path / "paused"
    args = ["--dataset_name", str(data), "--output_dir", str(tmp_path / "run"), "--report_to", "none"]
    # 2 steps of 36 pairs: the reference stage scores the 72 pairs they train (24 a rank), parts of a few pairs each
    args += ["--max_steps", "2", "--pairs_per_step", "36", "--save_strategy", "no", "--max_length", "512"]
    args += ["--max_tokens_per_microbatch", "1024", "--reference_save_seconds", "0"]
    venv_accelerate = [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch"]  # signals: not warm
    launcher = [*venv_accelerate, "--config_file", str(config), "--num_processes", "3", *rank_python()]
    env = launch_env(cache, DPOTRAIN_STOP_FILE=str(tmp_path / "stop"))
    stopped = smoke_command([*launcher, str(PAUSE_AT)], tiny_model_dir, *args)
    stopped.pop(len(launcher) + 1)  # pause_at.py runs train_dpo.py itself
    env_paused = {**env, **pause_env(f"{cache}/reference/*/part-*-r1.npz", "*", paused)}
    proc = subprocess.Popen(
        stopped, cwd=ROOT, env=env_paused, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    log = signal_paused(paused, proc, signal.SIGTERM)
    # Each rank exits 75 (no rank left waiting in a collective: the launch ended within the timeout); accelerate launch
    # (torch's elastic agent) then exits 1 naming each rank's code. Once one rank has exited, the agent sends SIGTERM
    # to those still ending (-15: the marker is written before any rank returns, `collectives.main_outcome`), and
    # scripts/launch.sh requeues on that marker, not on the launcher's code.
    codes = re.findall(r"exitcode  : (-?\d+) ", log)
    assert proc.returncode == 1 and len(codes) == 3 and set(codes) <= {str(STOPPED_EXIT), "-15"}, log[-3000:]
    assert str(STOPPED_EXIT) in codes, log[-3000:]
    assert "pairs saved in" in (tmp_path / "stop.checkpointed").read_text()
    stops = [line for line in log.splitlines() if line.startswith("reference log-probs (train): stopped with")]
    assert len(stops) == 1, log[-3000:]
    assert not (tmp_path / "run" / "model.safetensors").exists()
    rerun = subprocess.run(
        smoke_command([*accelerate_launch(), *launcher[2:]], tiny_model_dir, *args),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert "reused from an interrupted run" in rerun.stdout, rerun.stdout[-3000:]
    assert (tmp_path / "run" / "model.safetensors").exists()


@pytest.mark.slow
def test_another_runs_last_checkpoint_is_counted_on_the_pairs_training_keeps(tmp_path, tiny_model_dir):
    """12 rows, 3 dropped at max_length: the 9 pairs kept make 3 steps of 3. Its last checkpoint resumed into a new
    folder was let through, the run's end counted on the 12 rows (step 4), and the run trained nothing: a "finished"
    run with no metrics. Refused now, as it is where no pair is dropped. Resumed on 2 ranks, each reads the record and
    counts its own copy of the data inside one gather (`resolve.check_epochs_left`): the line once, not once a rank."""
    from dpotrain.data import builtin

    pairs = builtin.make_preference_rows(12, seed=13)
    for row in pairs[:3]:  # a prompt past max_length 512: TRL drops the pair
        for side in ("chosen", "rejected"):
            row[side][-2]["content"] += " word" * 600
    data = tmp_path / "pairs.jsonl"
    datasets.Dataset.from_list(pairs).to_json(data)
    args = ["--pairs_per_step", "3", "--save_steps", "1", "--max_length", "512", "--warmup_steps", "0"]
    trained = launch(tmp_path, 1, tiny_model_dir, data, *args)
    assert trained.returncode == 0, trained.stdout[-3000:]
    checkpoint = tmp_path / "run" / "checkpoint-3"
    resumed = launch(tmp_path, 2, tiny_model_dir, data, *args, "--resume_from_checkpoint", str(checkpoint), out="new")
    errors = [line for line in resumed.stdout.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: resume_from_checkpoint {str(checkpoint)!r} was saved at step 3, and the run ends at step 3 (max_steps "
        "or num_train_epochs, which a resume keeps as its checkpoint was trained): it would train nothing; to train "
        f"on, start a new run from a copy of its weights (cp -r {checkpoint} <new folder>, then --model_name_or_path "
        "<new folder> and a new --output_dir)"
    ], resumed.stdout[-3000:]
    codes = re.findall(r"^\s*exitcode\s*: (-?\d+)", resumed.stdout, re.MULTILINE)  # the launcher's summary
    assert resumed.returncode != 0 and codes == ["2", "2"], resumed.stdout[-3000:]  # each rank ended on the refusal


@pytest.mark.slow
def test_a_reference_cache_of_3_ranks_is_reused_for_the_pairs_appended_data_shares(tmp_path, tiny_model_dir):
    """13 pairs scored by 3 ranks (each rank its own part, merged), then 5 pairs appended: the next run on 3 ranks
    scores the 5 alone and takes the 13 from the first run's cache, each pair's by its digest. Its weights equal a run
    that scored all 18 afresh, to fp32 rounding of other micro-batch layouts (measured: 7.5e-9)."""
    from safetensors.torch import load_file

    from dpotrain.data import builtin

    rows = builtin.make_preference_rows(18, seed=13)
    first, appended = tmp_path / "first.jsonl", tmp_path / "appended.jsonl"
    datasets.Dataset.from_list(rows[:13]).to_json(first)
    datasets.Dataset.from_list(rows).to_json(appended)
    args = ["--pairs_per_step", "4", "--max_length", "512", "--save_strategy", "no"]
    scored = launch(tmp_path, 3, tiny_model_dir, first, *args, out="first")
    assert scored.returncode == 0 and "13 scored, cached in" in scored.stdout, scored.stdout[-3000:]
    reused = launch(tmp_path, 3, tiny_model_dir, appended, *args, out="appended")
    assert reused.returncode == 0, reused.stdout[-3000:]
    assert "13 reused from other runs' caches (the same pairs, model and settings), 5 scored" in reused.stdout
    (tmp_path / "cache").rename(tmp_path / "first-cache")
    fresh = launch(tmp_path, 3, tiny_model_dir, appended, *args, out="fresh")
    assert fresh.returncode == 0 and "18 scored, cached in" in fresh.stdout, fresh.stdout[-3000:]
    a, b = (load_file(str(tmp_path / out / "model.safetensors")) for out in ("appended", "fresh"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


@pytest.mark.slow
def test_a_refusal_on_another_rank_starts_its_own_line(tmp_path, tiny_model_dir):
    """A launch's other processes write their error line after a line break: the log they share with the main process
    may hold its open progress bar, whose line ends only as it closes. Ranks 0 and 1 of 2, as a launch starts them
    but with no rendezvous address: both refused as their process group starts; rank 1's line after a blank one,
    where rank 1 is the first process of its node (LOCAL_RANK 0: another node's log may be its own). A refusal of
    the command, raised before the ranks first meet, is the same on every rank: the node's other processes end with
    its code and no line (the log held it once per process)."""
    said = {}
    for rank, local in ((0, 0), (1, 0), (1, 1)):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        env.pop("MASTER_ADDR", None)
        cmd = smoke_command([python()], tiny_model_dir, "--output_dir", str(tmp_path / "run"))
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 2, result.stderr[-3000:]
        error = re.search(r"(^|\n)(\n?)error: [^\n]*\n$", result.stderr)
        said[rank, local] = "no line" if error is None else "after a blank line" if error[2] else "its own line"
        assert error or "error" not in result.stderr, result.stderr[-3000:]
    assert said == {(0, 0): "its own line", (1, 0): "after a blank line", (1, 1): "no line"}
