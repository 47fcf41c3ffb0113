"""Issue #42: a run owns only its own files, one run per output folder, and no command writes over its own input.

Each test acts out the fault as it happens (a second run started on the same folder, a run killed with SIGKILL, a
user's files in the way) on the tiny model, and asserts that nothing that was not the run's was lost."""

import errno
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from unittest import mock

import pytest

from conftest import (
    PAUSE_AT,
    PYTHON,
    ROOT,
    in_child,
    pause_env,
    paused_pid,
    python,
    run_train,
    sealed_checkpoint,
    start_child,
)
from dpotrain import output_folder
from dpotrain.cluster import run_lock
from dpotrain.recipe import writes
from dpotrain.recipe.errors import ConfigError
from dpotrain.train import run_files
from dpotrain.train.metrics import read_metrics
from dpotrain.train.resume import HEALTH_STOP

SMOKE = str(ROOT / "configs" / "smoke.yaml")


def env_for(tiny_model_dir, **extra) -> dict:
    return {"DPOTRAIN_BUILTIN_DIR": str(Path(tiny_model_dir).parent), **extra}


def train_args(out, *args) -> list[str]:
    return [
        "--config",
        SMOKE,
        "--dataset_name",
        str(ROOT / "data" / "smoke_prefs.jsonl"),
        "--output_dir",
        str(out),
        "--report_to",
        "none",
        *args,
    ]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` by its path and content digest: what a person would miss."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def refusal(result) -> str:
    assert result.returncode == 2 and "Traceback" not in result.stdout, result.stdout[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("error: ")
    return last


def a_users_files(folder: Path) -> None:
    """What a person keeps beside (or in) a run: notes, evaluations of its checkpoints, a model card of their own."""
    (folder / "evals").mkdir(parents=True, exist_ok=True)
    (folder / "evals" / "step-2.json").write_text('{"mmlu": 0.31}\n')
    (folder / "notes.md").write_text("lr too high? compare with run b\n")


# --- the user's files -------------------------------------------------------------------------------------------------


def checkpoint_named_files(folder: Path) -> None:
    """A person's files whose names start as a checkpoint's: evals and samples of one, a note, a backup copy."""
    (folder / "checkpoint-4-evals.json").write_text('{"gsm8k": 0.12}\n')
    (folder / "checkpoint-6.md").write_text("step 6 looked best\n")
    (folder / "checkpoint-2-samples").mkdir()
    (folder / "checkpoint-2-samples" / "0.txt").write_text("a sample\n")
    (folder / "checkpoint-4.bak").mkdir()
    (folder / "checkpoint-4.bak" / "model.safetensors").write_bytes(b"a backup")


@pytest.mark.slow
def test_the_replacement_line_counts_files_folders_and_others_each_in_its_number(tmp_path, capsys):
    """It read "removed its 1 own file(s) and folder(s); kept 1 others (notes.md)"."""
    (tmp_path / "checkpoint-2").mkdir()
    for name in ("run_complete.json", "notes.md"):
        (tmp_path / name).write_text("{}\n")
    output_folder.replace(tmp_path, ["run_complete.json"])
    replaced = f"Replaced the run in {tmp_path}: removed "
    assert replaced + "1 file of its own; kept 2 others (checkpoint-2, notes.md)\n" in capsys.readouterr().out
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    output_folder.replace(tmp_path, ["checkpoint-2", "metrics.jsonl", "gone.json"])
    assert replaced + "1 file and 1 folder of its own; kept 1 other (notes.md)\n" in capsys.readouterr().out
    output_folder.replace(tmp_path, ["gone.json"])
    assert replaced + "nothing of its own; kept 1 other (notes.md)\n" in capsys.readouterr().out


@pytest.mark.slow  # trains three times (three train_dpo.py runs): the full suite (CI) runs it
def test_overwrite_replaces_only_the_runs_own_files(tmp_path, tiny_model_dir):
    """Two replacements of a finished run by --overwrite_output_dir, each keeping a person's files: one that saves no
    checkpoint (the old run's go, the person's stay), then one that keeps its best checkpoint. With
    --metric_for_best_model and save_total_limit 1, at the end of training transformers deleted every `checkpoint-*`
    folder of output_dir but the best one (Trainer._finalize_training), a person's checkpoint-4.bak/ and
    checkpoint-2-samples/ and a checkpoint-N copied in too, after the run had said it kept that one ("Kept
    checkpoint-9 ...: not this run's, never rotated"). The run's rotation alone deletes, among its own."""
    out = tmp_path / "run"
    first = run_train(
        train_args(out, "--max_steps", "2", "--save_steps", "1", "--save_total_limit", "1"), env=env_for(tiny_model_dir)
    )
    assert first.returncode == 0, first.stdout[-3000:]
    # Each checkpoint by name as it was saved; checkpoint-1, which rotation deleted, is no longer the run's.
    names = output_folder.read_manifest(out)
    assert "checkpoint-2" in names and "checkpoint-1" not in names and not [n for n in names if "*" in n], names
    a_users_files(out)
    checkpoint_named_files(out)
    users = {
        k: v
        for k, v in snapshot(out).items()
        if k.startswith(
            (
                "evals/",
                "notes.md",
                "checkpoint-4-evals.json",
                "checkpoint-6.md",
                "checkpoint-2-samples/",
                "checkpoint-4.bak/",
            )
        )
    }
    assert len(users) == 6
    old_complete = (out / "run_complete.json").read_text()
    # A health guard's stop record is the run's too: the replacing run (the command the stop suggests) removes it, or
    # the new run's own rerun would be refused on the old run's stop.
    (out / HEALTH_STOP).write_text('{"guard": "step1", "step": 1}\n')
    # A replacement that saves no checkpoint: the old run's checkpoints must go, the user's files must stay.
    second = run_train(
        train_args(out, "--max_steps", "3", "--save_strategy", "no", "--logging_steps", "1", "--overwrite_output_dir"),
        env=env_for(tiny_model_dir),
    )
    assert second.returncode == 0, second.stdout[-3000:]
    after = snapshot(out)
    assert {k: after.get(k) for k in users} == users  # the notes and evals, byte for byte
    assert not (out / "checkpoint-2").exists() and not (out / HEALTH_STOP).exists()  # the old run's own, removed
    assert json.loads(old_complete)["global_step"] == 2
    assert json.loads((out / "run_complete.json").read_text())["global_step"] == 3
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 3]  # each step once, none of the old run
    assert (
        "Replaced the run in" in second.stdout
        and ("kept 6 others (checkpoint-2-samples, checkpoint-4-evals.json, checkpoint-4.bak, checkpoint-6.md, evals)")
        in second.stdout
    )
    # The new run's record names its own files and none of the user's.
    names = output_folder.read_manifest(out)
    assert "model.safetensors" in names and not {"notes.md", "evals", "checkpoint-4.bak"} & set(names)
    assert not (out / run_lock.LOCK_FILE).exists()

    # The second replacement, of that run, keeps its best checkpoint: no folder of the person's is deleted at the end.
    held = tmp_path / "held.jsonl"
    held.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[:8]))
    sealed_checkpoint(out / "checkpoint-9")  # a person's copy, past max_steps
    users = {k: v for k, v in snapshot(out).items() if k.startswith(("checkpoint-", "checkpoint-9/"))}
    best = ["--eval_strategy", "steps", "--eval_steps", "1", "--dataset_mixer_eval_list", str(held), "1.0"]
    best += ["--metric_for_best_model", "eval_loss", "--save_steps", "1", "--save_total_limit", "1"]
    third = run_train(train_args(out, "--max_steps", "3", *best, "--overwrite_output_dir"), env=env_for(tiny_model_dir))
    assert third.returncode == 0, third.stdout[-3000:]
    after = snapshot(out)
    assert {k: after.get(k) for k in users} == users, sorted(p.name for p in out.iterdir())
    assert (out / "checkpoint-3" / "COMPLETE").is_file()  # the run's newest complete one (its eval_loss the best)


@pytest.mark.slow
def test_a_users_file_written_while_the_final_model_is_saved_stays_the_users(tmp_path, tiny_model_dir):
    """Issue #53: the final save claimed every name whose modification time moved while `save_model` ran, a person's
    file written then among them, and a later --overwrite_output_dir deleted it. A person's tool (an evaluation that
    rewrites its results) writes in the folder from the run's start to its end, and a note is put there before the
    final save: run_files.json names neither, and the replacing run keeps both. That run also names the folder through
    the run's checkpoint and back, and replaces the run whole (one replacement for both claims)."""
    out, paused = tmp_path / "run", tmp_path / "paused"
    args = train_args(out, "--max_steps", "2", "--save_steps", "2", "--logging_steps", "1")
    log = tmp_path / "run.log"
    # The run stops itself as the final save opens its config.json (in FINAL_STAGING, moved in after:
    # save_pretrained's first file, before the weights; tests/helpers/pause_at.py), and the tool writes then: inside
    # the save however the machine runs. A tool polling on its own (every 2 ms) could sleep through the whole final
    # save (~0.1 s) on a loaded machine, and the check that it wrote during the save failed.
    pause = pause_env("", f"{out}/{output_folder.FINAL_STAGING}/config.json", paused)
    env = {**os.environ, **env_for(tiny_model_dir), **pause}
    with open(log, "w") as sink:  # the warm interpreter: what is timed here is the save, not the start
        run = subprocess.Popen([python(), str(PAUSE_AT), *args], env=env, stdout=sink, stderr=subprocess.STDOUT)

    def write_until(done) -> None:  # the tool, rewriting its results every ~2 ms
        while run.poll() is None and not done():
            (out / "live-eval.json").write_text(json.dumps({"written": time.time_ns()}) + "\n")
            time.sleep(0.002)

    try:
        end = time.monotonic() + 600
        while not (out / run_files.MANIFEST).exists():
            assert run.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
            time.sleep(0.01)
        (out / "note.md").write_text("written before the final save\n")
        write_until(paused.exists)
        try:
            pid = paused_pid(paused, run)
        except (AssertionError, AttributeError):  # the run ended first: its log (paused_pid reads a pipe's)
            raise AssertionError(log.read_text()[-3000:]) from None
        (out / "live-eval.json").write_text(json.dumps({"written": "during the final save"}) + "\n")
        during = (out / "live-eval.json").stat().st_mtime_ns
        os.kill(pid, signal.SIGCONT)
        write_until((out / "run_complete.json").exists)
        assert run.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        run.kill()
    # A write came inside the final save: before its config.json, after its start.
    assert (out / "config.json").stat().st_mtime_ns >= during
    names = output_folder.read_manifest(out)
    assert "model.safetensors" in names and "config.json" in names, names
    assert not {"live-eval.json", "note.md"} & set(names), names
    users = {k: v for k, v in snapshot(out).items() if k in ("live-eval.json", "note.md")}
    # The replacing run names the folder through one of the run's checkpoints and back: `run/checkpoint-2/..` is `run`
    # only while checkpoint-2 exists. The replacement deleted it first, then every path through it failed; the run
    # ended "deleted or moved away", its old run half removed and its lock left.
    assert (out / "checkpoint-2").is_dir()
    back = f"{out}/checkpoint-2/.."
    again = run_train(train_args(back, "--max_steps", "3", "--overwrite_output_dir"), env=env_for(tiny_model_dir))
    assert again.returncode == 0, again.stdout[-3000:]
    assert {k: snapshot(out).get(k) for k in users} == users and len(users) == 2
    assert json.loads((out / "run_complete.json").read_text())["global_step"] == 3
    assert (out / "model.safetensors").is_file() and (out / "checkpoint-3").is_dir()
    assert not (out / "checkpoint-2").exists() and not (out / run_lock.LOCK_FILE).exists()


def test_a_folder_a_file_browser_has_shown_is_an_empty_one(tmp_path):
    # Finder's .DS_Store, Jupyter's .ipynb_checkpoints: `mkdir outputs/x`, opened once, was refused as a folder that
    # holds files that are not a run's, which a run would write over (it never writes those names)
    out = tmp_path / "outputs" / "mine"
    (out / ".ipynb_checkpoints").mkdir(parents=True)
    (out / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    output_folder.check(str(out), lock=False)
    (out / "notes.txt").write_text("mine\n")  # a file of the person's own is still refused
    with pytest.raises(ConfigError, match=r"holds files that are not a run's \(1: notes.txt\)"):
        output_folder.check(str(out), lock=False)


@pytest.mark.slow
def test_a_folder_that_holds_files_but_no_run_is_refused_whatever_the_flags(tmp_path, tiny_model_dir):
    # `--output_dir .` in a project, as in the issue: its README.md and config.json would have been replaced.
    project = tmp_path / "project"
    project.mkdir()
    (project / "README.md").write_text("# my project\n")
    (project / "config.json").write_text('{"model_type": "mine"}\n')
    (project / "metrics.jsonl").write_text("not a run's metrics\n")  # a user's file by a name the run writes
    before = snapshot(project)
    for flags in ([], ["--overwrite_output_dir"]):
        result = run_train(train_args(".", "--max_steps", "1", *flags), cwd=project, env=env_for(tiny_model_dir))
        line = refusal(result)
        assert "holds files that are not a run's (3: README.md, config.json, metrics.jsonl)" in line, line
        assert "Loading" not in result.stdout and "Map" not in result.stdout  # refused before anything loaded
        assert snapshot(project) == before
    # The dry run says the same before a job is submitted: it plans, and lists the run's refusal last.
    dry = run_train(train_args(".", "--dry-run"), cwd=project, env=env_for(tiny_model_dir)).stdout
    assert "the run would refuse" in dry and "holds files that are not a run's" in dry, dry[-2000:]
    assert snapshot(project) == before


@pytest.mark.slow
def test_an_output_dir_that_is_a_file_is_refused_before_anything_loads(tmp_path, tiny_model_dir):
    target = tmp_path / "model.bin"
    target.write_bytes(b"weights I need")
    result = run_train(train_args(target, "--max_steps", "1"), env=env_for(tiny_model_dir))
    assert "is a file, not a folder" in refusal(result)
    # before anything loads: not the data stage's line (the first stage that reads a file) nor datasets' progress
    assert "Data (train)" not in result.stdout and "Map" not in result.stdout, result.stdout[-3000:]
    assert target.read_bytes() == b"weights I need"


def test_a_run_whose_folder_the_replacement_cannot_remove_is_refused_before_anything_is_removed(tmp_path):
    """--overwrite_output_dir over a finished run one of whose checkpoints is read-only (kept with chmod -R a-w, or
    another user's): the replacement removed run_complete.json and the card, then ended at that checkpoint
    (`permission is denied: .../checkpoint-2/COMPLETE could not be written`), the finished run left unfinished. Now
    refused in one line before anything is removed, the run as it was."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    out = tmp_path / "run"
    run_files.write(out, [run_files.MANIFEST, "run_complete.json", "README.md", "checkpoint-2", "checkpoint-4"])
    for step in (2, 4):
        sealed_checkpoint(out / f"checkpoint-{step}")
    (out / "run_complete.json").write_text('{"global_step": 4}\n')
    (out / "README.md").write_text("the card\n")
    before = snapshot(out)
    args = train_args(out, "--overwrite_output_dir", "--max_steps", "4", "--save_steps", "2")
    code, stdout, stderr = in_child(lambda: run_cli(lambda: train_dpo.main(args)), read_only=[out / "checkpoint-2"])
    errors = [line for line in (stdout + stderr).splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in stdout + stderr and len(errors) == 1, (stdout + stderr)[-3000:]
    assert errors[0].startswith(
        f"error: output_dir {str(out)!r} holds checkpoint-2, the replaced run's own, which this run removes first, "
        f"and cannot ({out / 'checkpoint-2'}: "
    ), errors[0]
    assert errors[0].endswith(
        f"make it writable (chmod -R u+w {out / 'checkpoint-2'}), or move it out of the folder, then rerun"
    )
    assert snapshot(out) == before


def test_a_run_written_before_runs_recorded_their_files_resumes_but_is_not_replaced(tmp_path):
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError

    out = tmp_path / "run"
    (out / "checkpoint-4").mkdir(parents=True)
    (out / "checkpoint-4" / "COMPLETE").write_text("{}")
    (out / "run_complete.json").write_text("{}")
    (out / "my-eval.json").write_text("{}")
    output_folder.check(str(out))  # a run: not refused as foreign files
    recipe = parse_args(["--config", SMOKE, "--output_dir", str(out), "--overwrite_output_dir"])
    with pytest.raises(ConfigError, match="written before runs recorded their own files"):
        output_folder.check_replaceable(recipe.training.output_dir, start_afresh=True)
    assert (out / "my-eval.json").exists() and (out / "checkpoint-4").is_dir()


def test_a_checkpoint_folder_as_output_dir_is_refused_not_trained_into(tmp_path):
    """`--output_dir outputs/x/checkpoint-4` (meant as --resume_from_checkpoint or --model_name_or_path): a checkpoint
    holds a copy of its run's resolved_config.json, so it was read as a run written before runs recorded their files,
    and the run trained there (the dry run: "the run starts there"), writing its own resolved_config.json over the
    checkpoint's (the settings a resume compares with), then its final model over the checkpoint's. Refused."""
    from dpotrain.recipe.errors import ConfigError

    checkpoint = sealed_checkpoint(tmp_path / "run" / "checkpoint-4")
    (checkpoint / "resolved_config.json").write_text("{}\n")
    before = snapshot(checkpoint)
    with pytest.raises(
        ConfigError, match=r"is a checkpoint \(trainer_state.json, COMPLETE\), not a run's folder"
    ) as no:
        output_folder.check(str(checkpoint), lock=False)
    assert f"--resume_from_checkpoint {checkpoint}; or start a new run from a copy of its weights" in str(no.value)
    assert snapshot(checkpoint) == before
    output_folder.check(str(tmp_path / "run"), lock=False)  # the folder holding it: a run written before records


def test_an_output_dir_inside_a_checkpoint_is_refused(tmp_path):
    """`--output_dir outputs/x/checkpoint-5/further` (a run going on from that checkpoint, its files kept beside it):
    the run in outputs/x then found further/checkpoint-2/optimizer.pt unlisted in checkpoint-5's manifest, resumed
    from checkpoint-4 instead and deleted checkpoint-5 as damaged, a step of its progress lost. Refused, new or not."""
    checkpoint = sealed_checkpoint(tmp_path / "run" / "checkpoint-5")
    for inside in (checkpoint / "further", checkpoint / "a" / "b"):
        with pytest.raises(ConfigError) as no:
            output_folder.check(str(inside), lock=False)
        assert str(no.value) == (
            f"output_dir {str(inside)!r} is inside the checkpoint {str(checkpoint)!r}: a run's files there make that "
            "checkpoint fail its run's checks at a resume, which then passes over it and deletes it; pass "
            "--output_dir a folder outside it"
        )
    (tmp_path / "checkpoint-7").mkdir()  # a folder only named like one: no checkpoint
    output_folder.check(str(tmp_path / "checkpoint-7" / "run"), lock=False)


def test_a_record_written_before_checkpoints_were_named_removes_only_checkpoint_folders(tmp_path):
    """Records of earlier versions hold the pattern `checkpoint-[0-9]*`: read as the folders named exactly as
    checkpoints are, never as the user's files the pattern also matched."""
    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "COMPLETE").write_text("{}")
    checkpoint_named_files(out)
    (out / run_files.MANIFEST).write_text(json.dumps({"names": ["run_files.json", "checkpoint-[0-9]*"]}))
    output_folder.replace(out, output_folder.read_manifest(out))
    kept = ["checkpoint-2-samples", "checkpoint-4-evals.json", "checkpoint-4.bak", "checkpoint-6.md", "run_files.json"]
    assert sorted(p.name for p in out.iterdir()) == kept


def test_a_persons_checkpoint_folder_where_the_run_saves_is_refused_and_never_removed(tmp_path, capsys):
    """A `checkpoint-N` a person put in a run's folder (evaluations of their own under that name) is kept by
    --overwrite_output_dir and by rotation, but the replacing run, saving at step N, removed it as "an earlier
    attempt" before writing its own there. Now refused at start (the dry run lists it); one put there while the run
    trains is moved aside at the save, never removed."""
    import train_dpo
    from dpotrain.train.checkpoints import clear_for_save

    out = tmp_path / "run"
    sealed_checkpoint(out / "checkpoint-2")
    (out / "run_complete.json").write_text('{"global_step": 2}\n')
    run_files.write(out, [run_files.MANIFEST, "run_complete.json", "checkpoint-2"])
    (out / "checkpoint-3").mkdir()
    (out / "checkpoint-3" / "evals.json").write_text('{"mmlu": 0.31}\n')
    (out / "checkpoint-9").mkdir()  # past max_steps: no save goes there
    args = train_args(out, "--overwrite_output_dir", "--max_steps", "4", "--save_steps", "3")
    train_dpo.main([*args, "--dry-run"])
    assert (
        f"warning: the run would refuse: output_dir {str(out)!r} holds checkpoint-3, which this run did not write "
        f"({run_files.MANIFEST} does not name it), where the run may save its own checkpoint of that step"
    ) in capsys.readouterr().out
    from dpotrain.recipe.errors import ConfigError

    with pytest.raises(ConfigError, match=r"holds checkpoint-3, .* move it out of the folder \(or rename it"):
        output_folder.check_checkpoints_of_others(str(out), None, 4)
    # Only the steps the run may save: past the one it resumes from, up to max_steps.
    elsewhere = sealed_checkpoint(tmp_path / "other" / "checkpoint-4")
    output_folder.check_checkpoints_of_others(str(out), str(elsewhere), 8)
    # One put there during the run: moved aside when the run saves that step, the person's file in it.
    clear_for_save(out, 3)
    (aside,) = out.glob("checkpoint-3.not-this-run-*")
    assert (aside / "evals.json").read_text() == '{"mmlu": 0.31}\n' and not (out / "checkpoint-3").exists()
    assert f"Moved {out / 'checkpoint-3'} to {aside}: not this run's" in capsys.readouterr().out
    clear_for_save(out, 2)  # the run's own, from an earlier attempt: removed as before
    assert not (out / "checkpoint-2").exists()


def test_a_resume_goes_on_only_from_the_runs_own_checkpoints(tmp_path, monkeypatch, capsys):
    """A complete `checkpoint-N` a person copied into a stopped run's folder (from another run, a backup), newer than
    the run's own, was the automatic resume's choice (the newest verified one), and a requeue's past a named
    checkpoint: the run went on from weights it never trained, and with N past max_steps finished at once, its
    final model the person's. A run resumes only from checkpoints its record names; another is passed over, said in a
    line (and refused where the run may still save that step: check_checkpoints_of_others)."""
    from dpotrain import resolve
    from dpotrain.recipe.config import parse_args

    out = tmp_path / "run"
    sealed_checkpoint(out / "checkpoint-2")
    (out / "resolved_config.json").write_text(json.dumps({"derived": {}}))  # a record with no setting to compare
    run_files.write(out, [run_files.MANIFEST, "resolved_config.json", "checkpoint-2"])
    sealed_checkpoint(out / "checkpoint-9")  # the person's, past max_steps: no save of the run's goes there
    recipe = parse_args(train_args(out, "--max_steps", "4"))
    assert resolve.check_output_dir(recipe).resume_from == str(out / "checkpoint-2")
    assert (
        f"Not resuming from {out / 'checkpoint-9'}: not this run's ({run_files.MANIFEST} does not name it)"
        in capsys.readouterr().out
    )
    output_folder.check_checkpoints_of_others(str(out), str(out / "checkpoint-2"), 4)
    # A requeue of a job given --resume_from_checkpoint goes on from the run's own progress only.
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    named = parse_args(train_args(out, "--max_steps", "4", "--resume_from_checkpoint", str(out / "checkpoint-2")))
    assert resolve.check_output_dir(named).resume_from == str(out / "checkpoint-2")
    # One at a step the run may still save: refused at the start, never resumed from nor removed.
    sealed_checkpoint(out / "checkpoint-3")
    assert resolve.check_output_dir(recipe).resume_from == str(out / "checkpoint-2")
    with pytest.raises(ConfigError, match=r"holds checkpoint-3, which this run did not write"):
        output_folder.check_checkpoints_of_others(str(out), str(out / "checkpoint-2"), 4)
    # With none of its own: nothing to resume, the person's checkpoints refused as before, not resumed from.
    shutil.rmtree(out / "checkpoint-2")
    run_files.write(out, [run_files.MANIFEST, "resolved_config.json"])
    assert resolve.check_output_dir(recipe) == resolve.OutputDecision(None, False)


@pytest.mark.parametrize("first, then", [("300KB", "50GB"), ("50GB", "300KB")])
def test_a_final_model_saved_again_in_other_shards_leaves_none_of_the_earlier_attempts_weights(
    first, then, tmp_path, tiny_model_dir, capsys
):
    """A job killed after its final model was moved in (while it waited for checkpoint uploads, before
    run_complete.json), resumed in other numerics: a 32B model is 2 shards of transformers' 50 GB in bf16, 3 in fp32,
    one file under 50 GB. The new save moved in over the names it wrote, and the earlier attempt's other weights
    stayed, recorded as the run's (pushed with it): its shards and index beside a new model.safetensors, or its
    model.safetensors beside a new index, which from_pretrained loads first: the earlier attempt's weights. Here the
    tiny model's two attempts differ in shard size alone, as the real ones differ in bytes."""
    import torch
    from transformers import AutoModelForCausalLM

    from dpotrain.recipe.config import parse_args

    out = tmp_path / "run"
    output_folder.start(parse_args(["--config", SMOKE, "--output_dir", str(out), "--report_to", "none"]), False, False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for attempt, shard_size in enumerate((first, then)):
        with torch.no_grad():
            model.lm_head.weight.fill_(attempt)  # each attempt's own weights
        model.save_pretrained(out / output_folder.FINAL_STAGING, max_shard_size=shard_size)  # as save_model writes it
        output_folder.move_in(out)
    weights = sorted(p.name for p in out.iterdir() if p.name.startswith("model"))
    model.save_pretrained(tmp_path / "again", max_shard_size=then)  # the second attempt's files, alone
    saved = sorted(p.name for p in (tmp_path / "again").iterdir() if p.name.startswith("model"))
    assert weights == saved, weights
    assert set(weights) <= set(output_folder.read_manifest(out))
    assert not [n for n in output_folder.read_manifest(out) if n.startswith("model") and n not in weights]
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.all(loaded.lm_head.weight == 1), "from_pretrained loaded the earlier attempt's weights"
    assert "of an earlier attempt's final model" in capsys.readouterr().out


def test_a_merged_model_saved_again_holds_none_of_the_earlier_attempts_files(tmp_path, tiny_model_dir):
    """A LoRA run's merged/ (merge_lora) is saved in place: a job killed after saving it (before run_complete.json) and
    resumed in other numerics saved over it, and transformers' save removes an earlier save's shards, but not its
    index, nor its model.safetensors beside new shards, which from_pretrained loads first. The earlier attempt's
    merged/ is removed whole before the save: it holds what a first save writes."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dpotrain.train import lora

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    base.save_pretrained(tmp_path / "run" / lora.MERGED_DIR, max_shard_size="300KB")  # the earlier attempt's: shards
    with lora.without_peft_deprecation():
        adapted = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"]))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    saved = {}
    for run in ("first", "run"):  # a first save, and one over the earlier attempt's
        adapted.save_pretrained(tmp_path / run)
        saved[run] = sorted(
            p.name for p in lora.save_merged(tmp_path / run, tiny_model_dir, {}, adapted, tokenizer).iterdir()
        )
    assert saved["run"] == saved["first"], saved


def test_a_readme_written_in_the_folder_of_a_run_stopped_before_its_card_stays_the_persons(tmp_path, capsys):
    """The model card and the plot were recorded as the run's when it started: a run stopped before its end had not
    written them, and a README.md a person then wrote in its folder (why it was stopped) was deleted by
    --overwrite_output_dir, or written over by the card of the resumed run. They are now recorded as they are written,
    and one of the person's found there is moved aside first, never written over; so are the final model's names."""
    from dpotrain.recipe.config import parse_args

    out = tmp_path / "run"
    lora = ["--use_peft", "true", "--lora_target_modules", "q_proj", "--merge_lora", "true"]
    recipe = parse_args(["--config", SMOKE, "--output_dir", str(out), "--report_to", "none", *lora])
    output_folder.start(recipe, start_afresh=False, pushes=False)  # as the run starts, before its first step
    assert "merged" not in output_folder.read_manifest(out)  # a LoRA run's merged model: also written at its end
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 0.69}\n')  # the run's, as it trains
    (out / "README.md").write_text("stopped at step 1: lr too high\n")  # the person's, once the run stopped
    names = output_folder.read_manifest(out)
    assert "metrics.jsonl" in names and "README.md" not in names and "training_curves.png" not in names
    output_folder.replace(out, names)  # --overwrite_output_dir
    assert sorted(p.name for p in out.iterdir()) == ["README.md", run_files.MANIFEST]

    # A resumed run writes its card there at its end, and its final model: the person's file is moved aside.
    (out / "config.json").write_text('{"mine": true}\n')
    (out / output_folder.FINAL_STAGING).mkdir()
    (out / output_folder.FINAL_STAGING / "config.json").write_text('{"model_type": "olmo3"}\n')
    output_folder.move_in(out)
    output_folder.claim_for_writing(out, ["training_curves.png", "README.md"])
    (out / "README.md").write_text("# the card\n")
    (readme,) = out.glob("README.not-this-run-*.md")
    (config,) = out.glob("config.not-this-run-*.json")
    assert readme.read_text() == "stopped at step 1: lr too high\n" and config.read_text() == '{"mine": true}\n'
    assert json.loads((out / "config.json").read_text()) == {"model_type": "olmo3"}
    assert f"Moved {out / 'README.md'} to {readme}: not this run's" in capsys.readouterr().out
    assert {"README.md", "config.json", "training_curves.png"} <= set(output_folder.read_manifest(out))
    assert not {readme.name, config.name} & set(output_folder.read_manifest(out))


def test_an_earlier_final_save_that_cannot_be_removed_is_one_line(tmp_path):
    """The run's own `.final_model` of an attempt cut short, which it cannot remove (a read-only part, a busy file on
    NFS): the OSError escaped as a traceback at the run's start, or as a failed final save after the whole training.
    One line now, naming the folder and what to do."""
    from dpotrain.recipe.errors import RunError

    out = tmp_path / "run"
    staging = out / output_folder.FINAL_STAGING
    staging.mkdir(parents=True)
    (staging / "model.safetensors").write_bytes(b"cut short")
    run_files.claim(out, [output_folder.FINAL_STAGING])

    def clear():
        try:
            output_folder.clear_final_staging(out)
        except RunError as e:
            print(f"RunError: {e}")

    code, stdout, stderr = in_child(clear, read_only=[staging])
    assert code == 0, stderr[-3000:]
    assert stdout.startswith(
        f"RunError: {staging}, an earlier attempt's final save cut short, could not be removed ("
    ), stdout
    assert stdout.rstrip().endswith("): remove it yourself, then rerun the same command"), stdout
    assert (staging / "model.safetensors").exists()


@pytest.mark.parametrize("kind", ["link", "folder"])
def test_the_final_saves_staging_folder_is_never_written_through_a_link_nor_into_a_persons_folder(
    tmp_path, capsys, kind
):
    """The final model is saved into `.final_model/`, then moved in. Each attempt's start removed what lay there
    without a look: a link (which no run makes) was left by rmtree, and the save wrote through it into the folder it
    points to, then moved that folder's files into the run's; a person's folder of that name was deleted. Now a link or
    a folder the record does not name is moved aside, said in a line, at the start and again right before the save
    (the run claims the name only as it saves)."""
    from dpotrain.recipe.config import parse_args

    out = tmp_path / "run"
    recipe = parse_args(["--config", SMOKE, "--output_dir", str(out), "--report_to", "none"])
    output_folder.start(recipe, start_afresh=False, pushes=False)  # the first attempt, stopped and requeued
    staging = out / output_folder.FINAL_STAGING
    scratch = tmp_path / "scratch"  # the person's: linked in, or their own folder of that name
    theirs = scratch if kind == "link" else staging
    for moment in ("at the requeued attempt's start", "right before its final save"):
        theirs.mkdir()
        (theirs / "config.json").write_text('{"mine": true}\n')
        if kind == "link":
            staging.symlink_to(scratch, target_is_directory=True)
        if moment.startswith("at"):
            output_folder.start(recipe, start_afresh=False, pushes=False)
        else:
            output_folder.stage_final(out)
        (aside,) = out.glob(".final_model.not-this-run-*")
        said = "a link, which no run makes" if kind == "link" else "not this run's"
        assert f"Moved {staging} to {aside}: {said}" in capsys.readouterr().out
        assert not staging.exists() and not staging.is_symlink()
        assert ((scratch if kind == "link" else aside) / "config.json").read_text() == '{"mine": true}\n'
        shutil.move(aside, tmp_path / f"kept-{moment[:2]}")  # the person takes theirs back
        if kind == "link":
            shutil.move(scratch, tmp_path / f"scratch-{moment[:2]}")
    staging.mkdir()  # the save, as `save_model` writes it
    (staging / "config.json").write_text('{"model_type": "olmo3"}\n')
    output_folder.move_in(out)
    assert json.loads((out / "config.json").read_text()) == {"model_type": "olmo3"}
    assert "config.json" in output_folder.read_manifest(out)
    assert output_folder.FINAL_STAGING not in output_folder.read_manifest(out)  # gone: no longer the run's name


def test_a_persons_file_named_as_a_record_the_resumed_run_turns_on_stays_the_persons(tmp_path):
    """samples.jsonl is the run's only where its settings sample: a run started without samples, stopped, then resumed
    with --samples_every, recorded a samples.jsonl a person had put in its folder as its own, trimmed its lines of
    the resumed step and later (keep_before), appended to it and a later --overwrite_output_dir deleted it (and
    its lines without a step refused the resume as a damaged record). A name the run turns on that its record did not
    hold is moved aside before it is recorded, as the card is."""
    from dpotrain import stages
    from dpotrain.recipe.config import parse_args

    out = tmp_path / "run"
    output_folder.start(parse_args(train_args(out)), start_afresh=False, pushes=False)  # samples_every: 0
    mine = '{"step": 0, "prompt": "2+2?", "completion": "4", "grader": "me"}\n{"note": "ask again at step 8"}\n'
    (out / "samples.jsonl").write_text(mine)
    stages.check_histories(str(out))  # not the run's: not read as one of its records
    output_folder.start(parse_args(train_args(out, "--samples_every", "8")), start_afresh=False, pushes=False)
    (aside,) = out.glob("samples.not-this-run-*.jsonl")
    assert aside.read_text() == mine and not (out / "samples.jsonl").exists()
    names = output_folder.read_manifest(out)
    assert "samples.jsonl" in names and aside.name not in names
    output_folder.replace(out, names)  # --overwrite_output_dir
    assert aside.read_text() == mine


def test_a_record_of_an_earlier_version_does_not_make_a_persons_readme_the_runs(tmp_path, capsys):
    """Records written before the card, plot and merged model were recorded as written named them from the run's
    start: a README.md a person wrote in the folder of such a run, stopped before its end, was still the run's by
    that record, written over by the card of the run resumed by this version, or deleted by --overwrite_output_dir.
    Such a record names them as the run's only where the run finished (run_complete.json)."""
    from dpotrain.recipe.config import parse_args

    out = tmp_path / "run"
    out.mkdir()
    old = ["run_files.json", "resolved_config.json", "metrics.jsonl", "training_curves.png", "README.md"]
    old += ["run_complete.json", "health_stop.json", "checkpoint-2"]
    (out / run_files.MANIFEST).write_text(json.dumps({"names": old, "written_by": "train_dpo.py"}))
    (out / "README.md").write_text("stopped at step 2: lr too high\n")  # the person's
    output_folder.replace(out, output_folder.read_manifest(out))  # --overwrite_output_dir
    assert (out / "README.md").read_text() == "stopped at step 2: lr too high\n"
    assert "README.md" not in output_folder.read_manifest(out)
    # Resumed by this version: its card, written at the end, moves the person's aside.
    output_folder.start(parse_args(train_args(out)), start_afresh=False, pushes=False)
    output_folder.claim_for_writing(out, ["training_curves.png", "README.md"])
    (readme,) = out.glob("README.not-this-run-*.md")
    assert readme.read_text() == "stopped at step 2: lr too high\n"
    # A finished run of that version wrote its card: its own.
    (out / run_files.MANIFEST).write_text(json.dumps({"names": old, "written_by": "train_dpo.py"}))
    (out / "run_complete.json").write_text('{"global_step": 4}\n')
    assert "README.md" in output_folder.read_manifest(out)


@pytest.mark.parametrize(
    "record, why",
    [
        ('{"format": 2, "names": ["run_files.json", "resol', "JSONDecodeError: Unterminated string starting at"),
        ('["run_files.json", "metrics.jsonl"]', "a JSON list, not an object"),
        ('{"format": 2, "names": "run_files.json"}', "no list of names"),
        ('{"format": 2, "names": ["checkpoint-2", {"metrics.jsonl": 1}]}', "a name that is not text: {'metrics"),
    ],
)
def test_a_damaged_record_of_the_run_in_the_folder_names_that_record_and_touches_nothing(tmp_path, record, why):
    """The folder holds another run whose run_files.json is damaged (cut short, edited by hand). The refusal said
    "it lists the run's own files; move the folder aside and pass a new --output_dir", as if the record were this
    run's and a new folder alone the fix; a name that is not text ended --overwrite_output_dir's removal in a
    TypeError. It says whose record it is and what to do, whatever the flags, and the folder is left as it is."""
    import train_dpo

    out = tmp_path / "run"
    sealed_checkpoint(out / "checkpoint-2")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 0.69}\n')
    (out / run_files.MANIFEST).write_text(record)
    a_users_files(out)
    before = snapshot(out)
    for flags in ([], ["--overwrite_output_dir", "true"]):
        with pytest.raises(ConfigError) as refused:
            train_dpo.main(train_args(out, *flags))
        text = str(refused.value)
        assert text.startswith(f"{out / run_files.MANIFEST} is unreadable ({why}"), text
        assert text.endswith(
            "it is the record of the run already in that folder (the files it wrote, told from anyone else's), so "
            "nothing there is replaced, resumed or removed: pass another --output_dir, or check that folder and "
            "remove it yourself"
        ), text
        assert snapshot(out) == before
    # push_to_hub.py takes no --output_dir: its refusal says what to do there, before it asks for a token or the Hub
    spec = importlib.util.spec_from_file_location("push_to_hub", ROOT / "scripts" / "push_to_hub.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(ConfigError) as refused, mock.patch.dict(os.environ):  # main reads .env into the environment
        script.main([str(out), "--repo-id", "me/run"])
    assert str(refused.value).endswith(
        "it names the run's own files, the only ones pushed: restore it from a copy, or upload the files you choose "
        "yourself (huggingface_hub's `hf upload`)"
    ), refused.value
    assert snapshot(out) == before


@pytest.mark.parametrize("name", ["../base/model.safetensors", "ABSOLUTE"])
def test_a_name_in_the_runs_record_that_leads_out_of_its_folder_is_refused_not_followed(tmp_path, name):
    """run_files.json edited by hand, or copied in from another layout, naming a path out of the folder
    (`../base/model.safetensors`, an absolute path): the final save, removing an earlier attempt's weights the new save
    did not write, deleted that file of the user's outside the output folder (a base model's weights). The run writes
    only names of its folder's own entries; any other is a damaged record, refused where the record is read (at the
    start of every run on the folder), nothing there or elsewhere touched."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"the user's weights")
    name = str(base / "model.safetensors") if name == "ABSOLUTE" else name
    out = tmp_path / "run"
    out.mkdir()
    run_files.write(out, [run_files.MANIFEST, "resolved_config.json", name])
    staging = out / output_folder.FINAL_STAGING  # the final save, written: moved in next
    staging.mkdir()
    (staging / "model-00001-of-00002.safetensors").write_bytes(b"new")
    with pytest.raises(ConfigError) as refused:
        output_folder.move_in(out)
    assert str(refused.value).startswith(
        f"{out / run_files.MANIFEST} is unreadable (a name that is not one of the folder's own entries: {name!r}): it "
        "is the record of the run already in that folder"
    ), refused.value
    assert (base / "model.safetensors").read_bytes() == b"the user's weights"


# --- a run never reads from its own output folder --------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_whose_model_lives_in_its_output_folder_is_refused_before_anything_is_deleted(tmp_path, tiny_model_dir):
    """Issue #53: training from the finished model of the folder the run replaces deleted that model (the old run's own
    files), then failed on its tokenizer. Refused in one line naming both paths, before anything is removed; the dry
    run says it too."""
    import shutil

    # A finished run as a run leaves it (its model's files, a checkpoint, recorded as its own), made without training.
    out = tmp_path / "run"
    shutil.copytree(tiny_model_dir, out)
    shutil.copytree(tiny_model_dir, out / "checkpoint-1")
    (out / "run_complete.json").write_text('{"global_step": 1}\n')
    run_files.write(out, [run_files.MANIFEST, "run_complete.json", "checkpoint-1", *os.listdir(tiny_model_dir)])
    before = snapshot(out)
    result = run_train(
        train_args(out, "--model_name_or_path", str(out), "--max_steps", "2", "--overwrite_output_dir"),
        env=env_for(tiny_model_dir),
    )
    line = refusal(result)
    assert line.startswith(f"error: model_name_or_path {str(out)!r} is in output_dir {str(out)!r}: "), line
    assert snapshot(out) == before and "Replaced the run" not in result.stdout
    checkpoint = out / "checkpoint-1"
    dry = run_train(
        train_args(out, "--model_name_or_path", str(checkpoint), "--overwrite_output_dir", "--dry-run"),
        env=env_for(tiny_model_dir),
    )
    assert f"model_name_or_path {str(checkpoint)!r} is in output_dir {str(out)!r}" in dry.stdout, dry.stdout[-3000:]
    assert snapshot(out) == before


def test_the_output_folder_bound_under_another_name_is_still_the_output_folder(tmp_path, tiny_model_dir):
    """The folder mounted a second time elsewhere (a bind mount: a container's `-B`, a site's /scratch and /gpfs names
    of one folder), which no link resolves: the finished model named through it was deleted by --overwrite_output_dir
    as the old run's, then the run failed on its tokenizer. Refused as by its own name, nothing removed. The command as
    its process ends it (`run_cli`), in a forked child whose own mount namespace holds the bind mount (`in_child`): a
    fresh interpreter under `unshare` imported the stack again (~6 CPU-s) for a refusal."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    out, other = tmp_path / "run", tmp_path / "bound"
    shutil.copytree(tiny_model_dir, out)
    (out / "run_complete.json").write_text('{"global_step": 1}\n')
    run_files.write(out, [run_files.MANIFEST, "run_complete.json", *os.listdir(tiny_model_dir)])
    other.mkdir()
    before = snapshot(out)
    args = train_args(out, "--model_name_or_path", str(other), "--max_steps", "2", "--overwrite_output_dir")
    env = env_for(tiny_model_dir)
    code, stdout, stderr = in_child(lambda: run_cli(lambda: train_dpo.main(args)), bind=[(out, other)], env=env)
    assert code == 2 and "Traceback" not in stdout + stderr, (stdout + stderr)[-3000:]
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(
        f"error: model_name_or_path {str(other)!r} ({other} is the same folder as {out}) is in output_dir"
    ), line
    assert snapshot(out) == before


def test_nothing_a_run_reads_may_lie_in_its_output_folder(tmp_path, monkeypatch):
    """The model by any path into the folder (a link too, or the folder given through a link), the data (a mixture's
    source too), the chat template and the sample prompts: each refused naming both paths. What lies outside, and a Hub
    name that is no path here, is not (a LoRA adapter's folder is refused as a model first: test_refusals.py)."""
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError

    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "config.json").write_text("{}")
    for name in ("pairs.jsonl", "chat_template.jinja"):
        (out / name).write_text("{}\n")
    (tmp_path / "model-link").symlink_to(out / "checkpoint-2")
    (tmp_path / "out-link").symlink_to(out)
    outside = tmp_path / "pairs.jsonl"
    outside.write_text("{}\n")

    def refused(*args, output_dir=out) -> str:
        recipe = parse_args(["--config", SMOKE, "--output_dir", str(output_dir), *args])
        with pytest.raises(ConfigError) as error:
            output_folder.check_reads_outside(recipe)
        assert "\n" not in str(error.value)
        return str(error.value)

    checkpoint = out / "checkpoint-2"
    assert refused("--model_name_or_path", str(checkpoint)).startswith(
        f"model_name_or_path {str(checkpoint)!r} is in output_dir {str(out)!r}: "
    )
    assert f"model_name_or_path {str(tmp_path / 'model-link')!r} (a link to {checkpoint})" in refused(
        "--model_name_or_path", str(tmp_path / "model-link")
    )
    assert f"is in output_dir {str(tmp_path / 'out-link')!r}" in refused(
        "--model_name_or_path", str(checkpoint), output_dir=tmp_path / "out-link"
    )
    assert f"dataset_name {str(out / 'pairs.jsonl')!r} is in output_dir" in refused(
        "--dataset_name", str(out / "pairs.jsonl")
    )
    assert f"a mixture source {str(out / 'pairs.jsonl')!r} is in output_dir" in refused(
        "--dataset_mixer_list", str(out / "pairs.jsonl"), "1.0"
    )
    assert f"chat_template_path {str(out / 'chat_template.jinja')!r} is in output_dir" in refused(
        "--chat_template_path", str(out / "chat_template.jinja")
    )
    # A finished run's samples.jsonl (a `prompt` per line) as the prompts to sample: --overwrite_output_dir removed it
    # with the run, then refused the prompts file it had just deleted
    (out / "samples.jsonl").write_text('{"prompt": "Hi"}\n')
    assert f"sample_prompts_file {str(out / 'samples.jsonl')!r} is in output_dir" in refused(
        "--samples_every", "2", "--sample_prompts_file", str(out / "samples.jsonl")
    )
    monkeypatch.chdir(tmp_path)  # `--output_dir .`: a Hub name is no path in it
    for args, output_dir in (
        (["--dataset_name", str(outside)], out),
        (["--model_name_or_path", "org/model"], Path(".")),
    ):
        output_folder.check_reads_outside(parse_args(["--config", SMOKE, "--output_dir", str(output_dir), *args]))


def test_an_input_in_another_unfinished_runs_checkpoint_is_refused(tmp_path):
    """A run started from a checkpoint of another run that had not finished (`--model_name_or_path other/checkpoint-4`)
    lost its base once that run went on: its rotation (save_total_limit) deleted checkpoint-4, and the stopped run's
    rerun was refused ("model folder ... does not exist"), its progress stranded. Refused at the start, naming the copy
    to make; a finished run's checkpoint (rotated no more) and a person's copy in that folder are not."""
    from dpotrain.recipe.config import parse_args

    other = tmp_path / "other"
    for name in ("checkpoint-4", "checkpoint-4.bak", "checkpoint-6"):
        (other / name).mkdir(parents=True)
        (other / name / "config.json").write_text("{}")
        (other / name / "chat_template.jinja").write_text("{{ messages }}")
    run_files.write(other, [run_files.MANIFEST, "metrics.jsonl", "checkpoint-4"])

    def check(*args):
        recipe = parse_args(["--config", SMOKE, "--output_dir", str(tmp_path / "run"), *args])
        output_folder.check_reads_outside(recipe)

    checkpoint = other / "checkpoint-4"
    with pytest.raises(ConfigError) as refused:
        check("--model_name_or_path", str(checkpoint))
    assert str(refused.value).startswith(
        f"model_name_or_path {str(checkpoint)!r} is a checkpoint of the unfinished run in {str(other)!r}, which "
        "deletes it when its save_total_limit lets it go"
    ), refused.value
    assert f"cp -r {checkpoint} <new folder>" in str(refused.value)
    with pytest.raises(ConfigError, match="is in checkpoint-4, a checkpoint of the unfinished run"):
        check("--chat_template_path", str(checkpoint / "chat_template.jinja"))
    check("--model_name_or_path", str(other / "checkpoint-4.bak"))  # a person's copy: never rotated
    check("--model_name_or_path", str(other / "checkpoint-6"))  # not the run's (its record does not name it)
    (other / "run_complete.json").write_text('{"global_step": 8}\n')
    check("--model_name_or_path", str(checkpoint))  # finished: no rotation deletes it any more


def test_a_folder_input_whose_files_are_links_into_the_output_folder_is_refused(tmp_path):
    """A model folder of links to a finished run's files (or a chat template's folder, a data folder) passed the check,
    which resolved the folder's own path alone: --overwrite_output_dir removed the files the links named, then the run
    failed on the links left dangling. Now a link anywhere under a folder input that leads into the output folder is
    refused, naming it and where it points; a folder link is not followed, and a hard link (the file outlives the name
    removed) or a link elsewhere is no refusal."""
    from dpotrain.recipe.config import parse_args

    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "chat_template.jinja", "pairs.jsonl"):
        (out / name).write_text("{}\n")
    model, template, data = tmp_path / "model", tmp_path / "template", tmp_path / "data" / "train" / "part"
    for folder in (model, template, data):
        folder.mkdir(parents=True)
    (model / "tokenizer.json").write_text("{}\n")  # a file of its own beside the links
    for name in ("config.json", "model.safetensors"):
        (model / name).symlink_to(out / name)
    (template / "chat_template.jinja").symlink_to(out / "chat_template.jinja")
    (data / "pairs.jsonl").symlink_to(out / "pairs.jsonl")  # two folders down

    def refused(*args) -> str:
        recipe = parse_args(["--config", SMOKE, "--output_dir", str(out), *args])
        with pytest.raises(ConfigError) as error:
            output_folder.check_reads_outside(recipe)
        assert "\n" not in str(error.value)
        return str(error.value)

    said = refused("--model_name_or_path", str(model))
    assert said.startswith(
        f"model_name_or_path {str(model)!r} holds {model / 'config.json'}, a link to {out / 'config.json'} (and 1 "
        f"other link into it), which is in output_dir {str(out)!r}: "
    ), said
    assert "put a copy of what each link points to in its place, or pass another --output_dir" in said, said
    assert f"holds {template / 'chat_template.jinja'}, a link to {out / 'chat_template.jinja'}" in refused(
        "--chat_template_path", str(template)
    )
    assert f"holds {data / 'pairs.jsonl'}, a link to {out / 'pairs.jsonl'}" in refused(
        "--dataset_name", str(tmp_path / "data")
    )
    # A folder link under the input is a link into the output folder too (refused), but never walked through
    (model / "config.json").unlink()
    (model / "model.safetensors").unlink()
    (model / "checkpoint").symlink_to(out / "checkpoint-2")
    assert f"holds {model / 'checkpoint'}, a link to {out / 'checkpoint-2'}, which" in refused(
        "--model_name_or_path", str(model)
    )
    (model / "checkpoint").unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").symlink_to(out / "config.json")
    (model / "more").symlink_to(elsewhere)  # not followed: what the model folder reads is its own names
    os.link(out / "model.safetensors", model / "model.safetensors")  # a hard link: removing one name leaves the data
    (tmp_path / "config.json").write_text("{}\n")
    (model / "config.json").symlink_to(tmp_path / "config.json")  # a link to a file outside the output folder
    recipe = parse_args(["--config", SMOKE, "--output_dir", str(out), "--model_name_or_path", str(model)])
    output_folder.check_reads_outside(recipe)


@pytest.mark.slow  # a launched run: the check itself is the fast test above's
def test_a_model_folder_of_links_to_the_finished_run_it_replaces_is_refused_before_anything_is_removed(
    tmp_path, tiny_model_dir
):
    """A model folder whose files are links to the finished model --overwrite_output_dir replaces: the run removed that
    model (the old run's own files), the links dangled, and the run ended in a traceback. Now refused in one line
    naming a link, nothing removed."""
    out, model = tmp_path / "run", tmp_path / "model"
    shutil.copytree(tiny_model_dir, out)
    (out / "run_complete.json").write_text('{"global_step": 1}\n')
    run_files.write(out, [run_files.MANIFEST, "run_complete.json", *os.listdir(tiny_model_dir)])
    model.mkdir()
    for name in os.listdir(tiny_model_dir):
        (model / name).symlink_to(out / name)
    before = snapshot(out)
    result = run_train(
        train_args(out, "--model_name_or_path", str(model), "--max_steps", "2", "--overwrite_output_dir"),
        env=env_for(tiny_model_dir),
    )
    line = refusal(result)
    assert line.startswith(f"error: model_name_or_path {str(model)!r} holds {model}/"), line
    assert f"which is in output_dir {str(out)!r}: " in line, line
    assert snapshot(out) == before and "Replaced the run" not in result.stdout


# --- a run writes nothing beside its data ----------------------------------------------------------------------------


def saved_pairs(tmp_path, kind: str) -> Path:
    """32 smoke pairs as a user keeps them: a folder saved with `save_to_disk`, or a JSON Lines file in a folder."""
    import datasets

    lines = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[:32]
    folder = tmp_path / "mine" / "pairs"
    folder.mkdir(parents=True)
    if kind == "jsonl":
        (folder / "pairs.jsonl").write_text("".join(lines))
        return folder / "pairs.jsonl"
    datasets.Dataset.from_list([json.loads(line) for line in lines]).save_to_disk(str(folder))
    return folder


def files_in(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".lock")}


@pytest.mark.slow  # trains twice (two train_dpo.py runs: 4-11 s)
@pytest.mark.parametrize("kind", ["save_to_disk", "jsonl"])
def test_runs_write_no_cache_beside_the_data_and_a_second_run_reuses_the_first_ones(tmp_path, tiny_model_dir, kind):
    """Each run on a data set saved with `save_to_disk` wrote 3-4 new `cache-*.arrow` files of datasets' maps into the
    user's folder (TRL's tokenization, the assistant turns' labels: about the data's size again), never reused: TRL's
    filter of fully truncated pairs hashes the run's whole arguments (its output_dir among them) into its fingerprint,
    and every map after it had a new one. A local file's runs grew HF_DATASETS_CACHE the same way. Now the maps over a
    saved data set cache in HF_DATASETS_CACHE, and a second run (another output folder) writes no new file there."""
    data = saved_pairs(tmp_path, kind)
    mine, cache = snapshot(data.parent), tmp_path / "hf-datasets"
    env = env_for(tiny_model_dir, HF_DATASETS_CACHE=str(cache))
    cached = []
    for out in ("a", "b"):
        args = ["--config", SMOKE, "--dataset_name", str(data), "--output_dir", str(tmp_path / out)]
        result = run_train([*args, "--max_steps", "2", "--save_strategy", "no", "--report_to", "none"], env=env)
        assert result.returncode == 0, result.stdout[-3000:]
        assert snapshot(data.parent) == mine  # nothing written beside the user's data
        cached.append(files_in(cache))
    assert cached[1] == cached[0], sorted(cached[1] - cached[0])


@pytest.mark.slow  # a fresh interpreter that trains (~10 s)
def test_a_run_on_a_data_set_saved_in_a_read_only_folder_trains_and_writes_nothing_there(tmp_path, tiny_model_dir):
    """`python train_dpo.py` in a mount namespace of its own where the saved data set's folder is a read-only bind
    mount (`unshare`, root): datasets wrote the first map's cache beside the data, and the run failed on the read-only
    file system. Its maps cache in HF_DATASETS_CACHE now, none beside the data. A fresh interpreter, not a forked child
    (`in_child`): a child forked from a test process that ran a backward pass cannot run one (torch's autograd threads
    are not forked), so it failed after whichever test ran before it."""
    if os.geteuid() != 0:
        pytest.skip("needs a read-only bind mount in a mount namespace of its own (root, unshare)")
    data = saved_pairs(tmp_path, "save_to_disk")
    mine, out = snapshot(data.parent), tmp_path / "run"
    args = ["--config", SMOKE, "--dataset_name", str(data), "--output_dir", str(out), "--max_steps", "2"]
    env = {**os.environ, **env_for(tiny_model_dir, HF_DATASETS_CACHE=str(tmp_path / "hf-datasets"))}
    read_only = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
    command = [PYTHON, str(ROOT / "train_dpo.py"), *args, "--save_strategy", "no", "--report_to", "none"]
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", read_only, "sh", str(data.parent), *command],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert (out / "model.safetensors").is_file() and snapshot(data.parent) == mine


# --- no command writes over one of its own inputs ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("target", ["data", "recipe"])
def test_the_analyzer_refuses_to_write_its_report_over_an_input(tmp_path, tiny_model_dir, target):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[:16]))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: builtin:tiny-olmo3\ndataset_name: {data}\n")
    before = snapshot(tmp_path)
    path = {"data": data, "recipe": recipe}[target]
    result = subprocess.run(
        [python(), str(ROOT / "scripts" / "analyze_dataset.py"), "--config", str(recipe), "--json", str(path)],
        env={**os.environ, **env_for(tiny_model_dir)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    line = refusal(result)
    assert f"--json {str(path)!r} is one of this command's inputs" in line, line
    assert snapshot(tmp_path) == before


def test_records_are_written_whole_or_not_at_all(tmp_path):
    from dpotrain.recipe import writes

    path = tmp_path / "resolved_config.json"
    writes.write_text(path, "old\n")

    class Interrupted(Exception):
        pass

    with pytest.raises(Interrupted):
        with writes.replacing(path) as f:
            f.write("half of the new")
            raise Interrupted
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == [path.name]


# --- one run per output folder ----------------------------------------------------------------------------------------


def wait_for(predicate, process, timeout: float = 600) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert process.poll() is None, process.stdout.read()[-3000:]  # a Popen's (stdout=PIPE) or a Child's
        assert time.monotonic() < end, "timed out"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_second_run_on_the_same_folder_is_refused_and_the_first_completes_untouched(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    args = [
        python(),
        str(ROOT / "train_dpo.py"),
        *train_args(out, "--max_steps", "6", "--save_steps", "2", "--logging_steps", "1"),
    ]
    first = subprocess.Popen(
        args, env={**os.environ, **env_for(tiny_model_dir)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_for(lambda: (out / run_lock.LOCK_FILE).exists(), first)
        holder = json.loads((out / run_lock.LOCK_FILE).read_text())
        # The holder paused while the second runs (alive, as a busy run is), so that the first cannot end before the
        # second is refused: 6 steps of the tiny model outlast a refusal by only a few seconds on a loaded machine.
        os.kill(holder["pid"], signal.SIGSTOP)
        try:
            # A double sbatch: the same command again, with --overwrite_output_dir even.
            second = run_train(
                train_args(out, "--max_steps", "6", "--overwrite_output_dir"), env=env_for(tiny_model_dir)
            )
            assert first.poll() is None, "the first run ended before the second was refused: the test proves nothing"
        finally:
            os.kill(holder["pid"], signal.SIGCONT)
        line = refusal(second)
        assert f"is in use by another run (host {socket.gethostname()}, pid {holder['pid']}" in line, line
        stdout, _ = first.communicate(timeout=900)
    finally:
        first.kill()
    assert first.returncode == 0, stdout[-3000:]
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 3, 4, 5, 6]  # each step once
    assert json.loads((out / "run_complete.json").read_text())["global_step"] == 6
    assert (out / "checkpoint-6" / "COMPLETE").exists() and (out / "model.safetensors").exists()
    assert not (out / run_lock.LOCK_FILE).exists()


@pytest.mark.slow
def test_the_lock_of_a_run_killed_with_sigkill_does_not_block_the_rerun(tmp_path, tiny_model_dir):
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    out = tmp_path / "run"
    # 12 steps of ~0.1 s, each saved: the kill lands mid-run, after checkpoint-2 (6 finished before it on a fast
    # machine); each step more costs both runs a step and a save
    args = train_args(out, "--max_steps", "12", "--save_steps", "1", "--logging_steps", "1", "--save_total_limit", "3")
    # A forked child of this process (`start_child`), not the warm interpreter's, so that SIGKILL hits the process
    # that holds the lock, as a node's OOM killer would; not a fresh interpreter either (~6 CPU-s of imports).
    killed = start_child(lambda: run_cli(lambda: train_dpo.main(args)), env=env_for(tiny_model_dir))
    try:
        wait_for(lambda: (out / "checkpoint-2" / "COMPLETE").exists(), killed)
    finally:
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
    assert json.loads((out / run_lock.LOCK_FILE).read_text())["pid"] == killed.pid  # left behind
    rerun = run_train(args, env=env_for(tiny_model_dir))
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert f"pid {killed.pid}" in rerun.stdout and "its process" in rerun.stdout and "is gone" in rerun.stdout
    assert "Resuming from" in rerun.stdout
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == list(range(1, 13))  # each step once
    assert not (out / run_lock.LOCK_FILE).exists()


def hold_lock(out: Path, **env) -> subprocess.Popen:
    """A live process holding `out`'s lock, as a run's main process does (with the Slurm variables given)."""
    code = (
        "import sys, time; from pathlib import Path; from dpotrain.cluster import run_lock; assert "
        "run_lock.acquire(Path(sys.argv[1])) is None; print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen(
        [PYTHON, "-c", code, str(out)], cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_live_run_caught_mid_write_of_its_first_record_is_named_as_a_live_run(tmp_path):
    # The instant a second launch looks, the first run (lock taken) may hold only its record's temporary name, before
    # any manifest exists: that folder is a live run's, not "files that are not a run's" (a race CI met).
    out = tmp_path / "run"
    holder = hold_lock(out)
    try:
        (out / f".{run_files.MANIFEST}.{socket.gethostname()}.{holder.pid}.tmp").write_text("[")
        with pytest.raises(output_folder.ConfigError, match="is in use by another run"):
            output_folder.check(str(out))
    finally:
        holder.kill()
        holder.wait()


def test_the_temporaries_of_a_write_killed_midway_are_removed_by_the_rerun_and_no_others(tmp_path, capsys):
    """A run killed as it wrote its first record (`run_files.json`, under `writes.replacing`'s temporary name) left a
    folder its rerun refused as "files that are not a run's (1: .run_files.json.<host>.<pid>.tmp)", with or without
    --overwrite_output_dir; a temporary of a later record stayed forever ("kept 1 other"). The rerun now removes the
    temporaries of its own names left by dead processes of this host, saying so; another host's (it may be writing),
    a live process's, and a person's file of that shape stay."""
    from dpotrain.recipe.config import parse_args

    host, out = socket.gethostname(), tmp_path / "run"
    # A pid past the kernel's largest is no process's, now or later; the test's own parent lives
    dead, live = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1, os.getppid()
    out.mkdir()
    killed = out / f".{run_files.MANIFEST}.{host}.{dead}.tmp"
    killed.write_text('{"format": 2, "na')
    output_folder.check(str(out), lock=False)  # refused before
    killed.rename(out / f".{run_files.MANIFEST}.other-host.{dead}.tmp")  # a requeue on another node: the same
    output_folder.check(str(out), lock=False)
    (out / f".{run_files.MANIFEST}.other-host.{dead}.tmp").rename(killed)
    kept = [
        out / f".{run_files.MANIFEST}.other-host.{dead}.tmp",
        out / f".resolved_config.json.{host}.{live}.tmp",
        out / f".notes.txt.{host}.{dead}.tmp",
    ]
    for path in kept:
        path.write_text("{")
    cut = out / f".resolved_config.json.{host}.{dead}.tmp"
    cut.write_text('{"training": ')
    output_folder.start(parse_args(train_args(out)), start_afresh=False, pushes=False)
    assert not killed.exists() and not cut.exists() and all(path.exists() for path in kept)
    said = capsys.readouterr().out
    assert f"Removed {killed}: left by a write killed midway (its process is gone)" in said
    assert run_files.read(out) is not None


# A process killed (SIGKILL) inside the write probe, between the probe file's making and its removal: the audit event
# of the removal is the one instant it exists.
KILLED_IN_PROBE = (
    "import os, signal, sys\n"
    "def kill(event, args):\n"
    "    if event == 'os.remove' and 'write-test' in str(args[0]):\n"
    "        os.kill(os.getpid(), signal.SIGKILL)\n"
    "sys.addaudithook(kill)\n"
    "from dpotrain.recipe import writes\n"
    "writes.unwritable(sys.argv[1])\n"
)


@pytest.mark.slow
def test_a_write_probe_killed_midway_is_removed_by_the_next_probe_and_no_other(tmp_path):
    """A run killed while it probed its output folder for writing left `.dpotrain-write-test-<random>`, which no later
    run removed: in an empty folder (made by the user, or a run killed at its first probe) every rerun was refused,
    "holds files that are not a run's (1: .dpotrain-write-test-u3nsplxd)". The probe is now named as a temporary of
    its process on its host, and the next probe there removes a dead one; a live process's, another host's and a
    person's file of that shape stay."""
    out, host = tmp_path / "run", socket.gethostname()
    out.mkdir()
    killed = subprocess.Popen([PYTHON, "-c", KILLED_IN_PROBE, str(out)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    assert killed.wait(timeout=120) == -signal.SIGKILL, killed.stderr.read()[-2000:]
    (left,) = [e.name for e in out.iterdir()]
    assert left == f".dpotrain-write-test.{host}.{killed.pid}.tmp"
    output_folder.check(str(out), lock=False)  # the dry run's and another rank's look: refused before
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process's, now or later
    kept = [
        out / f".dpotrain-write-test.{host}.{os.getppid()}.tmp",  # a live process's probe
        out / f".dpotrain-write-test.other-host.{dead}.tmp",  # another node's, which this one cannot tell dead
    ]
    for path in kept:
        path.write_text("")
    output_folder.check(str(out))  # the main process's: it probes the folder
    assert sorted(e.name for e in out.iterdir()) == sorted(path.name for path in kept)
    persons = out / f".dpotrain-write-tests.{host}.{dead}.tmp"  # a name of that shape, not the probe's
    persons.write_text("")
    assert writes.unwritable(out) is None and persons.exists()


@pytest.mark.slow
def test_a_requeue_of_the_same_slurm_job_takes_over_its_lock(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    # The first start of job 4242 still holds the lock (alive, as far as this host can tell).
    holder = hold_lock(out, SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="0")
    try:
        other_job = run_train(train_args(out, "--max_steps", "1"), env=env_for(tiny_model_dir, SLURM_JOB_ID="777"))
        assert "Slurm job 4242 (restart 0)" in refusal(other_job) and "scancel 4242" in refusal(other_job)
        requeued = run_train(
            train_args(out, "--max_steps", "2", "--save_strategy", "no"),
            env=env_for(tiny_model_dir, SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="1"),
        )
    finally:
        holder.kill()
        holder.wait()
    assert requeued.returncode == 0, requeued.stdout[-3000:]
    assert "an earlier start of this Slurm job (4242), now requeued" in requeued.stdout
    assert (out / "run_complete.json").exists() and not (out / run_lock.LOCK_FILE).exists()


# --- the lock's rules, on the lock alone ------------------------------------------------------------------------------


def fabricated_lock(out: Path, age_s: float, **holder) -> None:
    out.mkdir(parents=True, exist_ok=True)
    record = {**run_lock.holder_record(), **holder}
    # Whole at once, as a run's lock is made (linked): a holder's heartbeat reading it half-written took it for an
    # unreadable lock, not the other run's (a race the fast tier lost under load)
    staged = out / f".{run_lock.LOCK_FILE}.fabricated"
    staged.write_text(json.dumps(record))
    os.replace(staged, out / run_lock.LOCK_FILE)
    then = time.time() - age_s
    os.utime(out / run_lock.LOCK_FILE, (then, then))


def test_a_lock_of_another_host_is_held_while_refreshed_and_taken_over_once_stale(tmp_path):
    out = tmp_path / "run"
    fabricated_lock(out, 20, host="gpu-node-17", pid=1)
    refused = run_lock.acquire(out)
    assert refused and "host gpu-node-17, pid 1" in refused and "refreshed 20 s ago" in refused
    fabricated_lock(out, run_lock.STALE_S + 60, host="gpu-node-17", pid=1)
    try:
        assert run_lock.acquire(out) is None
        assert json.loads((out / run_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
        assert run_lock.acquire(out) is not None  # held now: this process, alive, refuses a second taker
    finally:
        run_lock.release()
    assert not (out / run_lock.LOCK_FILE).exists()


def test_a_file_named_run_lock_that_no_run_wrote_is_never_taken_over(tmp_path):
    """A person's own `run.lock` (notes, a script's lock) in an empty folder was read as an unreadable lock and deleted
    once 300 s old. It is refused, kept; a run's lock caught half-written (empty) is still taken over once stale."""
    out = tmp_path / "run"
    out.mkdir()
    lock = out / run_lock.LOCK_FILE
    lock.write_text("my notes on this run\n")
    then = time.time() - run_lock.STALE_S - 60
    os.utime(lock, (then, then))
    refused = run_lock.acquire(out)
    assert refused and "holds a file named run.lock that no run wrote" in refused and "move that file" in refused
    with pytest.raises(output_folder.ConfigError, match="no run wrote"):
        output_folder.check(str(out))
    assert lock.read_text() == "my notes on this run\n"
    lock.write_bytes(b'{\n "ho')  # a run's lock cut short by a full disk
    os.utime(lock, (then, then))
    try:
        assert run_lock.acquire(out) is None
    finally:
        run_lock.release()


def test_a_refused_launch_leaves_no_folder_behind(tmp_path):
    out = tmp_path / "new-run"
    assert run_lock.acquire(out) is None and out.is_dir()
    run_lock.release()
    assert not out.exists()  # nothing else was written: the folder made for the lock goes with it


LIMITED_TAKE = """
import resource, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from dpotrain.cluster import run_lock
resource.setrlimit(resource.RLIMIT_FSIZE, (16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))  # no lock fits
try:
    run_lock.acquire(Path(sys.argv[1]))
except OSError as e:
    print(type(e).__name__, e.errno)
"""


def test_a_take_that_fails_or_ends_removes_exactly_the_folders_it_made(tmp_path):
    """The lock's take made `out` and every missing folder above it (mkdir -p) and knew only of `out`: a take that
    raised (the lock not written: a file size limit, EFBIG) or was refused left them all behind, and its release
    removed `out` alone, leaving the folders above it. Now each removes the folders it made while they are empty,
    deepest first, and nothing else: a folder that existed before, or one that holds a file, stays. (Old code: the
    failed take left tmp/made/deeper/run, the release left tmp/new/deeper.)"""
    kept = tmp_path / "kept"  # the person's, empty: never the take's to remove
    kept.mkdir()
    script = tmp_path / "limited.py"
    script.write_text(LIMITED_TAKE.format(root=str(ROOT)))
    for out in (tmp_path / "made" / "deeper" / "run", kept / "deeper" / "run"):
        # A cold interpreter: the script imports the lock alone (0.1 s), where python()'s warm server, started for it
        # in the fast tier, imports torch and transformers first (~8 s)
        result = subprocess.run([PYTHON, str(script), str(out)], capture_output=True, text=True, timeout=120)
        assert result.stdout.strip() == f"OSError {errno.EFBIG}", result.stdout + result.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "limited.py"] and not any(kept.iterdir())
    out = tmp_path / "new" / "deeper" / "run"
    assert run_lock.acquire(out) is None
    run_lock.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "limited.py"]
    assert run_lock.acquire(out) is None
    (out.parent / "notes.txt").write_text("mine\n")  # written above the run's folder meanwhile: it and hers stay
    run_lock.release()
    assert not out.exists() and sorted(p.name for p in out.parent.iterdir()) == ["notes.txt"]


def test_an_output_dir_linked_to_a_folder_still_to_be_made_is_made_there(tmp_path):
    """`outputs/run -> /scratch/me/run`, made before the scratch folder: the dry run said the run starts there, the
    run ended in a FileExistsError traceback at its lock (mkdir of the link). The folder it points to is made."""
    target, link = tmp_path / "scratch" / "run", tmp_path / "run"
    link.symlink_to(target)
    output_folder.check(str(link))
    assert run_lock.acquire(link) is None and (target / run_lock.LOCK_FILE).is_file()
    run_lock.release()
    assert link.is_symlink() and not target.exists()  # refused before it wrote anything: no empty folder left


def test_an_output_dir_link_retargeted_to_another_runs_folder_is_refused_naming_where_it_points(tmp_path):
    """`outputs/run -> /scratch/a` (a stopped run), then pointed at another run's folder and the same command rerun:
    the refusal named the link alone, the folder the person knew as the run they meant to resume. Nothing is removed."""
    from dpotrain import resolve
    from dpotrain.recipe.config import parse_args

    other, link = tmp_path / "other-run", tmp_path / "run"
    other.mkdir()
    (other / "run_complete.json").write_text("{}")
    link.symlink_to(other)
    with pytest.raises(ConfigError) as refused:
        resolve.check_output_dir(parse_args(train_args(link)))
    assert str(refused.value).startswith(f"output_dir {str(link)!r} (a link to {other}) already holds a finished run")
    assert sorted(p.name for p in other.iterdir()) == ["run_complete.json"]


def test_the_slurm_job_variables_do_not_let_another_job_in(tmp_path, monkeypatch):
    out = tmp_path / "run"
    holder = hold_lock(out, SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="2")
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        monkeypatch.setenv("SLURM_RESTART_COUNT", "2")  # the same start of the same job: a second launch inside it
        assert "is in use by another run" in run_lock.acquire(out)
    finally:
        holder.kill()
        holder.wait()
    assert run_lock.acquire(out) is None  # its process gone: taken over
    run_lock.release()


def fat_prefix(folder: Path) -> list[str]:
    """A command prefix under which `folder` is a FAT file system, which has no hard links (as exFAT and object-store
    mounts): an image made by mkfs.vfat (dosfstools), mounted in a mount namespace of its own by the kernel, or by
    fusefat where the kernel has no vfat."""
    if os.geteuid() != 0 or not shutil.which("mkfs.vfat"):
        pytest.skip("needs root and mkfs.vfat (dosfstools: scripts/test.sh installs it)")
    folder.mkdir()
    image = folder.with_name(folder.name + ".img")
    subprocess.run(["truncate", "-s", "16M", str(image)], check=True)
    subprocess.run(["mkfs.vfat", str(image)], check=True, capture_output=True)
    mounts = [f'mount -t vfat -o loop "{image}" "$0"']
    if shutil.which("fusefat"):  # a FUSE daemon: unmounted at the end, which ends it
        mounts.append(f'fusefat -o rw+ "{image}" "$0" >/dev/null')
    for mount in mounts:
        prefix = ["unshare", "--mount", "sh", "-c", f'{mount} && "$@"; rc=$?; umount "$0"; exit $rc', str(folder)]
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    pytest.skip("cannot mount a FAT image here (no vfat in the kernel and no fusefat, or no unshare --mount)")


def test_the_lock_works_on_a_file_system_without_hard_links(tmp_path):
    """vfat's link(2) fails with EPERM: the lock is made there without one, taken, refused to a second taker while
    its holder lives, and released."""
    prefix = fat_prefix(tmp_path / "fat")
    code = """
import subprocess, sys
from pathlib import Path
from dpotrain.cluster import run_lock
out = Path(sys.argv[1]) / "run"
print("first:", run_lock.acquire(out))
second = "import sys, pathlib; from dpotrain.cluster import run_lock as l; print(l.acquire(pathlib.Path(sys.argv[1])))"
taker = subprocess.run([sys.executable, "-c", second, str(out)], capture_output=True, text=True)
print("second:", taker.stdout.strip())
run_lock.release()
print("after release:", out.exists())
"""
    result = subprocess.run(
        [*prefix, PYTHON, "-c", code, str(tmp_path / "fat")], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    first, second, released = result.stdout.strip().splitlines()
    assert first == "first: None", result.stdout
    out = tmp_path / "fat" / "run"
    assert second.startswith(f"second: output_dir '{out}' is in use by another run (host {socket.gethostname()}, pid ")
    assert released == "after release: False"  # the lock gone, and the folder made for it


def test_a_lock_copied_with_its_folder_is_taken_over_by_a_run_on_the_copy(tmp_path, capsys):
    """`cp -r outputs/x outputs/y` while x's run trains (or after it was killed there), then a run on y: the copied lock
    named x's live run as y's holder, and y was refused (`scancel` of that run offered as a way out), from another host
    until 300 s old. A lock names the folder it holds: a copy's is taken over at once, and the original stays held."""
    out, copy = tmp_path / "x", tmp_path / "y"
    assert run_lock.acquire(out) is None
    try:
        shutil.copytree(out, copy)
        run_lock.check_free(copy)  # a dry run of the copy: not refused
        assert run_lock.acquire(copy) is None
        took = capsys.readouterr().out
        assert took.startswith(f"Took over {copy / run_lock.LOCK_FILE} from host ") and took.endswith(
            ": a copy of another folder's lock (cp -r): its run holds that folder, not this one\n"
        ), took
        with pytest.raises(ConfigError, match=f"output_dir '{out}' is in use by another run"):
            run_lock.check_free(out)
    finally:
        run_lock.release()
    assert not (out / run_lock.LOCK_FILE).exists() and not (copy / run_lock.LOCK_FILE).exists()


def test_the_lock_made_without_a_hard_link_is_exclusive_and_names_its_holder(tmp_path):
    lock = tmp_path / run_lock.LOCK_FILE
    raw = json.dumps(run_lock.holder_record()).encode()
    assert run_lock._create(lock, raw) and lock.read_bytes() == raw
    assert not run_lock._create(lock, b"another run's record") and lock.read_bytes() == raw
    assert run_lock.free_reason(json.loads(raw), 0.0) is None  # its holder, this process, is alive: held


def test_a_lock_removed_while_its_run_lives_is_taken_again_and_a_lock_lost_to_another_run_stops_it(
    tmp_path, monkeypatch
):
    """`rm run.lock` from a third shell while a run trained: a run started next on the folder took the lock and resumed
    from the live run's checkpoint, and the two trained on in one folder, writing over and rotating away each other's
    checkpoints; the first only warned. A holder that finds its lock removed links it again at once (a run started
    after that is refused), and one that finds it taken by another run stops at its next step, saving nothing there."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from dpotrain.recipe.errors import RunError
    from dpotrain.train.preemption import GracefulStop

    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.01)  # the heartbeat's pace, not a timing: it is waited for below
    out = tmp_path / "run"
    try:
        assert run_lock.acquire(out) is None
        lock = out / run_lock.LOCK_FILE
        raw = lock.read_bytes()
        lock.unlink()  # a third shell
        deadline = time.monotonic() + 60
        while not lock.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lock.read_bytes() == raw  # its own again: a run started now is refused
        refused = run_lock.acquire(out)
        assert refused and "is in use by another run" in refused
        lock.unlink()
        fabricated_lock(out, 0, pid=1, since="a run started while the lock was gone")  # won the race
        while run_lock.lost() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "taken by host " in run_lock.lost()
        args = TrainingArguments(output_dir=str(out), report_to="none")
        with pytest.raises(RunError, match="stopped: the lock .* was taken by host .*saving nothing"):
            GracefulStop().on_step_end(args, TrainerState(global_step=3), TrainerControl())
    finally:
        run_lock.release()


@pytest.mark.parametrize("how", ["moved", "deleted and made again"])
def test_an_output_folder_moved_or_deleted_while_its_run_trains_stops_it_at_the_step_end(tmp_path, how):
    """`mv outputs/x outputs/x.old` (or `rm -rf` it, the run taken for dead) while the run trained: its next checkpoint
    save made a new folder of that name (transformers' makedirs), and a run logging less often than it saved ended
    with 0 and run_complete.json in a folder without its record, earlier checkpoints or lock. The run stops at the end
    of its step, every rank, on one line naming the folder; the lock removed by hand alone (the folder the same) is not
    taken for it."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from dpotrain.recipe.errors import RunError
    from dpotrain.train.preemption import GracefulStop

    out = tmp_path / "run"
    try:
        assert run_lock.acquire(out) is None
        args = TrainingArguments(output_dir=str(out), report_to="none")
        (out / run_lock.LOCK_FILE).unlink()  # the lock alone removed by hand: the heartbeat links it again
        GracefulStop().on_step_end(args, TrainerState(global_step=2, max_steps=8), TrainerControl())
        if how == "moved":
            out.rename(tmp_path / "run.old")
        else:
            shutil.rmtree(out)
            out.mkdir()  # what the next save made
        with pytest.raises(RunError) as stopped:
            GracefulStop().on_step_end(args, TrainerState(global_step=3, max_steps=8), TrainerControl())
        assert str(stopped.value) == (
            f"stopped: the output folder {out} was deleted or moved away while this run trained: this run ended "
            "after step 3, writing nothing more there (a folder made again of that name would hold none of its "
            f"record, checkpoints or lock); move the folder back to {out} and run the same command again to go on from "
            "its newest checkpoint, or run it as it is to start afresh"
        )
    finally:
        run_lock.release()
