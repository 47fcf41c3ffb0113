"""One W&B run per output folder: a requeued or resumed job logs to the run it started."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, python
from dpotrain.recipe.config import parse_args
from dpotrain.train.tracking import RUN_ID_FILE, setup_wandb


def test_resumed_job_reuses_the_wandb_run_id(tmp_path, monkeypatch):
    for var in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_DIR", "WANDB_NAME"):
        # setenv first so that monkeypatch restores the variable's absence afterwards: setup_wandb sets these in
        # os.environ, and a leaked WANDB_DIR would send later tests' W&B runs elsewhere.
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--report_to", "wandb", "--output_dir", str(tmp_path)]
    setup_wandb(parse_args(args).training, resumes=False)
    first = os.environ["WANDB_RUN_ID"]
    assert (tmp_path / RUN_ID_FILE).read_text() == first
    assert os.environ["WANDB_RESUME"] == "allow" and os.environ["WANDB_DIR"] == str(tmp_path)

    monkeypatch.delenv("WANDB_RUN_ID")  # the requeued job is a new process
    setup_wandb(parse_args(args).training, resumes=False)
    assert os.environ["WANDB_RUN_ID"] == first

    monkeypatch.delenv("WANDB_RUN_ID")
    other = tmp_path / "other"
    setup_wandb(parse_args([*args, "--output_dir", str(other)]).training, resumes=False)
    assert os.environ["WANDB_RUN_ID"] != first

    monkeypatch.delenv("WANDB_RUN_ID")
    (tmp_path / RUN_ID_FILE).write_text("")  # left empty by a kill between its creation and its write
    setup_wandb(parse_args(args).training, resumes=False)
    assert os.environ["WANDB_RUN_ID"] and (tmp_path / RUN_ID_FILE).read_text() == os.environ["WANDB_RUN_ID"]


@pytest.mark.parametrize("resumes", [False, True])
def test_a_rerun_from_step_1_after_an_attempt_that_logged_steps_logs_to_a_new_wandb_run(
    resumes, tmp_path, monkeypatch, capsys
):
    """An attempt killed at step 3 before its first checkpoint, then the same command with another learning rate (the
    folder holds no checkpoint, so nothing refuses it): the rerun trained from step 1 into the attempt's W&B run, and
    W&B kept the attempt's rows for steps 1-3 (it takes each step once), showing the old learning rate's curves. It
    now logs to a new W&B run, said in a line; a run that resumes from a checkpoint stays in the folder's."""
    for var in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_DIR"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    (tmp_path / RUN_ID_FILE).write_text("attempt1")
    rows = [{"step": step, "loss": 0.69, "learning_rate": 1e-4} for step in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--report_to", "wandb", "--output_dir", str(tmp_path)]
    setup_wandb(parse_args(args).training, resumes=resumes)
    run_id = os.environ["WANDB_RUN_ID"]
    assert (tmp_path / RUN_ID_FILE).read_text() == run_id and (run_id == "attempt1") == resumes
    said = f"an earlier attempt in {tmp_path} logged steps 1-3 to the W&B run 'attempt1' and saved no checkpoint"
    assert (said in capsys.readouterr().out) != resumes

    (tmp_path / "metrics.jsonl").write_text("")  # an attempt stopped before training logged nothing: its run is kept
    (tmp_path / RUN_ID_FILE).write_text("attempt1")
    monkeypatch.delenv("WANDB_RUN_ID")
    setup_wandb(parse_args(args).training, resumes=resumes)
    assert os.environ["WANDB_RUN_ID"] == "attempt1"


def test_wandb_is_not_imported_unless_reported_to(monkeypatch):
    """With `report_to: none` a run starts without importing wandb: here an import of it fails, as where it is not
    installed, and the callback's train begin still passes."""
    from transformers import TrainerControl, TrainerState

    from dpotrain.train.tracking import WandbStepIsGlobalStep

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    training = parse_args(
        ["--config", str(ROOT / "configs" / "smoke.yaml"), "--report_to", "none", "--output_dir", "/tmp/unused"]
    ).training
    WandbStepIsGlobalStep().on_train_begin(training, TrainerState(), TrainerControl())
    training.report_to = ["wandb"]
    with pytest.raises(ImportError):  # the same call does import it when W&B is used: the test can fail
        WandbStepIsGlobalStep().on_train_begin(training, TrainerState(), TrainerControl())


def test_the_offline_runs_of_a_run_replaced_in_the_folder_run_in_are_kept_beside_it(tmp_path, monkeypatch):
    """`--output_dir . --overwrite_output_dir` in a run's folder holding W&B offline runs: moving them aside named a
    folder beside `.` (ValueError: PosixPath('.') has an empty name), a traceback before the old run was removed."""
    from dpotrain.train.tracking import keep_offline_runs

    run = tmp_path / "my run"
    (run / "wandb" / "offline-run-1").mkdir(parents=True)
    monkeypatch.chdir(run)
    kept = keep_offline_runs(".")
    assert kept is not None and kept.parent == tmp_path and kept.name.startswith("my run.wandb-offline-"), kept
    assert (kept / "offline-run-1").is_dir() and not (run / "wandb").exists()


def test_offline_runs_under_a_wandb_dir_inside_the_runs_wandb_folder_are_kept_when_it_is_replaced(tmp_path, capsys):
    """WANDB_DIR=<output_dir>/wandb: W&B writes its offline runs to <output_dir>/wandb/wandb/offline-run-*, and
    `--overwrite_output_dir` deleted them with the run's `wandb` folder (only <output_dir>/wandb/offline-run-* was
    looked for), runs never synced and kept nowhere else. The sync command printed names where they are."""
    import glob
    import shlex

    from dpotrain import output_folder

    run = tmp_path / "run"
    (run / "wandb" / "wandb" / "offline-run-1").mkdir(parents=True)
    (run / "wandb" / "wandb" / "offline-run-1" / "run-1.wandb").write_text("history")
    output_folder.replace(run, ["wandb"])
    kept = list(tmp_path.glob("run.wandb-offline-*"))
    assert len(kept) == 1 and (kept[0] / "wandb" / "offline-run-1" / "run-1.wandb").read_text() == "history"
    words = shlex.split(capsys.readouterr().out.split("`")[1])
    assert words[:2] == ["wandb", "sync"] and glob.glob(words[2]) == [str(kept[0] / "wandb" / "offline-run-1")]


def test_replacing_a_run_with_offline_runs_in_a_folder_that_is_a_mount_point_is_refused_before_anything_moves(
    tmp_path,
):
    """`--overwrite_output_dir` of a run holding W&B offline runs, where the output folder is a file system of its own
    (a container's bind, a job's scratch mount): they cannot be renamed into the folder beside it, and the run ended in
    the traceback of an `OSError: [Errno 18] Invalid cross-device link` once the data was read. Refused before anything
    loads (the decision a dry run lists too), naming the fix; nothing moved (tmpfs here, as the real mount)."""
    from conftest import in_child
    from dpotrain import resolve
    from dpotrain.recipe.errors import ConfigError

    run = tmp_path / "run"
    run.mkdir()

    def replacing():
        (run / "wandb" / "offline-run-1").mkdir(parents=True)
        try:
            resolve.replacing(run, None)
        except ConfigError as e:
            print(e)
        print(sorted(p.name for p in tmp_path.iterdir()), sorted(p.name for p in (run / "wandb").iterdir()))

    code, stdout, stderr = in_child(replacing, tmpfs=[(run, "1m")])
    assert code == 0, stderr
    *_, refusal, left = stdout.splitlines()
    wandb = run / "wandb"
    assert refusal == (
        f"output_dir {str(run)!r}: the run there, which --overwrite_output_dir replaces, holds W&B offline runs "
        f"({wandb}, nowhere else until `wandb sync`), which cannot be moved aside beside it "
        f"({tmp_path / 'run.wandb-offline-<time>'}): it is a file system of its own (a mount point), and a rename does "
        f"not cross file systems; sync them (wandb sync {wandb}/offline-run-*) and delete {wandb}, or move it out of "
        "the folder yourself, then run the same command again"
    )
    assert left == "['run'] ['offline-run-1']"


def test_the_sync_command_for_the_kept_offline_runs_reads_back_as_printed(tmp_path, capsys):
    """`wandb sync /x/my run.wandb-offline-.../offline-run-*`, typed as printed, named two paths, neither of them."""
    import glob
    import shlex

    from dpotrain import output_folder

    run = tmp_path / "my run"
    (run / "wandb" / "offline-run-1").mkdir(parents=True)
    output_folder.replace(run, [])
    command = capsys.readouterr().out.split("`")[1]
    words = shlex.split(command)
    assert words[:2] == ["wandb", "sync"] and len(words) == 3, command
    assert [os.path.basename(p) for p in glob.glob(words[2])] == ["offline-run-1"], command


@pytest.mark.parametrize("name", ["my-exp", "run"])
def test_a_wandb_name_the_run_would_not_use_is_refused_in_one_line(name, tmp_path, monkeypatch, capsys):
    """WANDB_NAME set by the user: transformers hands run_name to wandb.init as the name, which wins over the
    variable, so the W&B run was named after the output folder and nothing said so. Refused, naming --run_name; a
    WANDB_NAME that is the run's name is no conflict."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_NAME", name)
    argv = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--report_to", "wandb", "--output_dir"]
    with pytest.raises(SystemExit):
        run_cli(lambda: train_dpo.main([*argv, str(tmp_path / "run"), "--dry-run"]))
    out = capsys.readouterr().out
    refusal = (
        "warning: the run would refuse: WANDB_NAME 'my-exp' is not used: the W&B run is named after run_name "
        "('run'): pass --run_name my-exp (which also names the default output_dir and hub_model_id) and unset "
        "WANDB_NAME"
    )
    assert (refusal in out) == (name == "my-exp") and "dry run of" in out, out


def test_a_wandb_run_id_the_user_gave_is_the_folders_for_the_rerun_without_it(tmp_path, monkeypatch, capsys):
    """`WANDB_RUN_ID=exp1 python train_dpo.py ...`, stopped, then the same command from another shell: the folder
    kept no id, so the resume logged to a new W&B run, its curves split in two. The id given is now the folder's; one
    given later over another recorded is taken and said."""
    for var in ("WANDB_RESUME", "WANDB_DIR"):  # set by setup_wandb: their absence restored afterwards
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setenv("WANDB_RUN_ID", "exp1")
    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--report_to", "wandb", "--output_dir", str(tmp_path)]
    setup_wandb(parse_args(args).training, resumes=False)
    monkeypatch.delenv("WANDB_RUN_ID")  # the rerun, from a shell without it
    setup_wandb(parse_args(args).training, resumes=False)
    assert os.environ["WANDB_RUN_ID"] == "exp1" and capsys.readouterr().err == ""
    monkeypatch.setenv("WANDB_RUN_ID", "exp2")
    setup_wandb(parse_args(args).training, resumes=False)
    assert (tmp_path / RUN_ID_FILE).read_text() == "exp2"
    assert capsys.readouterr().err == (
        f"warning: WANDB_RUN_ID 'exp2' is used: {tmp_path} logged to the W&B run 'exp1' until now, and logs on to "
        "'exp2' from here, and a rerun without WANDB_RUN_ID too (the folder's run is now 'exp2': rerun with "
        "WANDB_RUN_ID=exp1 to go back to 'exp1')\n"
    )
    monkeypatch.delenv("WANDB_RUN_ID")  # what the warning says: without the variable, the folder's new run
    setup_wandb(parse_args(args).training, resumes=False)
    assert os.environ["WANDB_RUN_ID"] == "exp2" and capsys.readouterr().err == ""
    monkeypatch.setenv("WANDB_RUN_ID", "exp1")  # its advice: back to the first run, which the folder keeps again
    setup_wandb(parse_args(args).training, resumes=False)
    assert (tmp_path / RUN_ID_FILE).read_text() == "exp1" and "logs on to 'exp1'" in capsys.readouterr().err


@pytest.mark.parametrize("run_id", ["exp1", "exp2"])
def test_a_wandb_run_id_naming_the_run_overwrite_replaces_is_refused(run_id, tmp_path, monkeypatch, capsys):
    """`WANDB_RUN_ID=exp1` fixed in the environment, and `--overwrite_output_dir` over the finished run that logged to
    exp1: the new run logged into exp1 again from step 1, where W&B drops every step at or below exp1's last, and
    nothing said so. Refused, naming the fix; another id (or none) is a W&B run of its own."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli
    from dpotrain.train import run_files

    out = tmp_path / "run"
    out.mkdir()
    (out / "run_complete.json").write_text("{}\n")  # a finished run, which logged to the W&B run exp1
    (out / RUN_ID_FILE).write_text("exp1")
    run_files.write(out, [run_files.MANIFEST, "run_complete.json", RUN_ID_FILE])
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_RUN_ID", run_id)
    argv = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--report_to", "wandb", "--output_dir", str(out)]
    with pytest.raises(SystemExit):
        run_cli(lambda: train_dpo.main([*argv, "--overwrite_output_dir", "--dry-run"]))
    refusal = (
        f"WANDB_RUN_ID 'exp1' is the W&B run of the run --overwrite_output_dir replaces ({out / RUN_ID_FILE}), whose "
        "steps W&B keeps over this run's from step 1 on, dropping them: unset WANDB_RUN_ID (a new W&B run) or set a "
        "new one"
    )
    printed = capsys.readouterr().out
    assert (f"warning: the run would refuse: {refusal}" in printed) == (run_id == "exp1"), printed


def test_a_wandb_resume_value_wandb_refuses_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """WANDB_RESUME=true (older guides' value): wandb.init refused it with a pydantic traceback once W&B started, after
    the model loaded and the reference was scored (hours on the think recipe)."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_RESUME", "true")
    argv = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--report_to", "wandb", "--output_dir"]
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main([*argv, str(tmp_path / "run")]))
    assert ended.value.code == 2 and not (tmp_path / "run").exists()
    assert capsys.readouterr().err.endswith(
        "error: WANDB_RESUME 'true' is not one wandb takes (allow, must, never, auto): unset WANDB_RESUME (the run "
        "logs on to its output folder's W&B run by itself)\n"
    )


def test_a_wandb_run_id_wandb_refuses_is_refused_before_the_model_loads_and_not_kept(tmp_path, monkeypatch, capsys):
    """WANDB_RUN_ID=exp/1 (a character W&B reserves): wandb.init refused it in a UsageError traceback once W&B started,
    after the model loaded and the reference was scored, and the id was already the folder's (.wandb_run_id), so the
    rerun without the variable failed the same way, each time after the reference stage."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_RUN_ID", "exp/1")
    argv = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--report_to", "wandb", "--output_dir"]
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main([*argv, str(tmp_path / "run")]))
    assert ended.value.code == 2 and not (tmp_path / "run").exists()
    assert capsys.readouterr().err.endswith(
        "error: WANDB_RUN_ID 'exp/1' is not an id W&B takes (Run ID cannot contain the characters: :;,#?/'): set "
        "another, or unset WANDB_RUN_ID (the run logs on to its output folder's W&B run by itself)\n"
    )


@pytest.mark.slow
def test_a_folders_wandb_run_id_wandb_refuses_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """.wandb_run_id edited between attempts to a W&B path (`myteam/dpo/abc123`, pasted from its URL) or damaged: the
    resume took it, and wandb.init refused it in a UsageError traceback once W&B started, after the model loaded and
    the reference was scored. Only WANDB_RUN_ID was checked before anything loads. Here the run a health guard stopped,
    gone on with --health_action warn."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    out = tmp_path / "run"
    argv = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--report_to", "wandb", "--output_dir", str(out)]
    argv += ["--max_steps", "10", "--logging_steps", "1", "--learning_rate", "3e-3"]  # loss_floor stops it
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main(argv))
    assert ended.value.code == 3 and (out / "health_stop.json").is_file()
    (out / RUN_ID_FILE).write_text("myteam/dpo/abc123\n")
    env = {k: v for k, v in os.environ.items() if k != "WANDB_RUN_ID"}  # the first run's setup_wandb set it here
    rerun = [python(), str(ROOT / "train_dpo.py"), *argv, "--health_action", "warn"]  # a new process, as a user's
    ended = subprocess.run(rerun, env=env, capture_output=True, text=True, timeout=300)
    assert ended.returncode == 2 and "Resuming" not in ended.stdout, ended.stderr[-2000:]
    assert ended.stderr.endswith(
        f"error: {out / RUN_ID_FILE} holds 'myteam/dpo/abc123', not an id W&B takes (Run ID cannot contain the "
        "characters: :;,#?/'): write the W&B run's id alone there (the last part of its URL), or delete the file to "
        "log to a new W&B run\n"
    )


@pytest.mark.parametrize(
    ("variable", "value", "field"),
    [("WANDB_MODE", "Offline", "mode"), ("WANDB_CONSOLE", "bogus", "console"), ("WANDB_HTTP_TIMEOUT", "30s", "x_")],
)
def test_a_wandb_variable_wandb_refuses_is_refused_before_the_model_loads(
    variable, value, field, tmp_path, monkeypatch, capsys
):
    """WANDB_MODE=Offline (capitalized), WANDB_CONSOLE=bogus, WANDB_HTTP_TIMEOUT=30s: wandb.init refused each with a
    pydantic ValidationError traceback once W&B started, after the model loaded and the reference was scored."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv(variable, value)
    argv = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--report_to", "wandb", "--output_dir"]
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main([*argv, str(tmp_path / "run")]))
    err = capsys.readouterr().err
    assert ended.value.code == 2 and not (tmp_path / "run").exists(), err
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: {variable} {value!r} is not a value W&B takes ({field}") and "Traceback" not in err
    assert line.endswith(f"set it as wandb's documentation gives it, or unset {variable}")


def test_a_wandb_dir_wandb_cannot_write_in_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """WANDB_DIR where W&B cannot write (here under a file; a read-only or another user's folder): wandb warned, once
    W&B started after the model loaded and the reference was scored, and wrote the run's W&B files to the system's
    temporary folder instead (a node's local /tmp, gone with the job: offline runs never synced lost)."""
    import tempfile

    import train_dpo
    from dpotrain.recipe.errors import run_cli

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(blocked / "wandb"))
    argv = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--report_to", "wandb", "--output_dir"]
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main([*argv, str(tmp_path / "run")]))
    assert ended.value.code == 2 and not (tmp_path / "run").exists()
    assert capsys.readouterr().err.endswith(
        f"error: WANDB_DIR {blocked}/wandb is not writable (Not a directory in {blocked}), and W&B would write this "
        f"run's files to {tempfile.gettempdir()} instead: set WANDB_DIR to a writable folder, or unset it (W&B's "
        "files then go in the output folder)\n"
    )


def test_a_wandb_dir_set_empty_is_unset_and_the_runs_wandb_files_go_in_its_folder(tmp_path, monkeypatch):
    """`WANDB_DIR= python train_dpo.py ...` (or `WANDB_DIR=` in .env: a variable set empty clears it, docs/running.md):
    the run kept the empty value, and wandb, unable to create a folder named "", wrote the run's files to the
    system's temporary folder (a node's local /tmp, gone with the job) instead of the output folder."""
    for var in ("WANDB_RUN_ID", "WANDB_RESUME"):  # set by setup_wandb: their absence restored afterwards
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--report_to", "wandb", "--output_dir", str(tmp_path)]
    for empty in ("", " "):
        monkeypatch.setenv("WANDB_DIR", empty)
        setup_wandb(parse_args(args).training, resumes=False)
        assert os.environ["WANDB_DIR"] == str(tmp_path)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "mine"))  # one given is the user's
    setup_wandb(parse_args(args).training, resumes=False)
    assert os.environ["WANDB_DIR"] == str(tmp_path / "mine")


def test_a_run_without_a_wandb_project_says_where_it_logs(tmp_path, monkeypatch, capsys):
    """Without WANDB_PROJECT (none in .env, none in the recipe's env:) transformers logs to its default project,
    "huggingface", and the run said nothing of it: its curves were then looked for in vain in the project the user
    thought of. One line names the project and the fix; a project set, or W&B off, says nothing."""
    for var in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_DIR", "WANDB_PROJECT", "WANDB_MODE"):
        monkeypatch.setenv(var, "")  # restored to its absence afterwards: setup_wandb sets some in os.environ
        monkeypatch.delenv(var)
    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--report_to", "wandb", "--output_dir", str(tmp_path)]
    setup_wandb(parse_args(args).training, resumes=False)
    assert capsys.readouterr().out == (
        "note: W&B logs this run to the project 'huggingface' (transformers' default: WANDB_PROJECT is not set): set "
        "WANDB_PROJECT=... in .env, or in the recipe's env:, to log to another\n"
    )
    for var, value in (("WANDB_PROJECT", "olmo3-dpo"), ("WANDB_MODE", "disabled")):
        monkeypatch.setenv(var, value)
        setup_wandb(parse_args(args).training, resumes=False)
        assert capsys.readouterr().out == ""
        monkeypatch.delenv(var)


@pytest.mark.parametrize("variable", ["WANDB_NAME", "WANDB_RESUME"])
def test_wandb_variables_are_refused_before_the_ranks_meet(variable, tmp_path, monkeypatch, capsys):
    """Refused before the process group starts, where the line is written once per job: in output_checks, after the
    ranks met, every rank wrote it. Before the output folder's checks, then (here: an output_dir that is a file)."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv(variable, "true")
    (tmp_path / "file").write_text("a person's file\n")
    argv = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--report_to", "wandb", "--output_dir"]
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main([*argv, str(tmp_path / "file")]))
    assert ended.value.code == 2 and f"error: {variable} 'true' is not" in capsys.readouterr().err


@pytest.mark.slow
def test_the_wandb_config_is_the_runs_resolved_config(tmp_path, tiny_model_dir):
    """W&B's config held transformers' arguments as handed to TRL, not the run's: `padding_free: false` for a packed
    run, `push_to_hub: false` for one that pushes, and no data set, base model path, LoRA or batching setting, so runs
    compared or filtered in W&B by their settings were told apart wrongly. It holds resolved_config.json's settings."""
    from test_honest_runs import first_pairs, train, wandb_records

    args = [
        "--dataset_name",
        first_pairs(tmp_path, 1),
        "--max_steps",
        "1",
        "--warmup_steps",
        "0",
        "--save_strategy",
        "no",
    ]
    out, _ = train(tmp_path, tiny_model_dir, *args, "--report_to", "wandb")
    [run_file] = out.glob("wandb/offline-run-*/run-*.wandb")
    logged = {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        for item in record.run.config.update if kind == "run" else record.config.update if kind == "config" else ():
            logged[item.key] = json.loads(item.value_json)
    logged = {k: v.get("value") if isinstance(v, dict) and "value" in v else v for k, v in logged.items()}
    resolved = json.loads((out / "resolved_config.json").read_text())
    settings = {k: v for k, v in resolved.items() if k not in ("derived", "written_sha256")}
    assert resolved["padding_free"] is True and resolved["dataset_name"]  # what the claim is about
    differ = {k: (v, logged.get(k, "<missing>")) for k, v in settings.items() if logged.get(k, "<missing>") != v}
    assert not differ, differ
