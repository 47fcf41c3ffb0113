"""Faults as they happen, on the tiny model: kills at each phase, damaged and missing checkpoint files, changed data
between attempts, Ctrl-C, a full disk. Each asserts that nothing was lost and that the continued run ends with the
uninterrupted run's weights, or is refused with one line naming the file.

One uninterrupted run (4 steps of 8 pairs, checkpoints at steps 2 and 4) is shared: most cases start from a copy of
its folder in the state a fault leaves, and rerun the same command."""

import contextlib
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from conftest import (
    PAUSE_AT,
    PYTHON,
    ROOT,
    Child,
    accelerate_launch,
    in_child,
    pause_env,
    pause_here,
    paused_pid,
    python,
    rank_python,
    start_child,
)
from dpotrain import stages
from dpotrain.cluster import run_lock
from dpotrain.hub import hub_push
from dpotrain.recipe import run_record
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError
from dpotrain.resolve import OutputDecision, check_output_dir
from dpotrain.train import checkpoint_manifest, metrics, resume, run_files, samples
from dpotrain.train.checkpoints import is_complete, own_checkpoints
from dpotrain.train.preemption import INTERRUPTED_EXIT, STOPPED_EXIT

STEPS = 4
ARGS = [
    "--config",
    str(ROOT / "configs" / "smoke.yaml"),
    "--max_steps",
    str(STEPS),
    "--save_steps",
    "2",
    "--logging_steps",
    "1",
    "--report_to",
    "none",
]
SLOW_CHECKPOINT = ROOT / "tests" / "helpers" / "slow_checkpoint.py"  # train_dpo.py on a slow file system
FINAL = ("model.safetensors", "run_complete.json", "README.md", "training_curves.png")  # written after training


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """The smoke data's first 48 pairs: an epoch of 6 steps, of which the run trains 4 (a run that ends mid-epoch, as
    a `max_steps` run does: transformers went on to a 5th step after a resume from the 4th)."""
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[:48]))
    return path


def command(out, model_dir, data, interpreter=None, script=ROOT / "train_dpo.py") -> list[str]:
    return [
        interpreter or python(),
        str(script),
        *ARGS,
        "--output_dir",
        str(out),
        "--model_name_or_path",
        model_dir,
        "--dataset_name",
        str(data),
    ]


def train(out, model_dir, data, *extra, prefix=(), interpreter=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*prefix, *command(out, model_dir, data, interpreter), *extra],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_model_dir, pairs):
    out = tmp_path_factory.mktemp("baseline") / "run"
    result = train(out, tiny_model_dir, pairs)
    assert result.returncode == 0, result.stdout[-3000:]
    return out


def weights(out):
    return load_file(str(out / "model.safetensors"))


def assert_same_weights(out, baseline):
    expected, got = weights(baseline), weights(out)
    assert all((got[k] - w).abs().max().item() < 1e-6 for k, w in expected.items())


def listing(folder: Path) -> dict[str, tuple[int, str]]:
    """Every file under `folder` by its path, size and content digest: a file added, changed or removed shows."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def logged_steps(out) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def unfinished(baseline, tmp_path, drop_checkpoint_4=False):
    """The baseline's folder as a run killed after its last checkpoint (before the final model) left it."""
    out = tmp_path / "run"
    shutil.copytree(baseline, out)
    for name in FINAL:
        (out / name).unlink()
    if drop_checkpoint_4:
        shutil.rmtree(out / "checkpoint-4")
    return out


@pytest.mark.slow
def test_a_run_killed_after_its_last_checkpoint_trains_no_step_past_max_steps(
    baseline, tmp_path, tiny_model_dir, pairs
):
    out = unfinished(baseline, tmp_path)
    # A learning rate "fixed" by hand in the record before the resume (re-indented by the editor): it was written over
    # in silence, the user believing the rest trained at it
    record = json.loads((out / "resolved_config.json").read_text())
    lr = record["learning_rate"]
    (out / "resolved_config.json").write_text(json.dumps(record | {"learning_rate": lr * 2}, indent=4))
    result = train(out, tiny_model_dir, pairs)
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"Resuming from {out}/checkpoint-4" in result.stdout
    edit = [line for line in result.stdout.splitlines() if "was edited after the run wrote it" in line]
    assert edit == [
        f"note: {out}/resolved_config.json was edited after the run wrote it (learning_rate: {lr!r} -> {lr * 2!r}): a "
        f"resume takes its settings from the recipe and command line, checked against {out}/checkpoint-4's own record, "
        "so the edit is not used and the file is written anew as training starts; to train with another value, pass "
        "it with a new --output_dir"
    ], result.stdout[-3000:]
    assert json.loads((out / "resolved_config.json").read_text())["learning_rate"] == lr
    assert logged_steps(out) == [1, 2, 3, 4] and not (out / "checkpoint-5").exists()  # it trained a 5th step
    assert json.loads((out / "run_complete.json").read_text())["global_step"] == STEPS
    assert_same_weights(out, baseline)


def test_a_record_is_told_edited_by_its_values_not_by_its_layout():
    record = run_record.sealed({"learning_rate": 1e-4, "output_dir": Path("run"), "derived": {"max_length": 64}})
    written = json.loads(json.dumps(record, indent=2, default=str))
    assert not run_record.edited(written) and not run_record.edited(json.loads(json.dumps(written, indent=8)))
    assert run_record.edited(written | {"learning_rate": 2e-4})
    assert run_record.edited(written | {"derived": {"max_length": 128}})
    assert not run_record.edited({"learning_rate": 1e-4})  # a record of a version before seals: not known


# Each file a checkpoint needs, damaged as a fault leaves it: deleted, cut short, or a byte changed in place.
DAMAGE = [
    ("model.safetensors", "cut"),
    ("optimizer.pt", "missing"),
    ("scheduler.pt", "flipped"),
    ("trainer_state.json", "missing"),
    ("rng_state.pth", "cut"),
]


def damage(path, how):
    if how == "missing":
        path.unlink()
    elif how == "cut":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize("name,how", DAMAGE)
def test_a_damaged_latest_checkpoint_is_skipped_for_the_one_before_naming_the_file(
    name, how, baseline, tmp_path, tiny_model_dir, pairs, capsys
):
    """What train_dpo.py runs to pick the resume point: sizes before anything loads, checksums once processes run."""
    out = unfinished(baseline, tmp_path)
    damage(out / "checkpoint-4" / name, how)
    recipe = parse_args(command(out, tiny_model_dir, pairs)[2:])
    chosen = resume.confirm(check_output_dir(recipe, 8).resume_from, explicit=False)
    assert chosen == str(out / "checkpoint-2")
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Not resuming"))
    why = {"missing": "is missing", "cut": "bytes", "flipped": "does not match its checksum"}[how]
    assert line.startswith(f"Not resuming from {out / 'checkpoint-4'}: {name} ") and why in line, line

    # With the one before it damaged too, nothing is left: refused, naming both files.
    damage(out / "checkpoint-2" / name, how)
    with pytest.raises(Exception) as refused:
        resume.confirm(check_output_dir(recipe, 8).resume_from, explicit=False)
    assert "no checkpoint left to resume from" in str(refused.value)
    assert f"checkpoint-4: {name}" in str(refused.value) and f"checkpoint-2: {name}" in str(refused.value)


@pytest.mark.slow
def test_a_fall_back_past_a_checkpoint_damaged_in_place_compares_the_one_before_with_the_runs_settings(
    baseline, tmp_path, tiny_model_dir, pairs
):
    """A byte of the newest checkpoint changed at its size is found once processes have started (`resume.confirm`),
    after the settings were compared with that checkpoint's record; the fall-back to the one before it was not
    compared. Another run's checkpoint-2 copied over the run's own (here: trained at another learning rate) was
    resumed from, trained steps 3-4 and exited 0 under a record and card of this run's settings. Now refused in one
    line, nothing trained."""
    from test_changed_inputs import resealed

    out = unfinished(baseline, tmp_path)
    resealed(out / "checkpoint-2", lambda record: record.update(learning_rate=5e-4))
    damage(out / "checkpoint-4" / "optimizer.pt", "flipped")
    result = train(out, tiny_model_dir, pairs)
    assert result.returncode == 2, result.stdout[-3000:]
    assert "Resuming from" not in result.stdout
    assert (
        f"error: output_dir '{out}': checkpoint-4: optimizer.pt does not match its checksum (damaged after it was "
        "written), and checkpoint-2, the checkpoint before it, was written by a run with other settings "
        "(learning_rate: 0.0005 -> 0.0001): not resumed from; restore checkpoint-4's file from a copy, or pass a new "
        "--output_dir"
    ) in result.stdout.splitlines(), result.stdout[-3000:]
    assert logged_steps(out) == [1, 2, 3, 4] and not (out / "model.safetensors").exists()

    # --overwrite_output_dir replaces a run of other settings: it was refused here in the same line, the flag unread
    result = train(out, tiny_model_dir, pairs, "--overwrite_output_dir")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "Resuming from" not in result.stdout
    assert (
        f"output_dir {out}: checkpoint-4: optimizer.pt does not match its checksum (damaged after it was written), and "
        "checkpoint-2, the checkpoint before it, was written by a run with other settings (learning_rate: 0.0005 -> "
        "0.0001): starting afresh, as --overwrite_output_dir asks"
    ) in result.stdout.splitlines(), result.stdout[-3000:]
    assert logged_steps(out) == [1, 2, 3, 4]
    assert_same_weights(out, baseline)


@pytest.mark.slow
def test_overwrite_output_dir_starts_afresh_where_every_checkpoint_fails_its_checksums(
    baseline, tmp_path, tiny_model_dir, pairs
):
    """Every checkpoint damaged in place (a byte changed at its size) is found once processes have started, after
    --overwrite_output_dir had chosen to resume the unfinished run of the same settings: the refusal said "pass
    --overwrite_output_dir to start afresh", and the same command with it was refused again in the same words, with
    no way left to start afresh in that folder. Now it starts afresh, as the flag asks, and trains the baseline."""
    out = unfinished(baseline, tmp_path)
    for step in (2, 4):
        damage(out / f"checkpoint-{step}" / "optimizer.pt", "flipped")
    refused = train(out, tiny_model_dir, pairs)
    assert refused.returncode != 0 and "pass --overwrite_output_dir to start afresh" in refused.stdout, refused.stdout
    result = train(out, tiny_model_dir, pairs, "--overwrite_output_dir")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "Resuming from" not in result.stdout
    assert (
        f"output_dir {out} has no checkpoint left to resume from (checkpoint-4: optimizer.pt does not match its "
        "checksum (damaged after it was written); checkpoint-2: optimizer.pt does not match its checksum (damaged "
        "after it was written)): starting afresh, as --overwrite_output_dir asks"
    ) in result.stdout.splitlines(), result.stdout[-3000:]
    assert logged_steps(out) == [1, 2, 3, 4]
    assert_same_weights(out, baseline)


@pytest.mark.slow
def test_the_built_in_model_by_its_name_resumes_a_run_started_on_its_folder(baseline, tmp_path, tiny_model_dir, pairs):
    """The baseline trained `builtin:tiny-olmo3` by the folder it is built in; its name on the rerun is that folder
    (its files are compared): it was refused as `model_name_or_path: '<folder>' -> 'builtin:tiny-olmo3'`."""
    out = unfinished(baseline, tmp_path)
    recipe = parse_args(command(out, "builtin:tiny-olmo3", pairs)[2:])
    assert check_output_dir(recipe, 8).resume_from == str(out / "checkpoint-4")


def test_the_built_in_model_by_its_name_and_by_its_folder_is_one_setting(tiny_model_dir, tmp_path):
    """Either way round (a run started as the smoke recipe names it, resumed by the folder the run printed): the same
    model; another folder, or another name, is not."""
    from dpotrain.resolve import _one_place

    assert _one_place("builtin:tiny-olmo3", tiny_model_dir) and _one_place(tiny_model_dir, "builtin:tiny-olmo3")
    assert _one_place("builtin:tiny-olmo3", tiny_model_dir + "/")
    assert not _one_place("builtin:tiny-olmo3", str(tmp_path)) and not _one_place(str(tmp_path), "builtin:tiny-olmo3")
    assert not _one_place("builtin:tiny-olmo3", "allenai/Olmo-3-7B")


TR_DPO = ("--sync_ref_model", "true", "--ref_model_sync_steps", "1", "--precompute_ref_log_probs", "false")


@pytest.mark.slow
def test_a_tr_dpo_run_resumes_against_its_moved_reference(tmp_path, tiny_model_dir, pairs):
    """TR-DPO's reference moves toward the policy; each checkpoint holds it (in its manifest) and a resume from
    checkpoint-2 goes on against it, ending with the uninterrupted run's weights (against the base model instead,
    steps 3-4 lost 0.578 for 0.646 at step 3). A stopped TR-DPO run exited 1 ("cannot go on"), its rerun refused."""
    whole = train(tmp_path / "whole", tiny_model_dir, pairs, *TR_DPO)
    assert whole.returncode == 0, whole.stdout[-3000:]
    out = unfinished(tmp_path / "whole", tmp_path, drop_checkpoint_4=True)
    assert resume.REFERENCE_FILE in checkpoint_manifest.read(out / "checkpoint-2")
    moved = load_file(str(out / "checkpoint-2" / resume.REFERENCE_FILE))
    base = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    assert max((moved[k] - base[k]).abs().max().item() for k in moved) > 1e-5  # synced at steps 1 and 2
    mode = {name: (out / "checkpoint-2" / name).stat().st_mode for name in ("model.safetensors", resume.REFERENCE_FILE)}
    assert len(set(mode.values())) == 1, mode  # as readable as the model (safetensors writes 0600)
    result = train(out, tiny_model_dir, pairs, *TR_DPO)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "Resuming from" in result.stdout and "checkpoint-2" in result.stdout, result.stdout[-3000:]
    assert_same_weights(out, tmp_path / "whole")
    stop_file = tmp_path / "stop"
    stop_file.touch()  # there before the run starts: it stops after step 1, saving checkpoint-1
    stopped = train(tmp_path / "stopped", tiny_model_dir, pairs, *TR_DPO, env={"DPOTRAIN_STOP_FILE": str(stop_file)})
    assert stopped.returncode == STOPPED_EXIT, stopped.stdout[-3000:]  # a requeue goes on


def test_a_tr_dpo_checkpoint_without_its_reference_is_refused(tmp_path):
    """A checkpoint that does not hold the moved reference (written by an older version: every engine's holds it now)
    would resume against the base model: refused, naming the fix; one that holds it resumes."""
    recipe = parse_args([*ARGS, *TR_DPO, "--output_dir", str(tmp_path / "run")])
    folder = tmp_path / "run" / "checkpoint-2"
    folder.mkdir(parents=True)
    with pytest.raises(ConfigError, match=f"does not hold it \\({resume.REFERENCE_FILE}\\).*new --output_dir"):
        resume.check_live_reference(str(folder), recipe)
    (folder / resume.REFERENCE_FILE).write_bytes(b"")
    resume.check_live_reference(str(folder), recipe)


def test_a_gathered_reference_names_a_tied_weight_as_the_whole_ones_file_does(tmp_path):
    """ZeRO-3 and FSDP2 write the gathered reference themselves (moved_reference.save): a tied weight (embeddings and
    LM head) once, under the name safetensors.torch.save_model keeps for one process, DDP and ZeRO-2, so a reference
    file reads the same whichever engine wrote it."""
    from safetensors.torch import save_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from dpotrain.train import moved_reference

    shape = dict(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True))
    groups = moved_reference.tied_names(model)
    assert ["lm_head.weight", "model.embed_tokens.weight"] in groups  # the tie, seen
    save_model(model, str(tmp_path / "whole.safetensors"))
    assert set(load_file(str(tmp_path / "whole.safetensors"))) == {group[0] for group in groups}


@pytest.mark.slow
def test_a_resume_counts_the_pairs_at_accuracy_1_before_its_checkpoint(tmp_path, tiny_model_dir):
    """The accuracy_pinned guard counts pairs at reward accuracy 1.0 in a row: the uninterrupted run stops at step 4
    (steps 3 and 4, 16 pairs). Resumed from checkpoint-3 it counted from 0, saw 8 pairs, and trained on to exit 0.
    The count comes from the checkpoint's trainer state, not metrics.jsonl: with the file's step-3 record edited
    between attempts (accuracy 0.5), a resume read the count broken at step 3, saw 8 pairs and trained on to exit 0.
    One resume for both: its metrics.jsonl edited, it stops at step 4 only where it counts from the trainer state."""
    data = ROOT / "data" / "smoke_prefs.jsonl"
    guard = ("--save_steps", "3", "--health_pinned_pairs", "16", "--health_early_fraction", "1.0")
    stop = "health STOP [accuracy_pinned] step 4: reward accuracy has been 1.0 on the last 16 pairs"
    out = tmp_path / "run"
    first = train(out, tiny_model_dir, data, *guard)
    assert first.returncode == 3 and stop in first.stdout, first.stdout[-3000:]
    shutil.rmtree(out / "checkpoint-4")  # as a kill after checkpoint-3 left it (its step 4 record kept)
    (out / resume.HEALTH_STOP).unlink()
    records = [json.loads(line) for line in (out / metrics.METRICS_FILE).read_text().splitlines()]
    for record in records:
        record.update({"rewards_norm/accuracies": 0.5} if record["step"] == 3 and "loss" in record else {})
    (out / metrics.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    edited = train(out, tiny_model_dir, data, *guard)
    assert edited.returncode == 3 and stop in edited.stdout, edited.stdout[-3000:]


@pytest.mark.slow
def test_a_resume_says_which_sampled_steps_samples_jsonl_lost(tmp_path, tiny_model_dir, pairs):
    """samples.jsonl cut between attempts (its rows are not in the checkpoint) lost step 2's samples without a word on
    resume. The checkpoint's trainer state names the steps sampled: the resume says which the file lacks."""
    sampling = ("--samples_every", "2", "--sample_count", "1", "--sample_max_new_tokens", "4")
    first = train(tmp_path / "run", tiny_model_dir, pairs, *sampling)
    assert first.returncode == 0, first.stdout[-3000:]
    out = unfinished(tmp_path / "run", tmp_path / "again", drop_checkpoint_4=True)
    path = out / samples.SAMPLES_FILE
    path.write_text("".join(line for line in path.read_text().splitlines(True) if json.loads(line)["step"] == 0))
    again = train(out, tiny_model_dir, pairs, *sampling)
    assert again.returncode == 0, again.stdout[-3000:]
    assert (
        f"warning: {path} lacks the samples of step 2, which the checkpoint resumed from says were generated (the "
        "file deleted or cut since): they are lost, the weights of those steps gone; the run samples on from here"
    ) in again.stdout, again.stdout[-3000:]
    assert sorted({json.loads(line)["step"] for line in path.read_text().splitlines()}) == [0, 4]


@pytest.mark.slow
def test_a_checkpoint_without_its_proof_is_skipped_for_the_verified_one_before_to_the_same_weights(
    baseline, tmp_path, tiny_model_dir, pairs
):
    """Issue #53: the newest checkpoint lost MANIFEST.json and optimizer.pt, and was resumed with a fresh optimizer and
    a restarted warm-up (weights 1.4e-4 off the uninterrupted run's). It cannot be verified: skipped, said in one
    line, for the checkpoint before it."""
    out = unfinished(baseline, tmp_path)
    (out / "checkpoint-4" / checkpoint_manifest.MANIFEST).unlink()
    (out / "checkpoint-4" / "optimizer.pt").unlink()
    result = train(out, tiny_model_dir, pairs)
    assert result.returncode == 0, result.stdout[-3000:]
    assert (
        f"Not resuming from {out / 'checkpoint-4'}: MANIFEST.json and optimizer.pt are missing; trying the checkpoint "
        "before it"
    ) in result.stdout, result.stdout[-3000:]
    assert f"Resuming from {out}/checkpoint-2" in result.stdout
    assert logged_steps(out) == [1, 2, 3, 4]
    assert_same_weights(out, baseline)
    assert checkpoint_manifest.problem(out / "checkpoint-4") is None  # written again, whole


def start(out, model_dir, data, env=None, script=ROOT / "train_dpo.py", prefix=(), extra=()):
    """The run, started warm (`python()`: its imports paid once). A test that kills it kills the process that holds
    the output folder's lock, as a node's SIGKILL does: the process paused at a point (`paused_pid`) or the lock's
    holder, the warm interpreter's child (a kill of `proc`, its client, leaves the child running a moment longer)."""
    return subprocess.Popen(
        [*prefix, *command(out, model_dir, data, script=script), *extra],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=default_sigint,
    )


def default_sigint():
    """SIGINT as a terminal's foreground job has it: a shell's background job, which the tests may run as, ignores it,
    and a run leaves an ignored SIGINT ignored (Ctrl-C would not reach it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_until(proc, done, timeout=300):
    deadline = time.time() + timeout
    while not done():
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.05)


@pytest.mark.slow
def test_a_kill_mid_training_then_changed_data_is_refused_and_restored_data_resumes_exactly(
    baseline, tmp_path, tiny_model_dir, pairs
):
    data = tmp_path / "pairs.jsonl"
    shutil.copy(pairs, data)
    out, paused = tmp_path / "run", tmp_path / "paused"
    # Killed past checkpoint-2 with step 3 logged, before step 4's record (the second open of metrics.jsonl after the
    # mark): polling for 3 logged steps could see the run past step 4, or ended, on a fast machine.
    env = pause_env("*/checkpoint-2/COMPLETE", "*/metrics.jsonl", paused, count=2)
    proc = start(out, tiny_model_dir, data, env=env, script=PAUSE_AT)
    os.kill(paused_pid(paused, proc), signal.SIGKILL)
    proc.wait()
    assert logged_steps(out) == [1, 2, 3] and not (out / "checkpoint-4").exists()

    # The same path, other content of the same size (two pairs swapped, as a re-shuffle would): refused before
    # anything loads.
    original = data.read_text()
    lines = original.splitlines(keepends=True)
    data.write_text("".join([lines[1], lines[0], *lines[2:]]))
    result = train(out, tiny_model_dir, data)
    assert result.returncode == 2, result.stdout[-3000:]
    assert (
        result.stdout.strip()
        .splitlines()[-1]
        .startswith(
            f"error: output_dir {str(out)!r} holds an unfinished run with other settings (dataset content: pairs.jsonl "
            "has other content (SHA-256 "
        )
    )
    data.write_text(original)  # the content it trained on, a new modification time
    result = train(out, tiny_model_dir, data)
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"Resuming from {out}/checkpoint-2" in result.stdout
    assert logged_steps(out) == [1, 2, 3, 4]
    assert_same_weights(out, baseline)


@pytest.mark.slow
def test_a_hand_edited_record_over_checkpoints_cut_short_is_read_as_the_run_wrote_it(
    baseline, tmp_path, tiny_model_dir, pairs
):
    """Every checkpoint cut short (no COMPLETE mark) and resolved_config.json "fixed" by hand: the same command starts
    afresh as it does over the record as written, the run's settings read from a checkpoint's own copy, as a resume
    reads them. The edit was compared as the run's settings, and the rerun refused: "has no complete checkpoint: pass
    --overwrite_output_dir". With no copy left to read, the refusal names the edit."""
    out = unfinished(baseline, tmp_path)
    for mark in out.glob("checkpoint-*/COMPLETE"):
        mark.unlink()
        run_files.incomplete(
            out, mark.parent.name
        )  # as a save cut short leaves the run's record: never listed complete
    record = json.loads((out / "resolved_config.json").read_text())
    (out / "resolved_config.json").write_text(json.dumps(record | {"learning_rate": record["learning_rate"] * 2}))
    result = train(out, tiny_model_dir, pairs, "--dry-run")
    said = result.stdout
    assert (
        result.returncode == 0
        and "incomplete (no COMPLETE mark: a save or a deletion cut short), nothing to resume from: starting afresh"
        in said
    )
    assert "would refuse" not in said, said[-3000:]
    for copy in out.glob("checkpoint-*/resolved_config.json"):
        copy.unlink()
    result = train(out, tiny_model_dir, pairs, "--dry-run")
    assert (
        f"the run would refuse: output_dir {str(out)!r} has no complete checkpoint, and its resolved_config.json was "
        "edited after the run wrote it, so the settings it ran with are not known: pass --overwrite_output_dir"
    ) in result.stdout, result.stdout[-3000:]


@pytest.mark.slow
def test_a_kill_during_the_first_save_does_not_block_the_identical_rerun(baseline, tmp_path, tiny_model_dir, pairs):
    """A stop request at step 1 saves checkpoint-1 on a slow file system (its files written, its mark 120 s away:
    tests/helpers/slow_checkpoint.py); the job is killed there, before the COMPLETE mark, as Slurm's SIGKILL ends a
    save past the grace time. A requeue reruns the same command."""
    out, stop_file, held = tmp_path / "run", tmp_path / "stop", tmp_path / "held"
    held.mkdir()
    # The run waits at step 1's end for the stop (DPOTRAIN_TEST_HOLD): touched on seeing step 1 logged, the stop file
    # could come after the run's last step (4 of them, ~1 s here) on a loaded machine, and no checkpoint was written.
    env = {"DPOTRAIN_STOP_FILE": str(stop_file), "SLOW_CHECKPOINT_S": "120"}
    env |= {"DPOTRAIN_TEST_HOLD": "step-1@0", "DPOTRAIN_TEST_HOLD_DIR": str(held)}
    proc = start(out, tiny_model_dir, pairs, env=env, script=SLOW_CHECKPOINT)
    wait_until(proc, (held / "held-step-1").exists)
    stop_file.touch()
    wait_until(proc, lambda: any((p / "trainer_state.json").exists() for p in out.glob("checkpoint-*")))
    # The lock's holder killed, as a node's SIGKILL ends it: the warm interpreter's child that runs the script
    os.kill(json.loads((out / run_lock.LOCK_FILE).read_text())["pid"], signal.SIGKILL)
    proc.wait()
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-1"]  # the stop's, at the step it was asked in
    assert [p.name for p in out.glob("checkpoint-*/COMPLETE")] == []

    result = train(out, tiny_model_dir, pairs)
    assert result.returncode == 0, result.stdout[-3000:]
    assert (
        "incomplete (no COMPLETE mark: a save or a deletion cut short), nothing to resume from: starting afresh"
        in result.stdout
    )
    assert logged_steps(out) == [1, 2, 3, 4]
    assert_same_weights(out, baseline)


@pytest.mark.slow
def test_a_kill_during_rotation_leaves_the_old_checkpoint_cut_short_not_complete(
    baseline, tmp_path, tiny_model_dir, pairs
):
    """SIGKILL while rotation (save_total_limit 1) deletes checkpoint-2 after checkpoint-4's mark, one of its files
    gone: shutil.rmtree goes in the folder's own order, and the COMPLETE mark stayed on a folder without its optimizer
    state or weights, which rotation counted complete and `push_to_hub.py --checkpoints` (the run's own complete
    checkpoints) pushed. The mark goes first now: a save cut short; the rerun goes on from checkpoint-4."""
    out, paused = tmp_path / "run", tmp_path / "paused"
    # Before rmtree's second file (its names come bare, relative to the folder; the mark's removal is by full path)
    env = {
        **pause_env("*/checkpoint-4/COMPLETE", "[!/]*", paused, count=2),
        "DPOTRAIN_TEST_PAUSE_AT_EVENT": "os.remove",
    }
    proc = start(out, tiny_model_dir, pairs, env=env, script=PAUSE_AT, extra=("--save_total_limit", "1"))
    os.kill(paused_pid(paused, proc), signal.SIGKILL)
    proc.wait()
    assert (out / "checkpoint-2").is_dir() and resume.unverified(out / "checkpoint-4") is None
    assert not (out / "checkpoint-2" / "COMPLETE").exists()
    assert [p for p in own_checkpoints(out) if is_complete(p)] == [out / "checkpoint-4"]  # what push_to_hub.py pushes
    result = train(out, tiny_model_dir, pairs, "--save_total_limit", "1")
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"Resuming from {out / 'checkpoint-4'}" in result.stdout
    assert_same_weights(out, baseline)


@pytest.mark.slow
def test_a_kill_while_overwrite_removes_a_finished_run_leaves_a_run_the_next_command_resumes_or_replaces(
    baseline, tmp_path, tiny_model_dir, pairs
):
    """SIGKILL while --overwrite_output_dir removes a finished run, inside its first checkpoint: run_complete.json was
    removed after the card, the checkpoints and the model (in the names' order), so the folder stayed a finished run
    with files missing (the rerun without the flag refused it as finished), and checkpoint-2 kept its COMPLETE mark
    without one of its files. Now the run's marks go first: the rerun without the flag resumes the old run from its
    last whole checkpoint to the same weights; the same command replaces it. The person's file stays in both.
    (SIGTERM or a Ctrl-C there is a stop request: the removal finishes, then the run stops before the model loads.)"""
    killed, paused = tmp_path / "killed", tmp_path / "paused"
    shutil.copytree(baseline, killed)
    (killed / "notes.md").write_text("compare with run b\n")
    # Armed from the start (no rename comes before the removal): before rmtree's second file, named bare
    env = {**pause_env("", "[!/]*", paused, count=2), "DPOTRAIN_TEST_PAUSE_AT_EVENT": "os.remove"}
    proc = start(killed, tiny_model_dir, pairs, env=env, script=PAUSE_AT, extra=("--overwrite_output_dir",))
    os.kill(paused_pid(paused, proc), signal.SIGKILL)
    proc.wait()
    assert not (killed / "run_complete.json").exists()
    assert all(resume.unverified(p) is None for p in own_checkpoints(killed) if is_complete(p))
    replaced = tmp_path / "replaced"
    shutil.copytree(killed, replaced)
    result = train(killed, tiny_model_dir, pairs)
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"Resuming from {killed / 'checkpoint-4'}" in result.stdout
    assert_same_weights(killed, baseline)
    result = train(replaced, tiny_model_dir, pairs, "--overwrite_output_dir")
    assert result.returncode == 0, result.stdout[-3000:]
    assert logged_steps(replaced) == [1, 2, 3, 4]
    assert_same_weights(replaced, baseline)
    assert all((out / "notes.md").read_text() == "compare with run b\n" for out in (killed, replaced))


# Ctrl-C's save, its stopped code and the rerun that ends like the uninterrupted run: tests/test_preemption.py
# (test_stop_request_checkpoints_and_a_rerun_ends_like_an_uninterrupted_run[Ctrl-C], the same path, which also runs the
# command it prints).


@pytest.mark.slow
def test_a_ctrl_c_checkpoint_beside_a_scheduled_one_is_rotated_with_it_and_resumed_from(
    baseline, tmp_path, tiny_model_dir, pairs, monkeypatch, capfd
):
    """Ctrl-C at step 3, between the scheduled checkpoints 2 and 4 (save_total_limit 2): the stop's checkpoint-3 is
    written beside checkpoint-2, the rerun goes on from it (the newest verified), and checkpoint-4's rotation deletes
    checkpoint-2, never the one resumed from. In this process, the Ctrl-C sent as step 3 computes its loss: the step
    it stops at is 3 whatever the machine's speed (a signal timed from outside lands a step early or late; one sent as
    checkpoint-2's save ends is that checkpoint's, test_preemption.py)."""
    import train_dpo
    from dpotrain.train.trainer import RecipeDPOTrainer

    loss, sent = RecipeDPOTrainer._compute_loss, []

    def ctrl_c_in_step_3(self, model, inputs, return_outputs):
        if self.state.global_step == 2 and not sent:
            sent.append(os.kill(os.getpid(), signal.SIGINT))
        return loss(self, model, inputs, return_outputs)

    monkeypatch.setattr(RecipeDPOTrainer, "_compute_loss", ctrl_c_in_step_3)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's foreground job (conftest restores it)
    out = tmp_path / "run"
    argv = [*command(out, tiny_model_dir, pairs)[2:], "--save_total_limit", "2"]
    assert train_dpo.main(argv) == STOPPED_EXIT
    said = capfd.readouterr()
    assert f"Stop requested: checkpoint {out}/checkpoint-3 written" in said.out, said.out[-3000:] + said.err[-3000:]
    assert [p.parent.name for p in sorted(out.glob("checkpoint-*/COMPLETE"))] == ["checkpoint-2", "checkpoint-3"]

    assert train_dpo.main(argv) is None
    said = capfd.readouterr()
    assert f"Resuming from {out}/checkpoint-3" in said.out, said.out[-3000:] + said.err[-3000:]
    assert logged_steps(out) == [1, 2, 3, 4]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert_same_weights(out, baseline)


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_and_releases_the_runs_lock(tmp_path):
    """The second Ctrl-C's os._exit skipped the release every other end of a run makes: run.lock stayed, and a rerun
    from another host (a login node's run rerun as a job) was refused as "in use" until the lock was 300 s stale.
    (One interpreter for both, the warm one: each fresh one is ~7 s of imports, and the lock changes nothing of the
    stop.)"""
    code = f"""
import os, signal, time
from pathlib import Path
from dpotrain.cluster import run_lock
from dpotrain.train.preemption import GracefulStop
assert run_lock.acquire(Path({str(tmp_path / "run")!r})) is None
stop = GracefulStop()
os.kill(os.getpid(), signal.SIGINT)
os.kill(os.getpid(), signal.SIGINT)  # the same Ctrl-C, forwarded by torchrun's agent at once: not a second one
time.sleep(1.5)
print("asked:", stop.asked_here(), flush=True)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(5)
print("still running", flush=True)
"""
    script = tmp_path / "ctrl_c.py"  # a script: the warm interpreter's (imports paid once) runs scripts
    script.write_text(code)
    result = subprocess.run(
        [python(), str(script)], cwd=ROOT, capture_output=True, text=True, timeout=60, preexec_fn=default_sigint
    )
    assert result.returncode == INTERRUPTED_EXIT, result.stderr
    assert result.stdout == "asked: True\n" and "Second Ctrl-C: stopping at once" in result.stderr
    assert not (tmp_path / "run" / run_lock.LOCK_FILE).exists()


def on_small_disk(folder, megabytes, argv, before=None, env=None) -> tuple[int, str]:
    """`python train_dpo.py ARGV` as its process ends it (`run_cli`), in a forked child of this process (`in_child`)
    where writing in `folder` runs out of space: a tmpfs of `megabytes` mounted there in the child's own mount
    namespace for root (its files copied to `folder`.kept as the child ends, the mount ending with it), else a
    file-size limit (RLIMIT_FSIZE: the kernel's EFBIG). `before()` runs first in the child. Its exit code and output
    (stdout, then stderr). Forked, not a fresh interpreter under `unshare`: that imported the stack again (~6 CPU-s)."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    kept = folder.with_name(folder.name + ".kept")
    folder.mkdir()
    root = os.geteuid() == 0

    def run():
        if not root:
            import resource

            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
            resource.setrlimit(resource.RLIMIT_FSIZE, (megabytes << 20, megabytes << 20))
        try:
            if before:
                before()
            run_cli(lambda: train_dpo.main(argv))
        finally:
            shutil.copytree(folder, kept, symlinks=True)

    code, stdout, stderr = in_child(run, tmpfs=[(folder, f"{megabytes}m")] if root else (), env=env)
    return code, stdout + stderr


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line_and_the_earlier_checkpoint_is_kept(
    baseline, tmp_path, tiny_model_dir, pairs
):
    disk = tmp_path / "disk"
    out = disk / "run"
    # a checkpoint takes ~2.3 MB: checkpoint-2 fits in 4 MB, checkpoint-4 does not
    code, log = on_small_disk(disk, 4, command(out, tiny_model_dir, pairs)[2:])
    kept = tmp_path / "disk.kept" / "run"
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert code == 1 and "Traceback" not in log and len(errors) == 1, log[-3000:]
    last = errors[0]
    limited = f"a file size limit (ulimit -f) of {4 << 20:,} bytes stopped the write"  # the limit to raise, named
    whole_disk = os.geteuid() == 0
    why = "the disk is full" if whole_disk else limited
    if whole_disk:  # the whole disk: checkpoint-2 was written, checkpoint-4 did not fit
        assert last.startswith(f"error: {why}: checkpoint-4 could not be written in {out} (")
        assert "a checkpoint takes 2.3 MiB, as checkpoint-2 did" in last, last
        assert "checkpoint-2 is kept, and the same command goes on from it" in last
        assert [p.name for p in kept.glob("checkpoint-*")] == ["checkpoint-2"]
        assert checkpoint_manifest.problem(kept / "checkpoint-2") is None
    else:  # a limit per file: the first save's optimizer state is larger than it
        assert last.startswith(f"error: {why}: checkpoint-2 could not be written in {out}: raise it"), last
        assert list(kept.glob("checkpoint-*")) == []

    result = train(kept, tiny_model_dir, pairs)  # the same run with room again
    assert result.returncode == 0, result.stdout[-3000:]
    assert logged_steps(kept) == [1, 2, 3, 4]
    assert_same_weights(kept, baseline)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs a tmpfs mounted in a mount namespace of its own (root)")
def test_a_reference_cache_without_room_costs_only_the_saving(baseline, tmp_path, tiny_model_dir, pairs):
    """DPOTRAIN_CACHE on a disk with no room left: the reference stage warns once and scores every pair the run's
    steps train, and training goes on with the scores in memory to the uninterrupted run's weights; nothing
    half-written is left in the cache. (A file-size limit, where no tmpfs can be mounted, would fail the run's own
    checkpoints too, not the cache alone.)"""
    cache = tmp_path / "cache"

    def fill():  # no room left
        with contextlib.suppress(OSError), open(cache / "filler", "wb") as filler:
            filler.write(bytes(4_000_000))

    out = tmp_path / "run"
    argv = [*command(out, tiny_model_dir, pairs)[2:], "--reference_save_seconds", "0"]
    code, log = on_small_disk(cache, 1, argv, before=fill, env={"DPOTRAIN_CACHE": str(cache)})
    assert code == 0 and "Traceback" not in log, log[-3000:]
    warning = f"warning: the reference cache could not be written in {cache}/reference/"
    assert log.count(warning) == 1, log[-3000:]  # once, though every round tried to save
    assert "(No space left on device): scoring and training go on with the scores in memory" in log
    assert "32 scored, not cached (No space left on device in " in log, log[-3000:]  # 4 steps of 8
    record = json.loads((out / "resolved_config.json").read_text())["derived"]["reference"]
    assert record["train"]["not_cached"] == "No space left on device", record
    assert_same_weights(out, baseline)
    left = [p.name for p in (tmp_path / "cache.kept").rglob("*") if p.is_file()]
    assert left == ["filler"], left


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs a tmpfs mounted in a mount namespace of its own (root)")
@pytest.mark.parametrize("save_seconds", [0, 120])
def test_a_reference_only_run_that_could_not_cache_its_scores_fails_in_one_line(
    tmp_path, tiny_model_dir, pairs, save_seconds
):
    """`--reference-only` has one product, the cache: on a full disk it warned, scored every pair, threw the scores
    away as it exited, and exited 0, so the training job after it (`sbatch --dependency=afterok`) started and scored
    them all again. Now exit 1, in one line naming the folder and the fix, at the stop check after the first save
    that failed (`--reference_save_seconds 0`: the first micro-batch's), not after scoring every pair; or, where no
    save came before the end (120 s), once complete.npz could not be written."""
    cache = tmp_path / "cache"

    def fill():  # no room left
        with contextlib.suppress(OSError), open(cache / "filler", "wb") as filler:
            filler.write(bytes(4_000_000))

    argv = [*command(tmp_path / "run", tiny_model_dir, pairs)[2:], "--reference-only", "--reference_save_seconds"]
    argv.append(str(save_seconds))
    code, log = on_small_disk(cache, 1, argv, before=fill, env={"DPOTRAIN_CACHE": str(cache)})
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert code == 1 and "Traceback" not in log and len(errors) == 1, log[-3000:]
    what = "stopped: they" if save_seconds == 0 else "were scored but"
    assert errors[0].startswith(
        f"error: --reference_only: the reference log-probs (train) {what} could not be cached (No space left on "
        f"device in {cache}/reference/"
    ), errors
    assert "micro-batches each" in log and ("32/32 pairs" in log) == (save_seconds > 0), log[-3000:]  # 4 steps of 8
    assert errors[0].endswith("set DPOTRAIN_CACHE to a folder with room, and run it again"), errors
    assert [p.name for p in (tmp_path / "cache.kept").rglob("*") if p.is_file()] == ["filler"]


@pytest.mark.slow
@pytest.mark.parametrize("edit", ["deleted", "first line removed"])
def test_metrics_records_removed_between_attempts_are_written_again_from_the_checkpoint(
    baseline, tmp_path, tiny_model_dir, pairs, edit
):
    """metrics.jsonl deleted (or a line of it removed) after the run was stopped at checkpoint-2: the rerun resumed and
    the history, plot and card held only the steps past the checkpoint, silently. The checkpoint's trainer state holds
    the records of its steps: they are written again, said in one line. The line removed, the node was also lost
    while step 4's record was appended: the file ends in half a line, dropped with one warning (one rerun for both)."""
    out = unfinished(baseline, tmp_path, drop_checkpoint_4=True)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text(
        "" if edit == "deleted" else "".join(lines[1:3]) + lines[3][: len(lines[3]) // 2]
    )
    if edit == "deleted":
        (out / "metrics.jsonl").unlink()
    result = train(out, tiny_model_dir, pairs)
    assert result.returncode == 0 and "Traceback" not in result.stdout, result.stdout[-3000:]
    torn = f"warning: {out}/metrics.jsonl: dropped its last line (3: "  # the third line of the file as left
    assert result.stdout.count(torn) == (0 if edit == "deleted" else 1), result.stdout[-3000:]
    assert f"Resuming from {out}/checkpoint-2" in result.stdout
    assert logged_steps(out) == [1, 2, 3, 4]
    missing = "1, 2" if edit == "deleted" else "1"
    line = f"warning: {out}/metrics.jsonl lacked the records of step {missing}, which the checkpoint resumed from holds"
    assert result.stdout.count(line) == 1, result.stdout[-3000:]
    got, expected = metrics.read_metrics(out), metrics.read_metrics(baseline)
    assert [r["loss"] for r in got] == [r["loss"] for r in expected]
    assert_same_weights(out, baseline)


def test_a_resume_that_evaluates_on_start_keeps_the_checkpoint_steps_training_record(tmp_path):
    """With eval_on_start, a resume's first record is an evaluation at the checkpoint's step: the trim made at it
    dropped that step's training record (written by the first attempt, never trained again). It trims at the
    checkpoint's step instead, dropping only what comes after, and adds the evaluation."""
    from types import SimpleNamespace

    path = tmp_path / "metrics.jsonl"
    first = [{"step": s, "epoch": s / 10, "loss": 0.6} for s in (2, 4, 6)]  # checkpoint at 4, killed after 6
    path.write_text("".join(json.dumps(r) + "\n" for r in first))
    recorder, args = metrics.MetricsRecorder(), SimpleNamespace(output_dir=str(tmp_path))
    state = SimpleNamespace(global_step=4, max_steps=10, epoch=0.4, log_history=first[:2])
    recorder.on_train_begin(args, state, None)
    recorder.on_log(args, state, None, logs={"eval_loss": 0.5})  # eval_on_start, at the checkpoint's step
    state.global_step, state.epoch = 6, 0.6
    recorder.on_log(args, state, None, logs={"loss": 0.55})
    got = [(r["step"], r.get("loss"), r.get("eval_loss")) for r in metrics.read_metrics(path)]
    assert got == [(2, 0.6, None), (4, 0.6, None), (4, None, 0.5), (6, 0.55, None)]


def test_metrics_records_written_again_are_said_in_one_short_line(tmp_path, capsys):
    """A long run's lost records (logged every step) are named by their first and last step, not listed one by one;
    the records the file still holds stay as they are, and an evaluation's record follows its step's training one."""
    path = tmp_path / "metrics.jsonl"
    history = [{"loss": 0.6, "epoch": 0.1, "step": step} for step in range(1, 501)]
    history.insert(2, {"eval_loss": 0.5, "epoch": 0.1, "step": 2})
    path.write_text('{"step": 3, "epoch": 0.1, "loss": 0.6, "resumed_from": 2}\n')
    metrics.restore(path, history)
    assert capsys.readouterr().err == (
        f"warning: {path} lacked the records of step 1 to 500 (499 logged), which the checkpoint resumed from holds: "
        "written again from its trainer_state.json\n"
    )
    records = metrics.read_metrics(path)
    assert [(r["step"], "eval_loss" in r) for r in records[:4]] == [(1, False), (2, False), (2, True), (3, False)]
    assert len(records) == 501 and records[2].get("resumed_from") is None and records[3]["resumed_from"] == 2
    metrics.restore(path, history)  # nothing lacking: nothing said, nothing written
    assert capsys.readouterr().err == "" and len(metrics.read_metrics(path)) == 501


@pytest.mark.slow
@pytest.mark.parametrize("how", ["rotation", "overwrite"])
def test_a_persons_file_written_into_a_checkpoint_stays_when_the_run_deletes_it(
    baseline, tmp_path, tiny_model_dir, pairs, how
):
    """An evaluation of checkpoint-2 written into its folder while the run trained (`lm_eval --output_path`):
    save_total_limit's rotation, or --overwrite_output_dir, deleted the folder whole, the person's results with it.
    The files its MANIFEST.json lists are the run's; the others stay, said in one line."""
    out = unfinished(baseline, tmp_path, drop_checkpoint_4=True)
    (out / "checkpoint-2" / "eval_results.json").write_text('{"mmlu": 0.25}\n')
    extra = ["--save_total_limit", "1"] if how == "rotation" else ["--overwrite_output_dir", "--learning_rate", "3e-4"]
    result = train(out, tiny_model_dir, pairs, *extra)
    assert result.returncode == 0 and "Traceback" not in result.stdout, result.stdout[-3000:]
    kept = list(out.glob("checkpoint-2*/eval_results.json"))
    assert [p.read_text() for p in kept] == ['{"mmlu": 0.25}\n'], result.stdout[-3000:]
    assert f"Kept eval_results.json in {out / 'checkpoint-2'}: not the run's (its MANIFEST.json does not list it)" in (
        result.stdout
    )
    # Alone in its folder: under --overwrite_output_dir moved aside as the new run saved its own checkpoint-2
    assert [p.name for p in kept[0].parent.iterdir()] == ["eval_results.json"]
    assert kept[0].parent.name == "checkpoint-2" if how == "rotation" else is_complete(out / "checkpoint-2")


def on_block_disk(folder, megabytes, argv, paused=False, **child) -> Child:
    """`python train_dpo.py ARGV` as its process ends it (`run_cli`), started in a forked child of this process
    (`start_child`) where `folder` is a disk of `megabytes` with 1 KiB blocks (ext2 on a loop device, mounted in the
    child's own mount namespace; its files are copied to `folder`.kept as the child ends). tmpfs allocates 4 KiB pages:
    a metrics record (~800 bytes) appended into a page already there would not meet the full disk. Forked, not a fresh
    interpreter under `unshare`: that imported the stack again (~6 CPU-s). `paused`: the run stops itself at the point
    its `env` names (`pause_env`), as under `python PAUSE_AT`."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    kept, image = folder.with_name(folder.name + ".kept"), folder.with_name(folder.name + ".img")
    folder.mkdir()
    subprocess.run(["truncate", "-s", f"{megabytes}M", str(image)], check=True)
    made = subprocess.run(["mkfs.ext2", "-q", "-b", "1024", "-m", "0", str(image)], capture_output=True)
    mount = ["mount", "-o", "loop", str(image), str(folder)]
    probe = ["unshare", "--mount", *mount]
    if made.returncode != 0 or os.geteuid() != 0 or subprocess.run(probe, capture_output=True).returncode:
        pytest.skip("needs a loop-mounted file system in a mount namespace of its own (root, mkfs.ext2, loop devices)")

    def run():
        subprocess.run(mount, check=True)  # in the child's mount namespace (start_child's own)
        if paused:
            pause_here()
        try:
            run_cli(lambda: train_dpo.main(argv))
        finally:
            shutil.copytree(folder, kept, symlinks=True)

    return start_child(run, **child)


def listed_complete(out: Path) -> list[str]:
    """The checkpoints the run's record lists as marked complete, [] while it is being replaced or holds none."""
    try:
        return json.loads((out / run_files.MANIFEST).read_text()).get(run_files.COMPLETE, [])
    except (OSError, ValueError):
        return []


def fill(folder) -> None:
    """Another job takes every free block of `folder`'s disk."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 16, 1024):
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError:
                    break
    finally:
        os.close(fd)


@pytest.mark.slow
def test_a_disk_filled_mid_training_ends_at_the_metrics_in_one_line_without_a_torn_record(
    baseline, tmp_path, tiny_model_dir, pairs
):
    disk = tmp_path / "disk"
    out = disk / "run"
    # Stopped once checkpoint-2 is marked COMPLETE, before step 3's record opens metrics.jsonl (the next write; the
    # record listing the checkpoint complete comes before it). A SIGSTOP sent on seeing that record raced the run: 2
    # steps and the final save were left, and a loaded machine's late stop filled the disk under those instead.
    paused = tmp_path / "paused"
    env = pause_env("*/checkpoint-2/COMPLETE", "*/metrics.jsonl", paused)
    run = on_block_disk(disk, 16, command(out, tiny_model_dir, pairs)[2:], paused=True, env=env)
    pid = paused_pid(paused, run)
    seen = Path(f"/proc/{pid}/root") / out.relative_to("/")  # the run's folder, on the run's own disk
    try:
        assert "checkpoint-2" in listed_complete(seen)
        fill(seen.parent)
    finally:
        os.kill(pid, signal.SIGCONT)
    code, stdout, stderr = run.wait()
    log = stdout + stderr
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert code == 1 and "Traceback" not in log and len(errors) == 1, log[-3000:]
    assert errors[0] == (
        f"error: the disk is full: {out}/metrics.jsonl could not be written (0 bytes free there): free space there, "
        "then rerun; checkpoint-2 is kept, and the same command goes on from it"
    )
    kept = tmp_path / "disk.kept" / "run"
    # Whole records: steps 1 and 2, the disk filled at step 3's
    assert (kept / "metrics.jsonl").read_text().endswith("\n") and logged_steps(kept) == [1, 2], log[-3000:]
    assert checkpoint_manifest.problem(kept / "checkpoint-2") is None

    result = train(kept, tiny_model_dir, pairs)  # the same command, space freed
    assert result.returncode == 0 and "warning:" not in result.stdout, result.stdout[-3000:]
    assert f"Resuming from {kept}/checkpoint-2" in result.stdout
    assert logged_steps(kept) == [1, 2, 3, 4]
    assert_same_weights(kept, baseline)


@pytest.mark.slow
def test_an_output_file_system_turned_read_only_mid_training_ends_in_one_line_and_the_rerun_resumes(
    baseline, tmp_path, tiny_model_dir, pairs
):
    """The output folder's file system remounted read-only after checkpoint-2 (as the kernel does on a disk error, or
    an admin): a traceback in the metrics append, before. The run's folder is a bind mount in a mount namespace of the
    run's own, remounted there; the same folder, writable again outside, is what the rerun goes on from."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    if os.geteuid() != 0 or subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs a bind mount in a mount namespace of its own (root, unshare) to remount read-only")
    disk = tmp_path / "disk"
    disk.mkdir()
    out, paused = disk / "run", tmp_path / "paused"
    # Stopped once checkpoint-2 is marked COMPLETE, before step 3's record opens metrics.jsonl (the next write): a
    # SIGSTOP sent on seeing the mark came after step 3 was logged on a fast machine.
    env = pause_env("*/checkpoint-2/COMPLETE", "*/metrics.jsonl", paused)

    def run():  # python PAUSE_AT ARGS: its audit hook (reading `env`), then the command as its process ends it
        pause_here()
        run_cli(lambda: train_dpo.main(command(out, tiny_model_dir, pairs)[2:]))

    # The run's folder a bind mount in the forked child's own mount namespace (`start_child`), remounted there
    child = start_child(run, bind=[(disk, disk)], env=env)
    pid = paused_pid(paused, child)
    try:
        remount = ["nsenter", "-t", str(pid), "-m", "mount", "-o", "remount,bind,ro", str(disk)]
        subprocess.run(remount, check=True, capture_output=True)
    finally:
        os.kill(pid, signal.SIGCONT)
    code, stdout, stderr = child.wait()
    log = stdout + stderr
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert code == 1 and "Traceback" not in log and len(errors) == 1, log[-3000:]
    assert errors[0] == (
        f"error: the file system is read-only: {out}/metrics.jsonl could not be written: make it writable again (a "
        "file system remounted read-only after a disk error needs its administrator), then rerun; checkpoint-2 is "
        "kept, and the same command goes on from it"
    )
    assert logged_steps(out) == [1, 2] and (out / "metrics.jsonl").read_text().endswith("\n")

    result = train(out, tiny_model_dir, pairs)  # the same command, the file system writable again
    assert result.returncode == 0 and "Traceback" not in result.stdout, result.stdout[-3000:]
    assert f"Resuming from {out}/checkpoint-2" in result.stdout
    assert logged_steps(out) == [1, 2, 3, 4]
    assert_same_weights(out, baseline)


@pytest.mark.slow
def test_an_output_folder_moved_away_mid_training_ends_in_one_line_and_moved_back_resumes(
    baseline, tmp_path, tiny_model_dir, pairs
):
    """`mv run run.old` while the run trained (a folder taken for a dead run's): the next metrics record ended the run
    in a FileNotFoundError traceback. One line now, naming the folder; nothing is made again at its path; moved back,
    the same command goes on from checkpoint-2 (the lock the run left there taken over) to the uninterrupted weights."""
    out, paused = tmp_path / "run", tmp_path / "paused"
    env = pause_env("*/checkpoint-2/COMPLETE", "*/metrics.jsonl", paused)  # before step 3's record
    proc = start(out, tiny_model_dir, pairs, env=env, script=PAUSE_AT)
    pid = paused_pid(paused, proc)
    try:
        out.rename(tmp_path / "run.old")
    finally:
        os.kill(pid, signal.SIGCONT)
    log = proc.communicate(timeout=600)[0]
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and "Traceback" not in log and len(errors) == 1, log[-3000:]
    assert errors[0] == (
        f"error: the output folder {out} was deleted or moved away while this run trained: this run ended as "
        f"{out}/metrics.jsonl could not be written, writing nothing more there (a folder made again of that name "
        f"would hold none of its record, checkpoints or lock); move the folder back to {out} and run the same command "
        "again to go on from its newest checkpoint, or run it as it is to start afresh"
    )
    assert not out.exists()

    (tmp_path / "run.old").rename(out)
    result = train(out, tiny_model_dir, pairs)
    assert result.returncode == 0 and "Traceback" not in result.stdout, result.stdout[-3000:]
    assert f"Resuming from {out}/checkpoint-2" in result.stdout
    assert_same_weights(out, baseline)


@pytest.mark.slow
def test_an_output_folder_deleted_after_the_last_step_is_not_made_again_by_the_final_save(
    tmp_path, tiny_model_dir, pairs
):
    """`rm -rf run` once the last step's end was checked (its checkpoint written), before the final save: that save
    made the folder again and the run ended with 0, a model and run_complete.json in a folder the user removed (none
    of its record, checkpoints or lock). One line now, a non-zero exit, and nothing made again at its path."""
    out, paused = tmp_path / "run", tmp_path / "paused"
    env = pause_env(f"*/checkpoint-{STEPS}/COMPLETE", "*", paused)  # the last step's checkpoint written
    proc = start(out, tiny_model_dir, pairs, env=env, script=PAUSE_AT)
    pid = paused_pid(paused, proc)
    try:
        shutil.rmtree(out)
    finally:
        os.kill(pid, signal.SIGCONT)
    log = proc.communicate(timeout=600)[0]
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and "Traceback" not in log and len(errors) == 1, log[-3000:]
    assert errors[0] == (
        f"error: the output folder {out} was deleted or moved away while this run trained: this run ended after its "
        "last step, before its final model was saved, writing nothing more there (a folder made again of that name "
        f"would hold none of its record, checkpoints or lock); move the folder back to {out} and run the same command "
        "again to go on from its newest checkpoint, or run it as it is to start afresh"
    )
    assert not out.exists()


@pytest.mark.slow
def test_a_checkpoint_deleted_while_it_is_written_ends_in_one_line_and_the_rerun_goes_on_from_the_one_before(
    baseline, tmp_path, tiny_model_dir, pairs
):
    """`rm -rf run/checkpoint-*` to free space while the run trained, as it wrote checkpoint-4 (minutes for a large
    model): its MANIFEST.json's write ended the run in a FileNotFoundError traceback. One line now, naming the
    checkpoint and what the same command does, which goes on from the complete checkpoint before it."""
    out, paused = tmp_path / "run", tmp_path / "paused"
    env = pause_env("", "*/checkpoint-4/.MANIFEST.json*", paused)  # its files written, its manifest not yet
    proc = start(out, tiny_model_dir, pairs, env=env, script=PAUSE_AT)
    pid = paused_pid(paused, proc)
    try:
        shutil.rmtree(out / "checkpoint-4")
    finally:
        os.kill(pid, signal.SIGCONT)
    log = proc.communicate(timeout=600)[0]
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and "Traceback" not in log and len(errors) == 1, log[-3000:]
    assert errors[0] == (
        f"error: checkpoint-4 was deleted or moved away while this run wrote it in {out} ({out}/checkpoint-4/"
        "MANIFEST.json could not be written): this run ended there; run the same command again: checkpoint-2 is "
        "kept, and the same command goes on from it"
    )

    result = train(out, tiny_model_dir, pairs)
    assert result.returncode == 0 and "Traceback" not in result.stdout, result.stdout[-3000:]
    assert f"Resuming from {out}/checkpoint-2" in result.stdout
    assert_same_weights(out, baseline)


@pytest.mark.slow
def test_a_checkpoint_deleted_while_it_is_checksummed_says_it_could_not_be_read(tmp_path, tiny_model_dir, pairs):
    """`rm -rf run/checkpoint-*` as the run checksummed checkpoint-4's files (minutes for a large model): a traceback
    blaming a node that does not see the output folder ("unreadable on rank 0 ... every node must see the output
    folder"), or, the file gone while listed, a line saying it "could not be written", though the run only read it.
    One line now, saying it was deleted while checksummed and could not be read."""
    out, paused = tmp_path / "run", tmp_path / "paused"
    # safetensors writes the weights from Rust: Python's first open of them is the checksum's read
    env = pause_env("*/checkpoint-2/COMPLETE", "*/checkpoint-4/model.safetensors", paused)
    proc = start(out, tiny_model_dir, pairs, env=env, script=PAUSE_AT)
    pid = paused_pid(paused, proc)
    try:
        shutil.rmtree(out / "checkpoint-4")
    finally:
        os.kill(pid, signal.SIGCONT)
    log = proc.communicate(timeout=600)[0]
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and "Traceback" not in log and len(errors) == 1, log[-3000:]
    assert errors[0] == (
        f"error: checkpoint-4 was deleted or moved away while this run checksummed it in {out} ({out}/checkpoint-4/"
        "model.safetensors could not be read): this run ended there; run the same command again: checkpoint-2 is "
        "kept, and the same command goes on from it"
    )


@pytest.mark.slow
def test_a_one_process_run_requeued_under_a_two_process_deepspeed_launch_is_refused_at_start(
    baseline, tmp_path, tiny_model_dir, pairs
):
    """A requeue that changed the launch (scripts/launch.sh's accelerate launch of 2 processes, ZeRO-2) finds
    checkpoints a single process wrote: refused before the model loads, as the launch that lost processes is. Nor is
    DeepSpeed's shared-memory op compiled first (60-140 s of a fresh venv's first CPU launch, for inference alone)."""
    out = unfinished(baseline, tmp_path)
    extensions = tmp_path / "torch_extensions"  # where a JIT op would be built: a fresh venv's empty folder
    bin_dir = os.path.dirname(PYTHON)
    launch = [
        *accelerate_launch(),  # warm: refused at start, nothing signals it
        "--config_file",
        str(ROOT / "accelerate_config.yaml"),
        "--num_processes",
        "2",
        *rank_python(),
    ]
    result = subprocess.run(
        [*launch, *command(out, tiny_model_dir, pairs)[1:]],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TORCH_EXTENSIONS_DIR": str(extensions)},
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    # Written once, by the main process: the ranks have met, and each wrote it (docs/reliability.md, one run per folder)
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and errors == [
        f"error: checkpoint '{out}/checkpoint-4' was written without DeepSpeed (one process, DDP or FSDP), and this "
        "run uses DeepSpeed (zero2, 2 processes), which cannot load it: resume it with the launch that wrote it (one "
        "process: `python train_dpo.py` with the same arguments, without accelerate launch), or start afresh (a new "
        "--output_dir) from its weights (--model_name_or_path on a copy of the checkpoint folder)"
    ], result.stdout[-3000:]
    assert "Data (train)" not in result.stdout  # nothing loaded
    assert not extensions.exists() and "deepspeed_shm_comm_op built" not in result.stdout, result.stdout[-3000:]


@pytest.mark.slow
def test_a_dry_run_lists_a_checkpoint_its_launch_cannot_load_with_its_other_refusals(
    baseline, tmp_path, tiny_model_dir, pairs
):
    """The dry run of the launch above (the recipe's ZeRO-2 accelerate config) stopped at the checkpoint's refusal
    (exit 2), saying nothing of the rest (here W&B without a login): it lists it with the others, as docs/checks.md
    says a dry run lists what the run would refuse."""
    out = unfinished(baseline, tmp_path)
    config = ("--accelerate_config", str(ROOT / "accelerate_config.yaml"), "--report_to", "wandb", "--dry-run")
    result = train(out, tiny_model_dir, pairs, *config, env={"WANDB_API_KEY": "", "WANDB_MODE": ""})
    refusals = [line for line in result.stdout.splitlines() if line.startswith("warning: the run would refuse: ")]
    assert result.returncode == 0 and len(refusals) == 2, result.stdout[-3000:]
    assert refusals[1].startswith(
        f"warning: the run would refuse: checkpoint '{out}/checkpoint-4' was written without DeepSpeed"
    ), refusals


@pytest.mark.slow
def test_an_explicit_resume_from_a_save_cut_short_is_refused_naming_what_is_missing(
    baseline, tmp_path, tiny_model_dir, pairs
):
    """Issue #53: `--resume_from_checkpoint` naming a save cut short (no mark, no optimizer or scheduler state) trained
    with a fresh optimizer and a restarted warm-up. Refused in one line: what is missing, and what to pass."""
    out = unfinished(baseline, tmp_path)
    for name in ("COMPLETE", checkpoint_manifest.MANIFEST, "optimizer.pt", "scheduler.pt"):
        (out / "checkpoint-4" / name).unlink()
    run_files.incomplete(out, "checkpoint-4")  # as a save cut short leaves the run's record: never listed complete
    recipe = parse_args(
        [*command(out, tiny_model_dir, pairs)[2:], "--resume_from_checkpoint", str(out / "checkpoint-4")]
    )
    with pytest.raises(ConfigError) as refused:
        check_output_dir(recipe, 8)
    assert str(refused.value) == (
        f"resume_from_checkpoint {str(out / 'checkpoint-4')!r} cannot be verified (no COMPLETE mark (a save or a "
        "deletion cut short, or not this project's); MANIFEST.json, optimizer.pt and scheduler.pt are missing): pass "
        "--resume_from_checkpoint "
        f"{out / 'checkpoint-2'}, the newest verified checkpoint beside it"
    )


@pytest.mark.slow
def test_checkpoints_copied_into_a_new_folder_are_compared_with_the_settings_they_were_trained_with(
    baseline, tmp_path, tiny_model_dir, pairs
):
    """Issue #53: checkpoints copied into a new folder (no resolved_config.json there) resumed on another learning
    rate or other data, while the record stated the new values. Each checkpoint holds the record it was trained under,
    covered by its manifest: the automatic resume and --resume_from_checkpoint compare with it."""
    copied = tmp_path / "copied"
    copied.mkdir()
    for name in ("checkpoint-2", "checkpoint-4"):
        shutil.copytree(baseline / name, copied / name)
    other_data = tmp_path / "other.jsonl"
    other_data.write_text(pairs.read_text())
    for extra, named in ((["--learning_rate", "0.001"], "learning_rate: 0.0001 -> 0.001"), ([], "dataset_name: ")):
        data = other_data if not extra else pairs
        automatic = parse_args([*command(copied, tiny_model_dir, data)[2:], *extra])
        with pytest.raises(ConfigError, match="holds an unfinished run with other settings") as refused:
            check_output_dir(automatic, 8)
        assert named in str(refused.value)
        explicit = parse_args(
            [
                *command(tmp_path / "elsewhere", tiny_model_dir, data)[2:],
                *extra,
                "--resume_from_checkpoint",
                str(copied / "checkpoint-4"),
            ]
        )
        with pytest.raises(ConfigError, match="was written by a run with other settings") as refused:
            check_output_dir(explicit, 8)
        assert named in str(refused.value)
    same = parse_args(command(copied, tiny_model_dir, pairs)[2:])
    assert check_output_dir(same, 8).resume_from == str(copied / "checkpoint-4")
    listed = json.loads((copied / "checkpoint-4" / checkpoint_manifest.MANIFEST).read_text())["files"]
    assert "resolved_config.json" in listed  # checked with the checkpoint's other files


@pytest.mark.slow
def test_an_explicit_damaged_resume_point_is_refused(baseline, tmp_path, tiny_model_dir, pairs):
    out = unfinished(baseline, tmp_path)
    (out / "checkpoint-4" / "scheduler.pt").unlink()
    recipe = parse_args(
        [*command(out, tiny_model_dir, pairs)[2:], "--resume_from_checkpoint", str(out / "checkpoint-4")]
    )
    with pytest.raises(ConfigError, match=r"resume_from_checkpoint .*checkpoint-4' cannot be verified \(scheduler.pt "):
        check_output_dir(recipe, 8)


@pytest.mark.slow
def test_a_finished_runs_last_checkpoint_resumed_into_a_new_folder_is_refused_as_training_nothing(
    baseline, tmp_path, tiny_model_dir, pairs
):
    """It exited 0 after training nothing: a "finished" run in the new folder, no metrics.jsonl, `"final": null`.
    Refused before anything loads. Its own run's rerun from it still finishes that run (the final model is written
    from it: test_a_run_killed_after_its_last_checkpoint_...), and an earlier checkpoint still resumes elsewhere."""
    named = baseline / "checkpoint-4"
    recipe = parse_args([*command(tmp_path / "new", tiny_model_dir, pairs)[2:], "--resume_from_checkpoint", str(named)])
    with pytest.raises(ConfigError) as refused:
        check_output_dir(recipe, 8)
    assert str(refused.value) == (
        f"resume_from_checkpoint {str(named)!r} was saved at step 4, and the run ends at step 4 (max_steps or "
        "num_train_epochs, which a resume keeps as its checkpoint was trained): it would train nothing; to train on, "
        f"start a new run from a copy of its weights (cp -r {named} <new folder>, then --model_name_or_path "
        "<new folder> and a new --output_dir)"
    )
    earlier = str(baseline / "checkpoint-2")
    recipe = parse_args([*command(tmp_path / "new", tiny_model_dir, pairs)[2:], "--resume_from_checkpoint", earlier])
    assert check_output_dir(recipe, 8).resume_from == earlier
    out = unfinished(baseline, tmp_path)
    own = str(out / "checkpoint-4")
    recipe = parse_args([*command(out, tiny_model_dir, pairs)[2:], "--resume_from_checkpoint", own])
    assert check_output_dir(recipe, 8).resume_from == own


@pytest.mark.slow
def test_a_run_over_epochs_resuming_another_runs_checkpoint_at_its_last_step_is_refused_once_the_data_is_counted(
    baseline, tmp_path, tiny_model_dir, pairs
):
    """Under num_train_epochs the run's steps are known once the data set is counted, before the model loads."""
    recipe = parse_args([*command(tmp_path / "new", tiny_model_dir, pairs)[2:], "--max_steps", "-1"])
    recipe.training.num_train_epochs = 0.5  # 24 of the 48 pairs: 3 steps, each checkpoint of the baseline past them
    launch = stages.checks(recipe)
    output = OutputDecision(str(baseline / "checkpoint-4"), False)
    with pytest.raises(ConfigError, match="was saved at step 4, and the run ends at step 3 "):
        stages.load_data(recipe, launch, say=False, output=output)


@pytest.mark.slow
def test_a_rerun_over_an_unfinished_run_with_no_checkpoint_says_it_trains_again_from_step_1(
    baseline, tmp_path, tiny_model_dir, pairs, capsys
):
    """A `--save_strategy no` run killed before its end was trained again from step 1 in silence."""
    out = unfinished(baseline, tmp_path)
    for name in ("checkpoint-2", "checkpoint-4"):
        shutil.rmtree(out / name)
    run_files.disown(out, ["checkpoint-2", "checkpoint-4"])  # never saved: its record names none (else: moved away)
    recipe = parse_args([*command(out, tiny_model_dir, pairs)[2:], "--save_strategy", "no"])
    assert check_output_dir(recipe, 8) == OutputDecision(None, False)
    assert (
        f"note: output_dir {out} holds an unfinished run with no checkpoint (save_strategy no): training again from "
        "step 1"
    ) in capsys.readouterr().out


@pytest.mark.slow
def test_a_renamed_checkpoint_is_not_resumed_as_the_step_its_name_says(
    baseline, tmp_path, tiny_model_dir, pairs, capsys
):
    """checkpoint-2 moved to checkpoint-4: the run said "Resuming from .../checkpoint-4" and resumed at step 2 (its
    trainer_state.json), while rotation and the records went by the name. It cannot be verified as step 4."""
    out = unfinished(baseline, tmp_path)
    shutil.rmtree(out / "checkpoint-4")
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-4")
    why = "its trainer_state.json was saved at step 2 (renamed from checkpoint-2?): give it back its name"
    recipe = parse_args(command(out, tiny_model_dir, pairs)[2:])
    assert check_output_dir(recipe, 8).resume_from == str(out / "checkpoint-2")
    assert (
        f"Not resuming from {out / 'checkpoint-4'}: {why}; trying the checkpoint before it" in capsys.readouterr().out
    )
    named = parse_args(
        [*command(out, tiny_model_dir, pairs)[2:], "--resume_from_checkpoint", str(out / "checkpoint-4")]
    )
    with pytest.raises(ConfigError) as refused:
        check_output_dir(named, 8)
    assert str(refused.value) == (
        f"resume_from_checkpoint {str(out / 'checkpoint-4')!r} cannot be verified ({why}): pass "
        f"--resume_from_checkpoint {out / 'checkpoint-2'}, the newest verified checkpoint beside it"
    )
    shutil.rmtree(out / "checkpoint-2")  # moved, not copied: nothing left to resume from
    with pytest.raises(ConfigError, match=f"no checkpoint left to resume from \\(checkpoint-4: {why[:30]}"):
        check_output_dir(recipe, 8)


@pytest.mark.slow
def test_a_checkpoint_linked_into_the_folder_is_refused_at_start_and_resumed_once_moved_in(
    baseline, tmp_path, tiny_model_dir, pairs
):
    """The run's checkpoint-4 moved to other storage and linked back (cut short there: a copy without its mark): the
    rerun resumed from checkpoint-2, trained step 3 and 4, then ended in `OSError: Cannot call rmtree on a symbolic
    link` as it cleared checkpoint-4 to save it, at every requeue. A checkpoint-N link is refused at start, run and dry
    run, in one line with the two fixes; the first fix done, the run resumes to the uninterrupted run's weights."""
    out, elsewhere = unfinished(baseline, tmp_path), tmp_path / "scratch"
    elsewhere.mkdir()
    shutil.move(out / "checkpoint-4", elsewhere / "checkpoint-4")
    (elsewhere / "checkpoint-4" / "COMPLETE").unlink()
    (out / "checkpoint-4").symlink_to(elsewhere / "checkpoint-4")
    there = sorted(p.name for p in (elsewhere / "checkpoint-4").iterdir())
    refused = train(out, tiny_model_dir, pairs)
    assert refused.returncode == 2 and "Traceback" not in refused.stdout, refused.stdout[-3000:]
    fix = f"rm {out / 'checkpoint-4'} && mv {elsewhere / 'checkpoint-4'} {out / 'checkpoint-4'}"
    assert refused.stdout.strip().splitlines()[-1] == (
        f"error: output_dir {str(out)!r} holds checkpoint-4, a link to {elsewhere / 'checkpoint-4'}: a run resumes "
        "from, rotates and writes only checkpoint folders it wrote there, never through a link (which it can neither "
        f"verify as its own nor delete): put the folder itself there ({fix}), or move the link out of the output folder"
    )
    assert sorted(p.name for p in (elsewhere / "checkpoint-4").iterdir()) == there and logged_steps(out) == [1, 2, 3, 4]
    assert subprocess.run(fix, shell=True).returncode == 0
    resumed = train(out, tiny_model_dir, pairs)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"Not resuming from {out / 'checkpoint-4'}" in resumed.stdout  # no mark: the one before it
    assert_same_weights(out, baseline)


def test_a_saved_data_sets_identity_is_its_training_splits_data_not_the_caches_beside_it(tmp_path):
    import datasets

    from dpotrain.data import data_identity

    def save(rows):
        pairs = [{"chosen": f"good {i}", "rejected": f"bad {i}"} for i in rows]
        datasets.DatasetDict({"train": datasets.Dataset.from_list(pairs)}).save_to_disk(str(tmp_path / "saved"))

    save(range(8))
    recorded = data_identity.of_files(data_identity.files(str(tmp_path / "saved"), "train"))
    (tmp_path / "saved" / "train" / "cache-0123456789abcdef.arrow").write_bytes(b"written by a map")
    assert data_identity.changed(recorded, str(tmp_path / "saved"), "train") is None
    save([0, 1, 2, 3, 4, 5, 6, 9])  # one pair replaced by another of the same length
    assert "other content" in data_identity.changed(recorded, str(tmp_path / "saved"), "train")


# --- records and caches read back, damaged ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_damaged_record_of_the_run_is_refused_in_one_line_naming_it(baseline, tmp_path, tiny_model_dir, pairs):
    """A record the rerun reads at start (written whole, renamed into place), damaged by a disk or a copy cut short:
    every rerun, a requeue's too, ended in a JSONDecodeError traceback."""
    out = unfinished(baseline, tmp_path)
    whole = json.dumps({"guard": "loss", "step": 3, "message": "loss is nan", "fatal": False}, indent=2)
    (out / "health_stop.json").write_text(whole[: len(whole) // 2])
    result = train(out, tiny_model_dir, pairs)
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and "Traceback" not in result.stdout and len(errors) == 1, result.stdout[-3000:]
    assert errors[0].startswith(f"error: {out / 'health_stop.json'} is unreadable (JSONDecodeError: "), errors[0]
    assert "Data (train)" not in result.stdout  # refused before anything loaded


@pytest.mark.slow
def test_a_damaged_run_record_is_written_anew_where_the_checkpoint_carries_its_own(
    baseline, tmp_path, tiny_model_dir, pairs
):
    """The run folder's resolved_config.json cut short: the resume compares with the copy its checkpoint carries (in
    its manifest), and the run writes its record whole again; no traceback, no refusal."""
    out = unfinished(baseline, tmp_path)
    text = (out / "resolved_config.json").read_text()
    (out / "resolved_config.json").write_text(text[: len(text) // 2])
    result = train(out, tiny_model_dir, pairs)
    assert result.returncode == 0 and "Traceback" not in result.stdout, result.stdout[-3000:]
    assert "Resuming from" in result.stdout
    assert json.loads((out / "resolved_config.json").read_text())["derived"]["resumed_from"]


@pytest.mark.slow
def test_a_damaged_length_cache_is_removed_and_measured_again(tmp_path, tiny_model_dir, pairs, cli):
    """The analyzer's cache (per-row token lengths), cut short as a node lost mid-write on a file system that does
    not keep renames whole leaves it: every run reading it (the lengths stage, `max_length: auto`) ended in a
    BadZipFile traceback."""
    assert cli.main([str(pairs), "--tokenizer", tiny_model_dir, "--config", str(ROOT / "configs" / "smoke.yaml")]) == 0
    [lengths] = (Path(os.environ["DPOTRAIN_CACHE"]) / "lengths").glob("*.npz")
    lengths.write_bytes(lengths.read_bytes()[:200])
    out = tmp_path / "run"
    result = train(out, tiny_model_dir, pairs, "--max_length", "auto", "--max_steps", "2", "--save_strategy", "no")
    assert result.returncode == 0 and "Traceback" not in result.stdout, result.stdout[-3000:]
    assert result.stdout.count(f"warning: the length cache file {lengths} is damaged (BadZipFile: ") == 1
    assert "it is removed and its lengths are measured again by the next analysis" in result.stdout
    with np.load(lengths) as whole:  # written again, whole, by the run's own analysis (`max_length: auto`)
        assert len(whole["chosen"]) == 48


@pytest.mark.slow
def test_datasets_copy_of_the_pairs_losing_its_arrow_file_after_the_dry_run_is_made_again(
    tmp_path, tiny_model_dir, pairs
):
    """A cleaner of old files (/scratch or /tmp purges) removed the Arrow copy datasets made of the pairs at the dry
    run and left its dataset_info.json beside it: datasets took the copy as made, and the run (a requeue alike) ended
    in 'error: could not read dataset file ...: FileNotFoundError: ... json-train.arrow', naming the data file, which
    was whole, and no fix. The copy is made again, said in one line, and the run trains."""
    env = {"HF_DATASETS_CACHE": str(tmp_path / "hf")}
    out, short = tmp_path / "run", ("--save_strategy", "no")
    dry = train(out, tiny_model_dir, pairs, *short, "--dry-run", env=env)
    assert dry.returncode == 0, dry.stdout[-3000:]
    [copy] = (tmp_path / "hf").rglob("json-train.arrow")
    copy.unlink()
    result = train(out, tiny_model_dir, pairs, *short, env=env)
    assert result.returncode == 0 and "Traceback" not in result.stdout, result.stdout[-3000:]
    said = f"warning: datasets' copy of {pairs} in {copy.parent} has lost files since it was made ({copy.name}"
    assert result.stdout.count(said) == 1, result.stdout[-3000:]
    assert copy.is_file()


# Another job writing the same cache: a temporary file written and renamed into place, in a folder of its own.
CACHE_WRITER = """
import os, sys
cache = sys.argv[1]
while True:
    for i in range(50):
        folder = os.path.join(cache, "reference", f"part-{i}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, ".lengths.npz.tmp"), "wb") as f:
            f.write(b"x" * 100)
        os.replace(os.path.join(folder, ".lengths.npz.tmp"), os.path.join(cache, "lengths", f"lengths-{i}.npz"))
        os.rmdir(folder)
"""


@pytest.mark.slow
def test_the_caches_line_counts_a_cache_another_job_writes_meanwhile(tmp_path, monkeypatch):
    """The dry run's `caches:` line and the analyzer's `Caches:` line sum the files of ~/.cache/dpotrain
    (DPOTRAIN_CACHE) and of datasets' copy of the pairs, which other jobs on the same caches write meanwhile (a run's
    reference log-probs, datasets' maps of the same pairs): a file renamed away between its listing and its size ended
    the dry run, its plan made, in a FileNotFoundError traceback (within 1.5 s of another process writing there)."""
    from dpotrain.data import lengths

    cache = tmp_path / "cache"
    (cache / "lengths").mkdir(parents=True)
    (cache / "lengths" / "kept.npz").write_bytes(b"x" * 1000)
    monkeypatch.setenv("DPOTRAIN_CACHE", str(cache))
    writer = subprocess.Popen([sys.executable, "-c", CACHE_WRITER, str(cache)])
    try:
        deadline = time.time() + 5
        while time.time() < deadline:
            said = lengths.written_outside()
            assert said and f"in {cache} (this project's" in said, said
    finally:
        writer.kill()
        writer.wait()


def test_the_caches_line_counts_only_this_projects_files_in_a_cache_folder_shared_with_other_projects(
    tmp_path, monkeypatch
):
    """DPOTRAIN_CACHE set to a folder other projects cache in too (`~/.cache`, a group's /scratch/cache): the dry
    run's and the analyzer's line counted every file under it as "this project's length analyses and reference
    log-probs" (here another project's 3 MiB, beside this project's 1,000 bytes), walking all of it at each start.
    The project writes only its two folders there (`lengths/`, `reference/`), and counts those."""
    from dpotrain.data import lengths
    from dpotrain.recipe.errors import size

    shared = tmp_path / "cache"
    (shared / "other-project").mkdir(parents=True)
    (shared / "other-project" / "weights.bin").write_bytes(b"x" * (3 << 20))
    (shared / "notes.txt").write_text("another tool's\n")
    monkeypatch.setenv("DPOTRAIN_CACHE", str(shared))
    assert lengths.written_outside() is None  # nothing of this project's there yet
    (shared / "lengths").mkdir()
    (shared / "lengths" / "analysis.npz").write_bytes(b"x" * 600)
    (shared / "reference" / "key").mkdir(parents=True)
    (shared / "reference" / "key" / "complete.npz").write_bytes(b"x" * 400)
    assert lengths.written_outside() == (
        f"{size(1000)} in {shared} (this project's length analyses and reference log-probs: DPOTRAIN_CACHE places it "
        "elsewhere)"
    )


@pytest.mark.slow
def test_a_checkpoint_that_did_not_fit_is_said_while_other_ranks_still_write_in_it(tmp_path):
    """A save refused on one rank is said (`disk_full.save_failed`) while the other ranks may still be writing their
    shards in the same checkpoint folder: a file renamed away between its listing and its size ended the message's
    own making in a FileNotFoundError (rglob, then stat), in place of the one line."""
    from dpotrain.train import disk_full

    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 1000)
    writer = subprocess.Popen([sys.executable, "-c", CACHE_WRITER, str(folder)])
    try:
        deadline = time.time() + 3
        while time.time() < deadline:
            said = str(disk_full.save_failed(folder, disk_full.FULL[errno.ENOSPC]))
            assert "checkpoint-2" in said and "written before it failed" in said, said
    finally:
        writer.kill()
        writer.wait()


@pytest.mark.slow
def test_a_requeue_of_the_slurm_job_that_finished_the_run_trains_nothing_and_removes_nothing(
    tmp_path, tiny_model_dir, pairs, monkeypatch, capsys
):
    """Slurm requeued a job (--requeue: its node lost, a preemption past its grace time) after its run had written
    run_complete.json, while the process was still ending (the lock's release, W&B's last upload). The requeued start
    was refused with exit code 2 ("already holds a finished run: ... or --overwrite_output_dir to replace it"), the job
    FAILED and its `afterok` dependents never started; with --overwrite_output_dir in the job's command it deleted the
    finished model and trained it again. Now it says the run is finished and ends with 0, removing nothing; another
    job's start on the folder is refused as before.
    The job's recipe edited after its run finished (the next experiment's, or more steps before `scontrol requeue`):
    the requeue said "nothing to do" and ended with 0, and nothing said that the steps and beta it now asks for were
    never trained. It still trains nothing (the run is this job's), and says which settings differ.
    As a job launches it (`accelerate launch`, 2 processes), every rank printed "holds the run this Slurm job (...)
    finished ...: nothing to do", one line per GPU in the job's log. The main process says it; the job ends with 0."""
    out, short = tmp_path / "run", ("--save_strategy", "no")
    first = train(out, tiny_model_dir, pairs, *short, env={"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0"})
    assert first.returncode == 0, first.stdout[-3000:]
    kept = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    # The killed start's lock, left (its process on another node, not refreshed since): taken over, then released.
    holder = {**run_lock.holder_record(), "host": "gpu-node-17", "slurm_job_id": "4242", "slurm_restart_count": 0}
    (out / run_lock.LOCK_FILE).write_text(json.dumps(holder, indent=1))
    requeued = {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "1"}
    for flags in ((), ("--overwrite_output_dir", "true")):
        again = train(out, tiny_model_dir, pairs, *short, *flags, env=requeued)
        assert again.returncode == 0 and "Traceback" not in again.stdout, again.stdout[-3000:]
        said = f"output_dir {out} holds the run this Slurm job (4242) finished before it was requeued: nothing to do"
        assert said in again.stdout, again.stdout[-3000:]
        assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == kept
    # The same requeue as a job launches it: 2 processes
    launch = [*accelerate_launch(), "--config_file", str(ROOT / "accelerate_config.yaml"), "--num_processes", "2"]
    cmd = [*launch, *rank_python(), *command(out, tiny_model_dir, pairs)[1:], *short]
    path = f"{os.path.dirname(PYTHON)}:{os.environ['PATH']}"
    env = {**os.environ, **requeued, "PATH": path}
    launched = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert launched.returncode == 0, launched.stdout[-3000:]
    assert launched.stdout.count(said) == 1, launched.stdout[-3000:]  # the main process's line alone
    # Another job's start on the finished run is refused, and leaves the folder as it found it
    before = listing(out)
    other = train(out, tiny_model_dir, pairs, *short, env={"SLURM_JOB_ID": "777", "SLURM_RESTART_COUNT": "0"})
    assert other.returncode == 2 and "already holds a finished run" in other.stdout, other.stdout[-3000:]
    assert listing(out) == before

    # The job's recipe edited since: nothing trained, the settings that differ said
    for name, value in requeued.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    same = parse_args([*command(out, tiny_model_dir, pairs)[2:], *short])
    assert check_output_dir(same, 8) == OutputDecision(None, False, finished_by="4242")
    assert "note:" not in capsys.readouterr().out  # the same command: nothing else to say
    edited = parse_args([*command(out, tiny_model_dir, pairs)[2:], *short, "--max_steps", "6", "--beta", "0.1"])
    assert check_output_dir(edited, 8) == OutputDecision(None, False, finished_by="4242")
    said = capsys.readouterr().out
    assert (
        "note: the settings differ from those of the run this job finished (max_steps: 4 -> 6; beta: 5.0 -> 0.1), and "
        "nothing is trained with them: to train them, submit a job with a new --output_dir"
    ) in said, said
    # Its record damaged since (a copy cut short): nothing to compare; the requeue ends as it did, not on that record
    record = out / "resolved_config.json"
    whole = record.read_text()
    record.write_text(whole[:100])
    assert check_output_dir(edited, 8) == OutputDecision(None, False, finished_by="4242")
    record.write_text(whole)

    # Killed while pushing the finished run (run_complete.json is written before the push): the requeue pushes.
    hub_push.record_push(out, branch="main", status="started", repo="me/run")
    recipe = parse_args([*command(out, tiny_model_dir, pairs)[2:], *short, "--push_to_hub", "true"])
    assert check_output_dir(recipe, 8) == OutputDecision(None, False, push_left="me/run")


def test_a_requeue_of_the_job_that_finished_the_run_reads_none_of_its_inputs(tmp_path, monkeypatch, capsys):
    """The job's data file and model moved away once its run finished (archived, a scratch purge), or its recipe edited
    for the next experiment to name files not made yet: the requeue of the job that finished the run was refused by the
    checks, which read them first (`error: dataset ... does not exist`, exit 2), and by launch.sh's dry run before
    them: the job FAILED, its `afterok` dependents never started. It trains nothing, so it reads nothing: exit 0, and
    the dry run prints no plan (launch.sh launches the processes, which say it and release the lock). So does a rerun
    completing the run's final push cut short, the job's requeue or not: it was refused the same way, the push never
    made."""
    import train_dpo

    out = tmp_path / "run"
    out.mkdir()
    (out / "run_complete.json").write_text(json.dumps({"global_step": 4, "slurm_job_id": "4242"}))
    kept = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    gone = ["--model_name_or_path", str(tmp_path / "archived-model"), "--dataset_name", str(tmp_path / "pairs.jsonl")]
    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), *gone, "--output_dir", str(out)]
    said = f"output_dir {out} holds the run this Slurm job (4242) finished before it was requeued: nothing to do\n"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    capsys.readouterr()
    assert train_dpo.main([*args, "--dry-run", "--json"]) is None  # launch.sh's: exit 0, no JSON
    assert capsys.readouterr() == (("", said))
    assert train_dpo.main(args) is None  # exit 0
    assert capsys.readouterr().out == said
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == kept  # its lock taken over and released
    # Another job's start, or this job's first: refused, the finished run said first (from the folder's records, as
    # the run's own refusal needs none of its inputs); its dry run reads them, to list what the run would refuse
    for job, restart in (("777", "1"), ("4242", "0")):
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_RESTART_COUNT", restart)
        with pytest.raises(ConfigError, match="already holds a finished run: pass --output_dir for a new run"):
            train_dpo.main(args)
        capsys.readouterr()
        with pytest.raises(ConfigError, match="does not exist"):
            train_dpo.main([*args, "--dry-run"])
        assert f"warning: the run would refuse: output_dir {str(out)!r} already holds a finished run: pass" in (
            capsys.readouterr().err
        )
    # Its final push cut short (the record of its start, written before run_complete.json): the rerun asked to push
    # completes that push, training nothing, so it read none of them either; it was refused the same way, its dry run
    # too. Offline here: the push is left to the command it names.
    hub_push.record_push(out, step=4, branch="main", status="started", repo="me/run")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", "hf_requeue")
    pushing = [*args, "--push_to_hub", "true"]
    for job, restart in (("4242", "1"), ("777", "0")):  # the job's requeue, or any rerun: the record alone decides
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_RESTART_COUNT", restart)
        capsys.readouterr()
        assert train_dpo.main([*pushing, "--dry-run", "--json"]) is None  # no plan: launch.sh launches the processes
        assert capsys.readouterr() == (
            "",
            f"output_dir {out}: a finished run whose push to me/run was started and not confirmed: the run pushes it, "
            "and trains nothing\n",
        )
        assert train_dpo.main(pushing) is None  # exit 0
        said = capsys.readouterr().out
        command = f"`python scripts/push_to_hub.py {out} --repo-id me/run`"
        assert f"nothing was pushed: push from a machine that reaches the Hub with {command}" in said, said
        assert "does not exist" not in said
    monkeypatch.setenv("RANK", "1")  # another rank of the launch: it ends with 0, saying and pushing nothing
    assert train_dpo.main(pushing) is None
    assert capsys.readouterr() == ("", "")
    assert [r["status"] for r in hub_push.read_pushes(out)] == ["started"]
