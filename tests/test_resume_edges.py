"""Resume and Hub-hold edges (session 47): a requeue that replaces its folder, a checkpoint's state lost after its
check, a half-removed checkpoint, a held checkpoint whose upload (not its staging) failed. Nothing lost, nothing
silent."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from test_changed_inputs import ARGS
from test_own_files import train_args

from conftest import (
    ROOT,
    accelerate_launch,
    in_child,
    launch_env,
    python,
    rank_python,
    sealed_checkpoint,
    smoke_command,
)
from dpotrain import resolve
from dpotrain.recipe import run_record
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError
from dpotrain.train import run_files


@pytest.mark.parametrize("record", ["edited", "other settings"])
def test_a_requeue_that_replaces_its_folder_checks_the_checkpoint_named(record, tmp_path, monkeypatch):
    """Job `--resume_from_checkpoint other/checkpoint-2 --overwrite_output_dir` saved run/checkpoint-4 and was
    requeued: going on from its own progress, the start skips the named one's checks (`resume.requeued_past`). Its
    record edited by hand (no checkpoint holding a copy) or other settings than its own, the start replaces the folder
    instead, and loaded the named checkpoint unchecked: here one trained under another learning rate."""
    other, out = tmp_path / "other", tmp_path / "run"
    named = sealed_checkpoint(other / "checkpoint-2")
    (other / run_record.RESOLVED).write_text(json.dumps({"learning_rate": 1.0, "derived": {}}))
    sealed_checkpoint(out / "checkpoint-4")  # saved with no copy of the record (none was there as it saved)
    ours = {"derived": {}} if record == "edited" else {"learning_rate": 0.5, "derived": {}}
    written = run_record.sealed(ours)
    (out / run_record.RESOLVED).write_text(
        json.dumps({**written, "learning_rate": 3.0} if record == "edited" else written)
    )
    run_files.write(out, [run_files.MANIFEST, run_record.RESOLVED, "checkpoint-4"])
    monkeypatch.setenv("SLURM_JOB_ID", "111")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    argv = train_args(out, "--max_steps", "6", "--resume_from_checkpoint", str(named), "--overwrite_output_dir", "true")
    with pytest.raises(ConfigError, match=r"was written by a run with other settings \(learning_rate: 1.0 -> "):
        resolve.check_output_dir(parse_args(argv))
    # Its first start refused it alike: the same line
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    with pytest.raises(ConfigError, match=r"was written by a run with other settings \(learning_rate: 1.0 -> "):
        resolve.check_output_dir(parse_args(argv))


def test_a_requeue_holds_the_checkpoint_whose_staging_failed_not_one_whose_upload_failed(tmp_path):
    """`held_for_staging` (a requeue's hold, rebuilt from hub_pushes.jsonl) holds one checkpoint: the newest recorded
    `failed` without a staged copy. An upload that failed (its record has `attempts`) had its staged copy removed for
    a newer failure's (`_keep`: one is kept at a time), a choice the job made; held instead, it took the hold from an
    older checkpoint whose staging failed, which the resume's rotation then deleted: on neither the disk nor the Hub."""
    from dpotrain.hub.hub_push import held_for_staging, record_checkpoint

    out, repo = tmp_path / "run", "me/run"
    for step in (2, 4, 6):
        sealed_checkpoint(out / f"checkpoint-{step}")
    run_files.write(out, [run_files.MANIFEST, *(f"checkpoint-{step}" for step in (2, 4, 6))])
    record_checkpoint(out, repo, 2, "failed", error="it could not be staged (OSError: [Errno 5] Input/output error)")
    record_checkpoint(out, repo, 4, "failed", attempts=3, error="HTTPError: 503")  # its copy removed for step 6's
    record_checkpoint(out, repo, 6, "failed", attempts=3, error="HTTPError: 503")
    (out / ".hub_staging" / "checkpoint-6").mkdir(parents=True)  # the newest failed upload's copy, kept
    assert held_for_staging(out, repo) == out / "checkpoint-2"
    # Staged since (a later job's retry pushed it): nothing is held
    record_checkpoint(out, repo, 2, "pushed", commit="0" * 40)
    assert held_for_staging(out, repo) is None


def trained_4_steps(model_dir) -> list[str]:
    """The smoke recipe's arguments for 4 steps saved every 2 (output_dir apart)."""
    args = [*ARGS[:2], "--model_name_or_path", model_dir, "--max_steps", "4", "--save_steps", "2"]
    return [*args, "--report_to", "none"]


@pytest.fixture(scope="module")
def other_run(tmp_path_factory, tiny_model_dir):
    """A run of 4 steps saved every 2, and the reference cache it scored: trained once for both cases below, each
    resuming a copy of its checkpoint-2 (one deletes its files) and reading a copy of its cache."""
    import train_dpo

    folder = tmp_path_factory.mktemp("other")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DPOTRAIN_CACHE", str(folder / "cache"))
        train_dpo.main([*trained_4_steps(tiny_model_dir), "--output_dir", str(folder / "other")])
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("gone", ["optimizer.pt", "the whole folder"])
def test_a_checkpoint_whose_optimizer_state_goes_after_the_resume_checked_it_trains_nothing(
    gone, tmp_path, tiny_model_dir, monkeypatch, other_run
):
    """The resume verifies its checkpoint at the start (`resume.confirm`); its state loads minutes later, after the
    reference stage. optimizer.pt gone between (another run's rotation, a run started in that folder since the
    live-lock check; a person), transformers' `_load_optimizer_and_scheduler` skips it in silence and the run trained
    on with a fresh optimizer (seen on the old code: the run finished). Now one line where the state loads, before
    any step, before transformers reads any of the checkpoint: a folder deleted whole (rotation's rmtree) ended in
    transformers' own traceback where the optimizer's state was checked (a reviewer's finding)."""
    import shutil

    import train_dpo
    from dpotrain.recipe.errors import RunError
    from dpotrain.train import resume

    other, out = tmp_path / "other", tmp_path / "run"
    base = trained_4_steps(tiny_model_dir)
    shutil.copytree(other_run / "other", other)
    shutil.copytree(other_run / "cache", os.environ["DPOTRAIN_CACHE"], dirs_exist_ok=True)
    named = other / "checkpoint-2"
    confirm = resume.confirm

    def confirmed_then_gone(*args, **kwargs):  # the window by construction: right after the check
        point = confirm(*args, **kwargs)
        if gone == "optimizer.pt":
            (Path(point) / "optimizer.pt").unlink()
        else:
            shutil.rmtree(point)
        return point

    monkeypatch.setattr(resume, "confirm", confirmed_then_gone)
    argv = [*base, "--output_dir", str(out), "--resume_from_checkpoint", str(named)]
    with pytest.raises(RunError, match=r"optimizer\.pt (is|and \S+ are) missing\), before training resumed from it"):
        train_dpo.main(argv)
    assert not (out / "checkpoint-4").exists() and not (out / "run_complete.json").exists()


def test_a_checkpoint_half_removed_by_rotation_is_never_complete_and_a_later_save_removes_it(
    tmp_path, monkeypatch, capsys
):
    """Rotation's removal failing after the COMPLETE mark went (an I/O error halfway): the folder stays, half removed,
    the run's own (run_files.json) but no longer listed complete. Held already (session 47 looked): the resume goes on
    from the checkpoint after it, no line names it gone, and the next save's rotation removes it."""
    import errno
    import os
    import shutil

    from dpotrain.train import checkpoints, resume
    from dpotrain.train.checkpoints import MARKER, gone, rotate

    out = tmp_path / "run"
    for step in (2, 4):
        sealed_checkpoint(out / f"checkpoint-{step}")
    run_files.write(out, [run_files.MANIFEST, "checkpoint-2", "checkpoint-4"])
    for step in (2, 4):
        run_files.completed(out, f"checkpoint-{step}")
    real = shutil.rmtree

    def halfway(path, *args, **kwargs):
        (Path(path) / "optimizer.pt").unlink()
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))

    with monkeypatch.context() as failing:
        failing.setattr(checkpoints.shutil, "rmtree", halfway)
        assert rotate(out, 1, keep=(str(out / "checkpoint-4"),)) == []
    assert f"Could not remove {out / 'checkpoint-2'} (OSError: [Errno 5]" in capsys.readouterr().out
    assert not (out / "checkpoint-2" / MARKER).exists() and (out / "checkpoint-2").is_dir()
    assert run_files.completed(out) == ["checkpoint-4"] and gone(out) == []
    assert resume.latest_sound_checkpoint(out) == out / "checkpoint-4"
    assert checkpoints.shutil.rmtree is real
    assert rotate(out, 1, keep=(str(out / "checkpoint-4"),)) == [out / "checkpoint-2"]
    assert not (out / "checkpoint-2").exists()
    said = capsys.readouterr().out
    assert f"Removed {out / 'checkpoint-2'}: incomplete (no {MARKER} mark: a save or a deletion cut short)" in said


def test_a_checkpoint_whose_deletion_was_cut_short_is_not_called_a_save_cut_short(tmp_path, capsys):
    """Rotation's deletion killed midway (its COMPLETE mark goes first, then its files; or a person's rm -r stopped)
    leaves a folder without its mark, as a save killed before its mark does: the lines said "a save cut short" or "cut
    short", a cause the code cannot know. Now they say incomplete, naming both causes. (Old code: "a save cut short, or
    not this project's: no COMPLETE mark", and rotation's "a checkpoint cut short".)"""
    from dpotrain.train import checkpoints, resume

    out = tmp_path / "run"
    for step in (2, 4, 6):
        run_files.claim(out, [f"checkpoint-{step}"])
        sealed_checkpoint(out / f"checkpoint-{step}")
        run_files.completed(out, f"checkpoint-{step}")
    half = out / "checkpoint-2"
    run_files.incomplete(
        out, half.name
    )  # as rotation unlists it first (a person's rm -r leaves it listed: test_checkpoints)
    (half / checkpoints.MARKER).unlink()  # as `checkpoints.remove` does next, then the files: killed after one
    (half / "optimizer.pt").unlink()
    why = resume.unverified(half)
    assert why == (
        "no COMPLETE mark (a save or a deletion cut short, or not this project's); optimizer.pt is missing"
    ), why
    assert "a save cut short" not in why
    checkpoints.rotate(out, 2)
    said = capsys.readouterr().out
    assert f"Removed {half}: incomplete (no COMPLETE mark: a save or a deletion cut short), never resumed from" in said
    assert not half.exists() and (out / "checkpoint-4").is_dir()


@pytest.mark.slow
def test_a_checkpoints_record_edited_at_its_size_is_damage_found_before_the_settings_are_compared(
    tmp_path, tiny_model_dir, capsys
):
    """The settings a rerun is compared with, before anything loads, are the resume point's copy of
    resolved_config.json; its checksums were read only once processes had started (`resume.confirm`), and a failure
    fell back to the checkpoint before it, whose record was never compared. The newest checkpoint's copy edited to the
    rerun's learning rate (same size): the rerun with that rate passed the comparison, failed checkpoint-4's checksum,
    and went on from checkpoint-2 at its 1e-4 schedule under a record and model card of 5e-4, exit code 0 (seen on the
    old code). Now the copy is hashed before the comparison: checkpoint-4 is passed over, checkpoint-2 compared."""
    import train_dpo

    out = tmp_path / "run"
    base = [*ARGS[:2], "--model_name_or_path", tiny_model_dir, "--max_steps", "4", "--save_steps", "2"]
    base += ["--report_to", "none", "--output_dir", str(out)]
    train_dpo.main(base)
    for name in ("model.safetensors", "run_complete.json", "README.md", "training_curves.png"):
        (out / name).unlink()  # as a kill after checkpoint-4 leaves the folder
    copy = out / "checkpoint-4" / run_record.RESOLVED
    text = copy.read_text()
    assert '"learning_rate": 0.0001,' in text
    copy.write_text(text.replace('"learning_rate": 0.0001,', '"learning_rate": 0.0005,'))  # the same size
    capsys.readouterr()
    with pytest.raises(ConfigError, match=r"other settings \(learning_rate: 0\.0001 -> 0\.0005\)"):
        train_dpo.main([*base, "--learning_rate", "5e-4"])
    said = capsys.readouterr().out
    assert f"Not resuming from {out / 'checkpoint-4'}: resolved_config.json does not match its checksum" in said
    assert not (out / "run_complete.json").exists()
    # The run's own settings resume from checkpoint-2, to the end
    train_dpo.main(base)
    said = capsys.readouterr().out
    assert f"Resuming from {out / 'checkpoint-2'}" in said
    assert json.loads((out / "run_complete.json").read_text())["global_step"] == 4


@pytest.mark.slow
def test_a_zero2_checkpoint_resumed_with_bf16_turned_on_is_refused_before_the_model_loads(tmp_path, tiny_model_dir):
    """Precision may change between attempts, but not under DeepSpeed: a bf16 run's optimizer shards are
    `bf16_zero_pp_rank_*` and DeepSpeed loads only its own precision's (FileNotFoundError for the others), and its
    weights load in bf16. A requeue with --bf16 turned on (or off) loaded the model, then was refused as a model whose
    "files were replaced since the run started". Now one line before the model loads, naming the --bf16 to pass."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[:32]))
    launcher = [*accelerate_launch(), "--config_file", str(ROOT / "accelerate_config.yaml"), "--num_processes", "2"]
    env = launch_env(tmp_path / "cache")

    def launch(out, *more) -> subprocess.CompletedProcess:
        args = ["--dataset_name", str(pairs), "--output_dir", str(out), "--max_steps", "2", "--save_steps", "1"]
        cmd = smoke_command([*launcher, *rank_python()], tiny_model_dir, *args, "--use_cpu", "true", *more)
        return subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    first = launch(tmp_path / "fp32")
    assert first.returncode == 0, first.stdout[-3000:]
    checkpoint = tmp_path / "fp32" / "checkpoint-1"
    assert list(checkpoint.glob("global_step1/zero_pp_rank_*_optim_states.pt")), first.stdout[-3000:]
    resumed = launch(tmp_path / "bf16", "--bf16", "true", "--resume_from_checkpoint", str(checkpoint))
    assert resumed.returncode != 0
    assert (
        f"error: checkpoint {str(checkpoint)!r} was trained under DeepSpeed with bf16 false (its optimizer state: "
        "zero_pp_rank_" in resumed.stdout
    ), resumed.stdout[-3000:]
    assert "this run has bf16 true" in resumed.stdout and "resume it with --bf16 false" in resumed.stdout
    assert "Loading weights" not in resumed.stdout and "files were replaced" not in resumed.stdout
    assert not (tmp_path / "bf16" / "checkpoint-2").exists()


def test_a_bf16_zero_checkpoint_is_refused_by_a_run_without_bf16_and_resumes_with_it(tmp_path):
    """The reverse of the launch above, on the layout a 2-process bf16 ZeRO-2 launch on a CPU writes: a run with bf16
    false looked for `zero_pp_rank_*` shards that are not there, after the model loaded. A run of neither engine nor
    bf16 setting given (a dry run's plan without a launch) is not asked."""
    from dpotrain.cluster import engine
    from dpotrain.train import resume

    checkpoint = tmp_path / "checkpoint-2"
    (checkpoint / "global_step2").mkdir(parents=True)
    for name in ["mp_rank_00_model_states.pt", *(f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))]:
        (checkpoint / "global_step2" / name).write_bytes(b"")
    resume.check_partitions(str(checkpoint), 2, engine.Engine("zero2"), True)
    resume.check_partitions(str(checkpoint), 2, engine.Engine("zero2"))
    with pytest.raises(ConfigError) as refused:
        resume.check_partitions(str(checkpoint), 2, engine.Engine("zero2"), False)
    assert str(refused.value) == (
        f"checkpoint {str(checkpoint)!r} was trained under DeepSpeed with bf16 true (its optimizer state: "
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt), and this run has bf16 false: DeepSpeed loads only the "
        "optimizer state and weights of its own precision: resume it with --bf16 true, or start afresh (a new "
        "--output_dir) from its weights (--model_name_or_path on a copy of the checkpoint folder)"
    )


@pytest.mark.slow
def test_a_lora_checkpoint_resumed_with_another_dtype_resumes_not_refused_as_replaced_weights(tmp_path, tiny_model_dir):
    """`dtype` may change between attempts ("precision"), and a LoRA run may load its base in bf16. The loaded
    weights' hash, which a resume compares with the record's to catch files replaced with their size and times kept,
    is taken in the dtype they loaded in: a resume with --dtype bfloat16 of a run that loaded float32 was refused once
    the model had loaded, as a model whose "files were replaced since the run started". It resumes."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[:32]))
    lora = ["--use_peft", "true", "--lora_target_modules", "q_proj", "v_proj", "--report_to", "none"]
    env = launch_env(tmp_path / "cache")

    def run(out, *more) -> subprocess.CompletedProcess:
        args = ["--dataset_name", str(pairs), "--output_dir", str(out), "--max_steps", "2", "--save_steps", "1"]
        cmd = smoke_command([python()], tiny_model_dir, *args, *lora, *more)
        return subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    first = run(tmp_path / "fp32")
    assert first.returncode == 0, first.stdout[-3000:]
    checkpoint = tmp_path / "fp32" / "checkpoint-1"
    resumed = run(tmp_path / "bf16", "--dtype", "bfloat16", "--resume_from_checkpoint", str(checkpoint))
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert f"Resuming from {checkpoint}" in resumed.stdout and "files were replaced" not in resumed.stdout
    assert json.loads((tmp_path / "bf16" / "run_complete.json").read_text())["global_step"] == 2


def test_going_back_under_auto_resume_false_moves_the_course_past_the_named_checkpoint_aside(tmp_path, capsys):
    """`--auto_resume false --resume_from_checkpoint out/checkpoint-4` in a folder holding the run's checkpoint-8: the
    course given up for checkpoint-4 stayed there, and a later attempt that resumed by itself (the command without
    --auto_resume false, this course killed before it saved past step 8) went on from checkpoint-8, silently. Moved
    aside as the run starts, said in a line, never deleted; a dry run says it will."""
    from dpotrain import output_folder, resolve
    from dpotrain.train import resume

    out = tmp_path / "run"
    for step in (4, 8):
        sealed_checkpoint(out / f"checkpoint-{step}")
    (out / run_record.RESOLVED).write_text(json.dumps(run_record.sealed({"derived": {}})))  # the run's record
    names = [run_files.MANIFEST, run_record.RESOLVED, "checkpoint-4", "checkpoint-8"]
    run_files.write(out, names, complete=["checkpoint-4", "checkpoint-8"])
    named = str(out / "checkpoint-4")
    recipe = parse_args(train_args(out, "--auto_resume", "false", "--resume_from_checkpoint", named))
    decision = resolve.check_output_dir(recipe)  # what a dry run's summary says of the folder
    assert decision.record(str(out))["output_folder"] == (
        f"{out}: an unfinished run, which the run resumes from {named}; the checkpoints saved past it (checkpoint-8) "
        f"are moved to {tmp_path / 'run.past-checkpoint-4-<time>'}"
    )
    output_folder.start(recipe, start_afresh=False, pushes=False)  # as the run starts, resuming checkpoint-4
    (aside,) = tmp_path.glob("run.past-checkpoint-4-*")
    assert f"Moved checkpoint-8 to {aside}: saved past {named}, which this run goes on from" in capsys.readouterr().out
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint-8"]
    assert (aside / "checkpoint-8" / "COMPLETE").is_file()  # whole, as saved
    assert "checkpoint-8" not in run_files.read(out) and run_files.completed(out) == ["checkpoint-4"]
    # What a later run that resumes by itself goes on from: the course chosen, not the one given up
    assert resume.latest_sound_checkpoint(out) == out / "checkpoint-4"


def test_going_back_in_an_output_folder_that_is_a_mount_point_is_refused_before_anything_moves(tmp_path):
    """The same going back, where the output folder is a file system of its own (a container's `-B /scratch/run:...`,
    a job's scratch mount): the checkpoints past the named one cannot be renamed into the folder beside it, and the run
    ended in the traceback of an `OSError: [Errno 18] Invalid cross-device link`, after the data was read, checkpoint-8
    already unlisted as complete and an empty folder made beside. Refused before anything loads or moves, naming the
    fix; a dry run lists it (tmpfs here, as the real mount)."""
    from dpotrain import resolve

    out = tmp_path / "run"
    out.mkdir()

    def going_back():
        for step in (4, 8):
            sealed_checkpoint(out / f"checkpoint-{step}")
        (out / run_record.RESOLVED).write_text(json.dumps(run_record.sealed({"derived": {}})))
        names = [run_files.MANIFEST, run_record.RESOLVED, "checkpoint-4", "checkpoint-8"]
        run_files.write(out, names, complete=["checkpoint-4", "checkpoint-8"])
        named = str(out / "checkpoint-4")
        recipe = parse_args(train_args(out, "--auto_resume", "false", "--resume_from_checkpoint", named))
        try:
            resolve.check_output_dir(recipe)
        except ConfigError as e:
            print(e)
        print(sorted(p.name for p in tmp_path.iterdir()), run_files.completed(out))

    code, stdout, stderr = in_child(going_back, tmpfs=[(out, "20m")])
    assert code == 0, stderr
    *_, refusal, left = stdout.splitlines()
    assert refusal == (
        f"output_dir {str(out)!r}: checkpoint-8, saved past {out / 'checkpoint-4'}, cannot be moved aside beside it "
        f"({tmp_path / 'run.past-checkpoint-4-<time>'}) as --auto_resume false does: it is a file system of its own (a "
        "mount point), and a rename does not cross file systems; move it out of the folder yourself (mv "
        f"{out / 'checkpoint-8'} <elsewhere>), or delete it, then run the same command again"
    )
    assert left == "['run'] ['checkpoint-4', 'checkpoint-8']"  # nothing moved, made or unlisted


def test_going_back_in_a_users_own_folder_of_a_scratch_it_cannot_write_in_is_refused_before_anything_moves():
    """The same going back, the output folder a user's own in a site's scratch folder that only its admins write in
    (`--output_dir /scratch/<group>/<user>`): the rename into the folder beside failed with a PermissionError
    traceback once the data was read. Refused before anything moves, naming that folder. A real user of no rights
    (nobody) in a folder under /tmp: pytest's own are root's alone (0700)."""
    import shutil
    import tempfile

    from dpotrain import resolve

    scratch = Path(tempfile.mkdtemp(dir="/tmp", prefix="dpotrain-scratch-"))
    try:
        scratch.chmod(0o755)
        out = scratch / "alice"
        for step in (4, 8):
            sealed_checkpoint(out / f"checkpoint-{step}")
        (out / run_record.RESOLVED).write_text(json.dumps(run_record.sealed({"derived": {}})))
        names = [run_files.MANIFEST, run_record.RESOLVED, "checkpoint-4", "checkpoint-8"]
        run_files.write(out, names, complete=["checkpoint-4", "checkpoint-8"])
        for path in [out, *out.rglob("*")]:
            os.chown(path, 65534, 65534)
        named = str(out / "checkpoint-4")

        def going_back():
            os.setgid(65534)
            os.setuid(65534)  # nobody
            recipe = parse_args(train_args(out, "--auto_resume", "false", "--resume_from_checkpoint", named))
            try:
                resolve.check_output_dir(recipe)
            except ConfigError as e:
                print(e)

        code, stdout, stderr = in_child(going_back)
        assert code == 0, stderr
        assert stdout.splitlines()[-1] == (
            f"output_dir {str(out)!r}: checkpoint-8, saved past {named}, cannot be moved aside beside it "
            f"({scratch / 'alice.past-checkpoint-4-<time>'}) as --auto_resume false does: {scratch} is a folder this "
            f"job cannot write in; move it out of the folder yourself (mv {out / 'checkpoint-8'} <elsewhere>), or "
            "delete it, then run the same command again"
        ), stdout
        assert sorted(p.name for p in scratch.iterdir()) == ["alice"]
    finally:
        shutil.rmtree(scratch)


def test_a_named_checkpoint_rotated_away_is_refused_naming_the_newest_beside_it(tmp_path):
    """`--auto_resume false --resume_from_checkpoint out/checkpoint-4`, stopped after save_total_limit's rotation
    deleted checkpoint-4: the same command again was refused saying "a rerun of the same command resumes from the
    newest one by itself", which it does not (it was that command), nor without the flag under --auto_resume false.
    The refusal names the checkpoint to pass."""
    from dpotrain.train import resume

    out = tmp_path / "run"
    run_files.write(out, [run_files.MANIFEST, "checkpoint-6", "checkpoint-8"])
    for step in (6, 8):
        sealed_checkpoint(out / f"checkpoint-{step}")
    gone = out / "checkpoint-4"
    with pytest.raises(ConfigError) as refused:
        resume.check_explicit(str(gone), out)
    assert str(refused.value) == (
        f"resume_from_checkpoint {str(gone)!r} is not a folder: pass --resume_from_checkpoint {out / 'checkpoint-8'}, "
        "the newest verified checkpoint in output_dir"
    )
    # Another run's checkpoint, gone: the run's own progress since is what goes on (never the other run's newer one)
    other = tmp_path / "other"
    sealed_checkpoint(other / "checkpoint-10")
    with pytest.raises(ConfigError, match=f"pass --resume_from_checkpoint {out / 'checkpoint-8'}, "):
        resume.check_explicit(str(other / "checkpoint-4"), out)
    with pytest.raises(ConfigError, match="is not a folder: name a checkpoint-N folder"):  # nothing saved: as before
        resume.check_explicit(str(other / "checkpoint-4"), tmp_path / "new")
