"""The health guards on the tiny model: each failure of the post-mortems built for real; a healthy run left alone."""

import json
import math
import os
import re
import shutil
import subprocess
from types import SimpleNamespace

import pytest

from conftest import ROOT, built, python, ready
from dpotrain.data import data
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError
from dpotrain.resolve import OutputDecision, check_output_dir, decide_batch, resolved_config
from dpotrain.train import dropout, health
from dpotrain.train.health import LN2, HealthGuard
from dpotrain.train.losses import check_options, step1_loss

SMOKE = str(ROOT / "configs" / "smoke.yaml")


def trainer_for(out, model_dir, *overrides, rows=None, eval_dataset=None):
    recipe = parse_args(
        [
            "--config",
            SMOKE,
            "--model_name_or_path",
            model_dir,
            "--output_dir",
            str(out),
            "--report_to",
            "none",
            "--save_strategy",
            "no",
            *overrides,
        ]
    )
    dataset = data.load_preference_dataset(str(ROOT / recipe.script.dataset_name))
    return ready(built(recipe, dataset.select(range(rows)) if rows else dataset, eval_dataset))


@pytest.mark.slow
def test_a_wrong_reference_stops_at_step_1_with_a_complete_checkpoint(tmp_path, tiny_model_dir):
    # 000's failure: reference log-probs that are not the policy's. Shift the precomputed cache of the chosen side.
    out = tmp_path / "run"
    # The run's record, as train_dpo.py writes it before training: each checkpoint carries a copy, which a resume
    # compares with (a checkpoint without one is refused).
    args = ["--config", SMOKE, "--model_name_or_path", tiny_model_dir, "--output_dir", str(out), "--max_steps", "3"]
    out.mkdir(parents=True)
    (out / "resolved_config.json").write_text(json.dumps(resolved_config(parse_args(args), {"pairs_per_step": 8})))
    trainer = trainer_for(
        out, tiny_model_dir, "--max_steps", "3", "--logging_steps", "2", "--precompute_ref_log_probs", "true", rows=48
    )
    shifted = [x + 30.0 for x in trainer.train_dataset["ref_chosen_logps"]]
    trainer.use_reference(
        "train", trainer.train_dataset.remove_columns("ref_chosen_logps").add_column("ref_chosen_logps", shifted)
    )
    trainer.train()
    stop = trainer.health.stop
    assert stop is not None and stop.guard == "step1" and stop.step == 1, trainer.health.alarms
    assert "expected ln 2" in stop.message and "reference" in stop.message
    assert trainer.state.global_step == 1  # logging_steps is 2: the guard logs step 1 itself
    assert (out / "checkpoint-1" / "COMPLETE").is_file()  # resumable, finite state

    # The stop is remembered. The same command, which resumed and trained to the end on the values it stopped on, is
    # refused with the fix; the command the stop suggests (--overwrite_output_dir) starts afresh instead of resuming;
    # health_action: warn goes on from the checkpoint, as asked.
    def plan(*extra):
        return check_output_dir(parse_args([*args, *extra]), 8)

    with pytest.raises(ConfigError, match=r"the step1 guard stopped it at step 1, and resuming would train on the "):
        plan()
    assert plan("--overwrite_output_dir") == OutputDecision(None, True)
    assert plan("--health_action", "warn") == OutputDecision(str(out / "checkpoint-1"), False)


# An untouched reference passes step 1 (ln 2, no alarm): tests/test_training.py's first test, in this process, and
# the demo's run (test_cpu_demo_writes_a_complete_run: logging_steps 2, step 1 logged by the guard, no health line).


@pytest.mark.slow
def test_a_stop_under_save_strategy_best_at_no_new_best_writes_the_checkpoint_its_line_names(
    tmp_path, tiny_model_dir, monkeypatch
):
    """001's collapse: 30x the demo's learning rate drives the loss to ~0 within a few steps (measured: 0.004 at step
    6), and a guard stops it with a checkpoint that is no requeue request. Under save_strategy best transformers saves
    at an evaluation only at a new best, over the save the guard asked for: a stop at an evaluation that was no new best
    wrote no checkpoint, and its stop line named one as resumable. (The guard's save under save_strategy no, the
    default here: test_a_wrong_reference_stops_at_step_1_with_a_complete_checkpoint.)"""
    out, stop_file = tmp_path / "run", tmp_path / "stop"
    monkeypatch.setenv("DPOTRAIN_STOP_FILE", str(stop_file))  # as under launch.sh
    held = tmp_path / "held.jsonl"
    held.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[80:88]))
    # The collapsing learning rate below; the held-out loss falls as the loss does, so with a higher loss counted as
    # better every evaluation after the first is no new best.
    best = ["--save_strategy", "best", "--metric_for_best_model", "eval_loss", "--greater_is_better", "true"]
    evaluated = ["--eval_strategy", "steps", "--eval_steps", "1", "--dataset_mixer_eval_list", str(held), "1.0"]
    lr = ["--max_steps", "10", "--logging_steps", "1", "--warmup_steps", "0", "--learning_rate", "3e-3"]
    trainer = trainer_for(
        out, tiny_model_dir, *lr, *evaluated, *best, rows=80, eval_dataset=data.load_preference_dataset(str(held))
    )
    trainer.train()
    stop = trainer.health.stop
    assert stop is not None and stop.guard in {"loss_floor", "margin"}, trainer.health.alarms
    assert 1 < trainer.state.global_step == stop.step < 10 and not stop.fatal
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert stop.guard != "loss_floor" or losses[-1] < 0.01
    assert trainer.state.best_global_step == 1  # the stop's evaluation was no new best
    assert f"checkpoint {out}/checkpoint-{stop.step} is complete and resumable" in health.stop_line(stop, str(out))
    assert (out / f"checkpoint-{stop.step}" / "COMPLETE").is_file()
    assert not stop_file.with_name("stop.checkpointed").exists()  # the checkpoint is not a requeue request


@pytest.mark.slow
def test_warn_mode_reports_and_goes_on(tmp_path, tiny_model_dir):
    # rows: the 24 pairs 3 steps of 8 use, so that the reference stage scores no more than that.
    trainer = trainer_for(
        tmp_path / "run",
        tiny_model_dir,
        "--max_steps",
        "3",
        "--logging_steps",
        "1",
        "--warmup_steps",
        "0",
        "--health_action",
        "warn",
        "--health_loss_floor",
        "0.69",
        rows=24,
    )
    trainer.train()
    assert trainer.health.stop is None and trainer.state.global_step == 3
    assert [a.guard for a in trainer.health.alarms] == ["loss_floor", "loss_floor"]  # steps 2 and 3, not step 1


@pytest.mark.slow
def test_nan_stops_the_cli_run_without_checkpoint_requeue_or_completion_and_ends_wandb_failed_first(
    tmp_path, tiny_model_dir
):
    """A learning rate of 1e30 turns the weights to inf/NaN at the first update: step 2 scores NaN. The same run (W&B
    offline) carries the W&B proof: W&B ended a health-stopped run (exit 3) as finished with exit code 0 at exit,
    printing its closing lines after the stop line; it is ended with exit code 3 first, and the stop line is the run's
    last. Its training curves are drawn (none were)."""
    out, stop_file = tmp_path / "run", tmp_path / "stop"
    args = [python(), str(ROOT / "train_dpo.py"), "--config", SMOKE, "--model_name_or_path", tiny_model_dir]
    args += ["--output_dir", str(out), "--max_steps", "6", "--logging_steps", "1", "--warmup_steps", "0"]
    args += ["--learning_rate", "1e30", "--save_steps", "1000", "--report_to", "wandb"]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "false"}
    env["DPOTRAIN_STOP_FILE"] = str(stop_file)  # as under launch.sh
    result = subprocess.run(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    assert result.returncode == 3, result.stdout[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("health: training STOPPED at step 2 by the nonfinite guard"), result.stdout[-2000:]
    assert "not requeued" in lines[-1]
    assert "health STOP [nonfinite] step 2" in result.stdout
    assert any(line.startswith("wandb:") for line in lines[:-1]), result.stdout[-2000:]  # W&B's closing lines, before
    assert (out / "training_curves.png").stat().st_size > 0  # the curves a stopped run is read by
    assert not (out / "run_complete.json").exists() and not (out / "model.safetensors").exists()
    assert not list(out.glob("checkpoint-*"))  # nothing saved from a NaN state
    # The NaN step is in metrics.jsonl as strict JSON (null), not Python's NaN token that other JSON readers refuse.
    last_record = (out / "metrics.jsonl").read_text().splitlines()[-1]
    assert "NaN" not in last_record and json.loads(last_record)["grad_norm"] is None, last_record
    # The loss too: transformers' logging_nan_inf_filter logged it as the mean of the steps before (a finite loss).
    assert json.loads(last_record)["loss"] is None, last_record
    assert not stop_file.with_name("stop.checkpointed").exists()  # launch.sh requeues only on this file

    # The same command again: refused in seconds, before anything loads, rather than going on from checkpoint 0.
    again = subprocess.run(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    assert again.returncode == 2, again.stdout[-3000:]
    assert again.stdout.strip().splitlines()[-1] == (
        f"error: output_dir {str(out)!r}: the nonfinite guard stopped it at step 2, and the same command would fail "
        "the same way: fix the cause the stop named, then rerun with --overwrite_output_dir to start afresh"
    )


@pytest.fixture
def guard(tmp_path):
    """Makes a guard of the smoke recipe with `overrides`, each in a run folder of its own under the test's: the guard
    reads metrics.jsonl and writes health_stop.json there (a folder shared by every test carried one's files into the
    next)."""
    folders = iter(tmp_path / f"run-{n}" for n in range(1000))

    def make(*overrides):
        recipe = parse_args(["--config", SMOKE, "--output_dir", str(next(folders)), *overrides])
        return HealthGuard(recipe.project, decide_batch(recipe, 1).pairs_per_step), recipe.training

    return make


def test_guards_prefer_the_loss_scale_rewards_and_report_step_and_values(guard):
    g, args = guard()
    g._fresh, g._last_step = True, 0
    # rewards_norm/* (the lead's trainer): margins 6 > 5 trips `margin`, whatever the summed rewards say
    logs = {
        "loss": 0.3,
        "rewards/chosen": 0.0,
        "rewards/rejected": 0.0,
        "rewards/margins": 0.0,
        "rewards_norm/chosen": 1.0,
        "rewards_norm/rejected": -5.0,
        "rewards_norm/margins": 6.0,
        "rewards_norm/accuracies": 0.9,
    }
    alarms = g.check(7, logs, args, max_steps=100)
    assert [a.guard for a in alarms] == ["margin"] and alarms[0].step == 7
    assert "rewards_norm/margins 6 > health_max_margin 5.0" in alarms[0].message
    # both sides falling by > 1 nat/token (beta 5: rewards -6 = -1.2 nats/token)
    logs.update({"rewards_norm/chosen": -6.0, "rewards_norm/rejected": -7.0, "rewards_norm/margins": 1.0})
    assert [a.guard for a in g.check(8, logs, args, 100)] == ["logps_falling"]
    # non-finite values stop without a checkpoint
    nan = g.check(9, {**logs, "grad_norm": math.nan}, args, 100)
    assert [(a.guard, a.fatal) for a in nan] == [("nonfinite", True)] and "grad_norm=nan" in nan[0].message
    # step 1 of a fresh run: loss must be ln 2
    assert [a.guard for a in g.check(1, {"loss": 0.75}, args, 100)] == ["step1"]
    assert g.check(1, {"loss": LN2, "rewards_norm/chosen": 0.0, "rewards_norm/rejected": 0.0}, args, 100) == []
    # MoE: the logged loss holds the router term (OLMoE: 0.01 x aux ~ 0.02); the guards judge dpo_loss, without it
    moe = {"loss": LN2 + 0.025, "dpo_loss": LN2, "aux_loss": 2.5}
    assert g.check(1, moe, args, 100) == []
    assert "dpo_loss 0.75 (expected ln 2" in g.check(1, {**moe, "dpo_loss": 0.75}, args, 100)[0].message
    floor = g.check(5, {"loss": 0.02, "dpo_loss": 0.005}, args, 100)
    assert [a.guard for a in floor] == ["loss_floor"] and floor[0].message.startswith("dpo_loss 0.005 <")


def test_the_loss_floor_judges_only_losses_that_are_0_at_an_unbounded_margin(guard):
    """hinge, ipo, sppo_hard, exo_pair are 0 at a finite margin by design, robust below 0: the floor stopped a healthy
    hinge run of the CPU demo (beta 0.1) at step 14, at a loss-scale margin of 0.02, as "separating far beyond beta's
    KL term". The other guards still judge them; a floor given for them is refused as ignored."""
    low = {"loss": 0.004, "rewards_norm/chosen": 0.02, "rewards_norm/rejected": -0.01, "rewards_norm/margins": 0.03}
    for flags in (["hinge"], ["ipo"], ["sppo_hard"], ["exo_pair", "--label_smoothing", "0.5"], ["sigmoid", "robust"]):
        g, args = guard("--loss_type", *flags)
        assert g.check(14, low, args, 48) == [], flags
        assert [a.guard for a in g.check(14, {**low, "rewards_norm/margins": 6.0}, args, 48)] == ["margin"], flags
    for flags in (["sigmoid"], ["sigmoid_norm"], ["bco_pair"], ["apo_zero"]):
        g, args = guard("--loss_type", *flags)
        assert [a.guard for a in g.check(14, low, args, 48)] == ["loss_floor"], flags
    with pytest.raises(ConfigError, match="health_loss_floor 0.05 would be ignored: loss_type hinge is 0 at a finite"):
        check_options(parse_args(["--config", SMOKE, "--loss_type", "hinge", "--health_loss_floor", "0.05"]))
    check_options(parse_args(["--config", SMOKE, "--loss_type", "hinge", "--health_loss_floor", "0"]))  # off: fine


@pytest.mark.parametrize("floor, types", [("1", ["sigmoid_norm"]), ("0.6932", ["sigmoid"]), ("1.5", ["bco_pair"])])
def test_a_loss_floor_at_or_above_the_starting_loss_is_refused(floor, types, guard):
    """The loss starts at its value at log-ratios 0 (ln 2 for sigmoid_norm) and the guard stops a run whose loss is
    below the floor: `--health_loss_floor 1` stopped every run at its first logged step as a collapse (exit 3)."""
    args = parse_args(["--config", SMOKE, "--loss_type", *types, "--health_loss_floor", floor])
    g, _ = guard("--loss_type", *types, "--health_loss_floor", floor)
    assert [a.guard for a in g.check(2, {"loss": step1_loss(args.training)}, args.training, 48)] == ["loss_floor"]
    with pytest.raises(ConfigError) as refused:
        check_options(args)
    start = step1_loss(args.training)
    assert str(refused.value) == (
        f"health_loss_floor {float(floor):g} is not below the loss before any update ({start:.4g}: {types[0]} at "
        "log-ratios 0), so the guard would stop the run at its first logged step as a collapse: give a floor near 0 "
        "(default 0.01), or 0 to turn the guard off"
    )
    check_options(parse_args(["--config", SMOKE, "--loss_type", *types, "--health_loss_floor", "0.5"]))  # below: fine


def test_accuracy_pinned_counts_consecutive_pairs_early_only(guard):
    g, args = guard("--health_pinned_pairs", "32")  # smoke: 8 pairs per step
    state = SimpleNamespace(global_step=0, max_steps=40, is_world_process_zero=True)
    control = SimpleNamespace(should_training_stop=False, should_save=False)
    g.on_train_begin(args, state, control)
    tripped = []
    for step in range(1, 9):
        state.global_step = step
        g.on_log(args, state, control, logs={"loss": 0.5 if step > 1 else LN2, "rewards/accuracies": 1.0})
        tripped += [a.step for a in g.alarms if a.guard == "accuracy_pinned"][len(tripped) :]
        if control.should_training_stop:
            break
    assert tripped == [4] and g.stop.guard == "accuracy_pinned"  # 4 steps x 8 pairs = 32, step 4 <= 25% of 40
    assert "1.0 on the last 32 pairs" in g.stop.message


def test_a_run_whose_every_fp16_step_the_loss_scaler_skipped_stops_having_trained_nothing(guard, capsys):
    """fp16 (a CUDA GPU's: none here, so the accelerator's answer is given): a run whose every optimizer step fp16's
    loss scaler skipped (gradients overflowing each time) saved the weights it started from as its model and exited 0.
    Stopped without a checkpoint, the run's last step if shorter, else at 40 skips in a row (the scaler, from 2^16
    halved at each, is then at 2^-24: no longer its warm-up); one step taken and it goes on, as in bf16."""
    for max_steps, skipped, stopped_at in ((10, "all", 10), (100, "all", 40), (100, "but step 3", None)):
        g, args = guard("--fp16", "true")
        accelerator = SimpleNamespace(optimizer_step_was_skipped=True)
        g.watch(accelerator)
        state = SimpleNamespace(global_step=0, max_steps=max_steps, is_world_process_zero=True, stateful_callbacks={})
        control = SimpleNamespace(should_training_stop=False, should_save=True, should_log=False)
        g.on_train_begin(args, state, control)
        for state.global_step in range(1, max_steps + 1):
            accelerator.optimizer_step_was_skipped = skipped == "all" or state.global_step != 3
            g.on_optimizer_step(args, state, control)
            g.on_step_end(args, state, control)
            if control.should_training_stop:
                break
        if stopped_at is None:
            assert g.stop is None and not control.should_training_stop
            continue
        assert state.global_step == stopped_at and g.stop.guard == "fp16_skipped" and g.stop.fatal
        assert control.should_training_stop and not control.should_save
        assert f"skipped every one of the run's {stopped_at} optimizer steps" in capsys.readouterr().err
        assert health.stop_line(g.stop, "out").startswith(
            f"health: training STOPPED at step {stopped_at} by the fp16_skipped guard; no checkpoint written: nothing "
            "was trained."
        )
    g, args = guard()  # fp32 (or bf16): no scaler, nothing counted
    g.watch(SimpleNamespace(optimizer_step_was_skipped=True))
    state = SimpleNamespace(global_step=1, max_steps=1, is_world_process_zero=True, stateful_callbacks={})
    g.on_optimizer_step(args, state, control)
    g.on_step_end(args, state, control)
    assert g.stop is None and state.stateful_callbacks == {}


@pytest.mark.parametrize(
    "kept, start, max_steps, stopped_at",
    [
        ({"taken": 8, "skipped": 5}, 8, 10, None),  # the run trained before the checkpoint: its last 2 steps skipping
        (None, 8, 10, None),  # a checkpoint written before the count was kept: its 8 steps count as trained
        (
            {"taken": 8, "skipped": 8},
            8,
            10,
            10,
        ),  # every step skipped, before the checkpoint and after: at the run's end
        ({"taken": 30, "skipped": 30}, 30, 100, 40),  # 40 skips in a row over two starts (this start's alone: step 70)
    ],
)
def test_fp16_skipped_counts_the_runs_steps_across_a_resume(guard, kept, start, max_steps, stopped_at):
    """The fp16_skipped guard counted this start's steps alone: a resume whose 2 remaining steps both skipped stopped
    as a run that trained nothing ("every one of this start's 2 optimizer steps"), its checkpoint's 3 trained steps
    aside, and the same command was refused. The run's count is kept in the checkpoint's trainer state and read back."""
    g, args = guard("--fp16", "true")
    g.watch(SimpleNamespace(optimizer_step_was_skipped=True))
    state = SimpleNamespace(global_step=start, max_steps=max_steps, is_world_process_zero=True, log_history=[])
    state.stateful_callbacks = {} if kept is None else {health.FP16_STEPS: kept}
    control = SimpleNamespace(should_training_stop=False, should_save=True, should_log=False)
    g.on_train_begin(args, state, control)
    for state.global_step in range(start + 1, max_steps + 1):
        g.on_optimizer_step(args, state, control)
        g.on_step_end(args, state, control)
        if control.should_training_stop:
            break
    stopped = (g.stop.guard, state.global_step) if g.stop else None
    assert stopped == (("fp16_skipped", stopped_at) if stopped_at else None)
    kept = kept or {"taken": start, "skipped": 0}
    this_start = state.global_step - start
    # what the next checkpoint's trainer_state.json keeps
    assert state.stateful_callbacks[health.FP16_STEPS] == {
        "taken": kept["taken"] + this_start,
        "skipped": kept["skipped"] + this_start,
    }


def test_accuracy_pinned_on_one_pair_reads_in_the_singular(tmp_path):
    """--health_pinned_pairs 1 at one pair per step: the alarm read "1.0 on the last 1 pairs"."""
    recipe = parse_args(["--config", SMOKE, "--output_dir", str(tmp_path), "--health_pinned_pairs", "1"])
    g, args = HealthGuard(recipe.project, 1), recipe.training
    state = SimpleNamespace(global_step=0, max_steps=40, is_world_process_zero=True)
    control = SimpleNamespace(should_training_stop=False, should_save=False)
    g.on_train_begin(args, state, control)
    for state.global_step, accuracy in ((1, 0.0), (2, 1.0)):  # step 2's one pair pins it
        g.on_log(args, state, control, logs={"loss": LN2, "rewards/accuracies": accuracy})
    assert g.stop.guard == "accuracy_pinned" and "1.0 on the last pair, within the first 25%" in g.stop.message


def test_step_1_expects_the_configured_loss_or_judges_only_the_rewards(guard):
    """The loss at log-ratios 0 of each configured loss (dpotrain/train/losses.py: `step1_loss`), never ln 2 where it
    is not;
    a loss that depends on the model (an SFT term, WPO's weights) is not judged, a wrong reference still is."""
    zero = {"rewards_norm/chosen": 0.0, "rewards_norm/rejected": 0.0}
    expected = {
        ("hinge",): 1.0,
        ("ipo", "--beta", "0.1"): 25.0,
        ("sppo_hard", "--beta", "0.5"): 2.0,
        ("bco_pair",): 2 * LN2,
        ("discopop",): (LN2 + 1) / 2,
        ("apo_down",): 1.0,
        ("exo_pair", "--label_smoothing", "0.5"): 0.0,
        ("sigmoid", "bco_pair", "--loss_weights", "0.8", "0.2"): 0.8 * LN2 + 0.2 * 2 * LN2,
    }
    for flags, loss in expected.items():
        g, args = guard("--loss_type", *flags)
        g._fresh = True
        assert g.check(1, {"loss": loss, **zero}, args, 100) == [], flags
        assert [a.guard for a in g.check(1, {"loss": loss + 0.05, **zero}, args, 100)] == ["step1"], flags
    for flags in (["--use_weighting", "true"], ["--loss_type", "sigmoid", "bco_pair", "sft"]):
        g, args = guard(*flags)
        g._fresh = True
        assert g.check(1, {"loss": 7.3, **zero}, args, 100) == [], flags
        shifted = {"loss": 7.3, "rewards_norm/chosen": 0.5, "rewards_norm/rejected": 0.0}
        assert [a.guard for a in g.check(1, shifted, args, 100)] == ["step1"], flags


@pytest.mark.slow
def test_a_neftune_run_is_not_stopped_at_step_1(tmp_path, tiny_model_dir, guard):
    """NEFTune's noise reaches the policy's embeddings in training, not the reference's (scored before training, in eval
    mode): step 1's loss is not ln 2, and the step1 guard stopped every NEFTune run at step 1, blaming a stale reference
    cache. The noise is there (NEFTune honoured, padded), and the run goes on."""
    neftune = ["--neftune_noise_alpha", "5", "--padding_free", "false"]
    trainer = trainer_for(
        tmp_path / "run", tiny_model_dir, "--max_steps", "2", "--logging_steps", "1", *neftune, rows=16
    )
    trainer.train()
    assert trainer.health.stop is None and not trainer.health.alarms, trainer.health.alarms
    assert trainer.state.global_step == 2
    assert abs(trainer.state.log_history[0]["loss"] - LN2) > 1e-3  # the policy's embeddings were noised at step 1
    g, args = guard(*neftune)
    g._fresh = True
    assert g.check(1, {"loss": 0.63, "rewards_norm/chosen": 0.09, "rewards_norm/rejected": -0.05}, args, 100) == []


@pytest.mark.slow
def test_a_lora_runs_live_reference_gets_no_neftune_noise(tmp_path, tiny_model_dir):
    """LoRA with a live reference (precompute_ref_log_probs false): the reference is the policy with its adapter
    disabled, scored in training mode, so NEFTune's noise reached the reference too, which the reference stage (the
    default) never gives it: one recipe trained against two references. Each step's reference equals its noiseless
    score (the embeddings in eval mode, where transformers' NEFTune hook adds nothing)."""
    lora = ["--use_peft", "true", "--lora_target_modules", "q_proj", "v_proj", "--precompute_ref_log_probs", "false"]
    neftune = ["--neftune_noise_alpha", "5", "--padding_free", "false"]
    trainer = trainer_for(tmp_path / "run", tiny_model_dir, "--max_steps", "2", *lora, *neftune, rows=16)
    scored, embeddings = trainer.compute_ref_log_probs, trainer.model.get_input_embeddings()
    gaps = []

    def compared(model, inputs):
        got = scored(model, inputs)
        was, _ = embeddings.training, embeddings.eval()
        try:
            clean = scored(model, inputs)
        finally:
            embeddings.train(was)
        gaps.append(max((a - b).abs().max().item() for a, b in zip(got, clean, strict=True)))
        return got

    trainer.compute_ref_log_probs = compared
    trainer.train()
    assert len(gaps) >= 2 and max(gaps) < 1e-5, gaps  # every micro-batch of both steps
    assert abs(trainer.state.log_history[0]["loss"] - LN2) > 1e-3  # the policy's embeddings are still noised


@pytest.mark.slow
def test_a_lora_runs_live_reference_gets_no_dropout(tmp_path, tiny_model_dir):
    """LoRA with a live reference (precompute_ref_log_probs false) on a model whose dropout is kept (--disable_dropout
    false, attention_dropout 0.3): the reference is the policy with its adapter disabled, scored in training mode, so
    dropout noised it, where the reference stage (the default) and a reference model score in eval mode: one recipe
    trained against two references. Each step's reference equals its score in eval mode."""
    model = tmp_path / "dropout-model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.3}))
    lora = ["--use_peft", "true", "--lora_target_modules", "q_proj", "v_proj", "--precompute_ref_log_probs", "false"]
    kept = ["--disable_dropout", "false", "--health_checks", "false"]
    trainer = trainer_for(tmp_path / "run", str(model), "--max_steps", "2", *lora, *kept, rows=16)
    scored, gaps = trainer.compute_ref_log_probs, []

    def compared(model, inputs):
        got = scored(model, inputs)
        was, _ = trainer.model.training, trainer.model.eval()
        try:
            clean = scored(model, inputs)
        finally:
            trainer.model.train(was)
        gaps.append(max((a - b).abs().max().item() for a, b in zip(got, clean, strict=True)))
        return got

    trainer.compute_ref_log_probs = compared
    trainer.train()
    assert len(gaps) >= 2 and max(gaps) < 1e-5, gaps  # every micro-batch of both steps


@pytest.mark.parametrize("beta", ["1e-200", "1e300"])
def test_the_starting_loss_of_a_beta_floats_cannot_square_is_unknown_not_a_traceback(beta):
    """ipo's starting loss is 1 / (4 beta^2), built for every loss type: a beta of 1e-200 (1e300) was a
    ZeroDivisionError (OverflowError) at step 1's check, after the model had loaded, and in the loss floor's check."""
    args = parse_args(["--config", SMOKE, "--beta", beta]).training
    assert step1_loss(args) == pytest.approx(LN2)  # sigmoid_norm's does not depend on beta
    ipo = parse_args(["--config", SMOKE, "--beta", beta, "--loss_type", "ipo"])
    assert step1_loss(ipo.training) is None
    check_options(parse_args(["--config", SMOKE, "--beta", beta]))


@pytest.mark.slow
def test_a_model_with_attention_dropout_is_not_stopped_at_step_1(tmp_path, tiny_model_dir, capfd):
    """A model whose config has attention_dropout 0.1 stopped at step 1 ("the reference log-probs disagree with the
    policy's ... a stale cache"), with or without --disable_dropout false: TRL's disable_dropout zeroes Dropout modules,
    not the rate the attention applies in training, so the policy was scored with dropout and the reference without.
    Now disable_dropout (the default) zeroes that rate too, and step 1 is ln 2 again; where dropout is kept on purpose
    the step1 guard says at the start that it is not judged, and the run goes on."""
    model = tmp_path / "dropout-model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    steps = ["--max_steps", "2", "--logging_steps", "1"]
    trainer = trainer_for(tmp_path / "off", str(model), *steps, rows=16)
    trainer.train()
    assert trainer.health.stop is None and not trainer.health.alarms, trainer.health.alarms
    assert abs(trainer.state.log_history[0]["loss"] - LN2) < 1e-4  # the policy is the reference at step 1
    kept = trainer_for(tmp_path / "kept", str(model), *steps, "--disable_dropout", "false", rows=16)
    kept.train()
    assert kept.health.stop is None and not kept.health.alarms, kept.health.alarms
    assert abs(kept.state.log_history[0]["loss"] - LN2) > 1e-3  # dropout is on: the noise the guard cannot judge
    assert "health: the step1 guard is not judged: dropout stays on in training (attention_dropout 0.1" in (
        capfd.readouterr().err
    )
    # judged on the dropout the trained model has: none left by disable_dropout (step 1 judged as before), or the rate
    assert dropout.active(trainer.model) == [] and kept.health._dropout == ["attention_dropout 0.1"]


def test_the_dry_run_says_step1_is_not_judged_where_dropout_is_kept():
    """--disable_dropout false: the dry run (the model not loaded) says the step1 guard skips a model with dropout."""
    from dpotrain import dry_run
    from dpotrain.recipe import run_record

    said = "step1 not judged if the model has dropout, kept on in training (disable_dropout false)"
    values = {"health_checks": True, "health_action": "stop", "health_step1_tolerance": 0.02, "samples_every": 0}
    assert said in dry_run.watching_text(run_record.of({**values, "disable_dropout": False}).settings)
    assert said not in dry_run.watching_text(run_record.of({**values, "disable_dropout": True}).settings)


def test_the_dry_run_says_intervals_the_run_never_reaches_watch_its_ends_alone():
    """logging_steps or samples_every not below the run's steps: the summary said "every 100 steps" of a 48-step run,
    whose guards judged step 1 and step 48 alone and whose samples were the base model's alone (step 0)."""
    from dpotrain import dry_run
    from dpotrain.recipe import run_record

    values = {"health_checks": True, "health_action": "stop", "logging_strategy": "steps", "samples_every": 100}
    rare = run_record.of({**values, "logging_steps": 100, "sample_count": 4}).settings
    said = dry_run.watching_text(rare, 48)
    assert "judging step 1 and step 48 alone (logging_steps 100 is not below the run's 48 steps" in said
    assert "samples from up to 4 prompts at step 0 alone, the base model's (samples_every 100" in said
    often = run_record.of({**values, "logging_steps": 1, "samples_every": 8, "sample_count": 4}).settings
    assert dry_run.watching_text(often, 48).endswith("(docs/health.md); samples from up to 4 prompts every 8 steps")
    assert "alone" not in dry_run.watching_text(rare, None)  # steps not counted: nothing claimed


@pytest.mark.parametrize(
    "strategy, delay, line",
    [
        (
            "steps",
            "5",
            "eval_delay 5 is past the run's last step (4): it would never evaluate; pass an eval_delay of 4",
        ),
        ("epoch", "2", "eval_delay 2 is past the run's last epoch (1, eval_strategy epoch): it would never evaluate"),
    ],
)
def test_an_eval_delay_past_the_runs_end_is_refused_before_the_model_loads(tmp_path, strategy, delay, line):
    """transformers evaluates only once eval_delay <= the step (or epoch): one past the run's end never evaluated, and
    the run exited 0 without the held-out evaluation asked for. Refused where the data set's steps are counted."""
    from dpotrain import stages

    held = tmp_path / "held.jsonl"
    held.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[80:88]))
    args = ["--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--eval_strategy", strategy]
    args += ["--dataset_mixer_eval_list", str(held), "1.0", "--eval_delay", delay]
    steps = {"total_steps": 4, "warmup_steps": 0, "pairs_per_step": 8}
    with pytest.raises(ConfigError, match=line.replace("(", r"\(").replace(")", r"\)")):
        stages.check_steps(steps, parse_args(args).training)
    ok = [*args[:-1], "1" if strategy == "epoch" else "4"]
    stages.check_steps(steps, parse_args(ok).training)  # at the run's end: it evaluates there


@pytest.mark.parametrize(
    "world, delay, refused", [(1, "1", True), (1, "0.5", True), (3, "0.5", False), (1, "0.461", False)]
)
def test_an_epoch_eval_delay_past_the_last_epoch_of_max_steps_is_refused(tmp_path, world, delay, refused):
    """Under max_steps the run ends at epoch max_steps / an epoch's steps, where transformers judges eval_delay last:
    checked against num_train_epochs alone, --max_steps 6 of a 13-step epoch with eval_delay 1 evaluated nothing and
    exited 0. 98 pairs of 8 a step make 13 steps on one rank, 12 on 3 (the last 2 pairs join the step before)."""
    from dpotrain import stages

    held = tmp_path / "held.jsonl"
    held.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[80:88]))
    args = ["--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--eval_strategy", "epoch", "--max_steps", "6"]
    args += ["--dataset_mixer_eval_list", str(held), "1.0", "--eval_delay", delay]
    steps = {"total_steps": 6, "warmup_steps": 1, "pairs_per_step": 8, "dataset_rows": 98}
    if not refused:
        stages.check_steps(steps, parse_args(args).training, world)
        return
    line = f"eval_delay {delay} is past the run's last epoch (0.462: max_steps 6 of 13 steps an epoch, eval_strategy "
    line += "epoch): it would never evaluate; pass an eval_delay of 0.461 or less, --max_steps "
    with pytest.raises(ConfigError, match=re.escape(line)):
        stages.check_steps(steps, parse_args(args).training, world)


def test_an_fp16_step_whose_gradients_overflowed_is_no_nan_state(guard):
    """fp16's loss scaler skips a step whose gradients overflowed (grad_norm inf or NaN) and lowers its scale, as an
    fp16 run's first steps do by design: the nonfinite guard stopped the run there, "the weights or the loss went NaN
    or inf ... Rerun with a lower --learning_rate and --overwrite_output_dir", with nothing wrong. Not fatal under
    fp16, where the grad norm alone is non-finite; a loss or reward that is, still is."""
    from dpotrain.train import health

    logs = {"loss": 0.65, "rewards_norm/chosen": 0.1, "rewards_norm/rejected": -0.1, "rewards_norm/margins": 0.2}
    g, args = guard("--fp16", "true")
    assert g.check(4, {**logs, "grad_norm": math.inf}, args, 100) == [] and g.overflowed == 4
    assert g.check(6, {**logs, "grad_norm": math.nan}, args, 100) == [] and g.overflowed == 6
    nan_loss = g.check(8, {**logs, "loss": math.nan, "grad_norm": math.nan}, args, 100)
    assert [(a.guard, a.fatal) for a in nan_loss] == [("nonfinite", True)]
    g, args = guard()  # fp32 (or bf16): no scaler skips a step, so an inf norm is the state's
    assert [(a.guard, a.fatal) for a in g.check(4, {**logs, "grad_norm": math.inf}, args, 100)] == [("nonfinite", True)]
    assert health.fp16_overflow(4, math.inf).startswith(
        "step 4: grad_norm inf under fp16: its gradients overflowed, so the loss scaler skipped that update"
    )


def test_a_nonfinite_stops_advice_is_what_a_rerun_takes(guard, tmp_path):
    """The NaN stop said 'resume from an earlier one with a lower --learning_rate' and 'earlier complete checkpoints
    still resume'; followed, the rerun was refused twice: a resume refuses another learning rate (RESUME_FIELDS), and
    the remembered stop refused the folder, saying 'resuming would train on the values it stopped on', of checkpoints
    earlier than the NaN. The advice is the way that works: a lower learning rate, afresh."""
    from dpotrain.train.resume import HEALTH_STOP, after_health_stop

    g, args = guard()
    nan = g.check(3, {"loss": math.nan}, args, 100)[0]
    assert "resume from an earlier one" not in nan.message
    assert nan.message.endswith("Rerun with a lower --learning_rate and --overwrite_output_dir to start afresh")
    nan.fatal = True
    assert "still resume" not in health.stop_line(nan, "out")
    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "COMPLETE").write_text("")  # an earlier checkpoint, complete
    (out / HEALTH_STOP).write_text(json.dumps({"guard": "nonfinite", "step": 3, "message": "", "fatal": True}))
    recipe = parse_args(["--config", SMOKE, "--output_dir", str(out), "--learning_rate", "1e-5"])
    with pytest.raises(ConfigError) as refused:
        after_health_stop(recipe, out)
    assert "the same command would fail the same way" in str(refused.value), refused.value
    assert "would train on the values it stopped on" not in str(refused.value)
