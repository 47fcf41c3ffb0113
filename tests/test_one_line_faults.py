"""Faults met outside training's own steps, each acted out as it happens, each ending in one line (or a warning) and
never in a traceback: a record cut short by a crash, a full disk in the run's other writes, a read-only output folder
or home, a model without a chat template, W&B out of reach, Ctrl-C while the libraries load."""

import errno
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_refusals import SMOKE, refused

from conftest import PYTHON, ROOT, in_child, python
from dpotrain.recipe import records, run_record
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError, RunError

# --- records cut short ------------------------------------------------------------------------------------------------


def test_a_torn_last_record_is_dropped_once_with_a_warning_and_a_torn_middle_one_is_an_error(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    whole = [{"step": 1, "loss": 0.69}, {"step": 2, "loss": 0.6}]
    path.write_text("".join(json.dumps(r) + "\n" for r in whole) + '{"step": 3, "lo')  # the node lost mid-append
    assert records.read(path) == whole
    assert records.read(path) == whole
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and f"{path}: dropped its last line (3: 15 bytes, cut short" in err, err

    records.append(path, [{"step": 3, "loss": 0.5}])  # the rerun's record of step 3 does not join the torn one
    assert records.read(path) == [*whole, {"step": 3, "loss": 0.5}]
    assert path.read_text().endswith('"loss": 0.5}\n')

    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[1][:9] + "\n" + lines[2])  # not what a crash while appending leaves
    with pytest.raises(RunError, match=f"^{path}: line 2 is not a JSON record .*restore it, or delete that line"):
        records.read(path)


def test_two_processes_appending_at_once_lose_no_record(tmp_path):
    """hub_pushes.jsonl is appended by a run's background pusher and by push_to_hub.py, two processes. Each append
    checked the file's end for a line torn by a crash: one seen while the other process's line was half written was cut
    off as torn (a tenth of 2 x 5,000 lines lost)."""
    path = tmp_path / "hub_pushes.jsonl"
    appender = (
        "import sys; from dpotrain.recipe import records\n"
        "for i in range(3000): records.append(sys.argv[1], [{'who': sys.argv[2], 'i': i, 'pad': 'x' * (150 + i % 97)}])"
    )
    writers = [subprocess.Popen([PYTHON, "-c", appender, str(path), who], cwd=ROOT) for who in "ab"]
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    lines = records.read(path)
    assert len(lines) == 6000 and all(sorted(r["i"] for r in lines if r["who"] == w) == list(range(3000)) for w in "ab")


def test_a_line_another_process_is_appending_is_read_whole_not_dropped_as_torn(tmp_path, capsys):
    """push_to_hub.py reads hub_pushes.jsonl while the run's pusher appends, a plot reads metrics.jsonl while the run
    logs: a line half written (an append holds the file's lock until it has written it) was dropped with the
    warning a crash earns. A second process appends here, stopped halfway through its line, as a slow disk leaves it."""
    path = tmp_path / "hub_pushes.jsonl"
    records.append(path, [{"step": 1}])
    appender = (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND); fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, b'{\"step\": 2, '); print('half', flush=True); time.sleep(1.5); os.write(fd, b'\"x\": 1}\\n')"
    )
    writer = subprocess.Popen([PYTHON, "-c", appender, str(path)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline() == "half\n"
    assert records.read(path) == [{"step": 1}, {"step": 2, "x": 1}]
    assert writer.wait(timeout=30) == 0
    assert "warning" not in capsys.readouterr().err


def strict(text: str) -> list:
    """Each line of `text` as JSON, refusing Python's NaN/Infinity tokens as every other JSON reader does."""

    def no_such_number(token):
        raise ValueError(f"{token} is no JSON")

    return [json.loads(line, parse_constant=no_such_number) for line in text.splitlines()]


def test_a_nan_or_infinite_metric_is_written_as_strict_json_and_reads_back_as_none(tmp_path):
    """A loss that diverged (health_checks off) was appended as the bare NaN token: jq, pandas' strict readers and
    JavaScript refuse the file. It is written null; a file written so before still reads (json takes its NaN)."""
    from dpotrain.train import metrics

    path = tmp_path / "metrics.jsonl"
    nan = float("nan")
    records.append(path, [{"step": 1, "loss": 0.69}, {"step": 2, "loss": nan, "grad_norm": float("inf")}])
    records.append(path, [{"step": 3, "loss": nan, "nested": [{"x": float("-inf")}]}])
    assert strict(path.read_text()) == [
        {"step": 1, "loss": 0.69},
        {"step": 2, "loss": None, "grad_norm": None},
        {"step": 3, "loss": None, "nested": [{"x": None}]},
    ]
    assert metrics.read_metrics(tmp_path)[1] == {"step": 2, "loss": None, "grad_norm": None}
    metrics.keep_before(path, 3)  # a resume's trim writes the history again, as strictly
    assert strict(path.read_text()) == [{"step": 1, "loss": 0.69}, {"step": 2, "loss": None, "grad_norm": None}]
    assert records.dumps({"summary": {"final": {"loss": nan}}}, indent=2) == (
        '{\n  "summary": {\n    "final": {\n      "loss": null\n    }\n  }\n}'
    )  # run_complete.json's writer
    old = tmp_path / "old.jsonl"
    old.write_text('{"step": 2, "loss": NaN}\n')  # written by an earlier version: still read
    assert [r["step"] for r in metrics.read_metrics(old)] == [2]


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"note": "lowered the learning rate here"}', "its step is None, not a number"),
        ('{"step": "2", "loss": 0.6}', "its step is '2', not a number"),
        ("[2, 0.6]", "a JSON list, not an object"),
    ],
)
def test_a_metrics_line_edited_into_json_that_is_no_record_is_the_same_one_line_error(line, problem, tmp_path):
    """A resume trims metrics.jsonl by step at its first logged step, the plot draws against it: a line that is JSON
    but no record (a note, a quoted step) ended the resumed run in a KeyError or TypeError traceback, every rerun."""
    from dpotrain.train import metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text(f'{{"step": 1, "loss": 0.69}}\n{line}\n{{"step": 3, "loss": 0.5}}\n')
    for read_back in (lambda: metrics.keep_before(path, 3), lambda: metrics.read_metrics(tmp_path)):
        with pytest.raises(RunError) as ended:
            read_back()
        assert str(ended.value) == (
            f"{path}: line 2 is not a JSON record ({problem}); a crash can cut only the last line of this file, so "
            "it was changed by hand or another program: restore it, or delete that line, then rerun"
        )


@pytest.mark.slow
def test_a_record_that_does_not_fit_leaves_no_part_of_its_line_and_a_full_output_folder_is_named(tmp_path):
    """On a full disk (a real small tmpfs), an append fails whole: the file is byte for byte what it was. And a write
    refused for a full disk without a file name (os.write on a descriptor: OSError ENOSPC, filename None) in the output
    folder, on a second small tmpfs: the line named the caches' free space, not the folder that is full. One forked
    child of this process for both, its own mount namespace holding the two disks (`in_child`): a fresh interpreter
    under `unshare` imported the stack again (~6 CPU-s), most of either's cost."""
    folder, run = tmp_path / "disk", tmp_path / "run"
    folder.mkdir()
    run.mkdir()
    code = f"""
import json, os
from pathlib import Path
from dpotrain.recipe import records, run_record
from dpotrain.train import disk_full
from dpotrain.train.metrics import plot_metrics
from dpotrain.hub.hub import write_model_card
from dpotrain.recipe import run_record
disk = Path({str(folder)!r})
path = disk / "metrics.jsonl"
records.append(path, [{{"step": 1, "loss": 0.69}}])
try:
    with open(disk / "filler", "wb") as f:  # another job fills the disk
        f.write(b"x" * (1 << 20))
except OSError:
    pass
before = path.read_bytes()
for name, write in [("metrics", lambda: records.append(path, [{{"step": s, "loss": 0.5}} for s in range(2, 500)])),
                    ("plot", lambda: plot_metrics([{{"step": s, "loss": 1 / s}} for s in range(1, 50)],
                                                  disk / "training_curves.png")),
                    ("card", lambda: write_model_card(disk, run_record.of({{}}), None))]:
    try:
        write()
        print(name, "written")
    except Exception as e:
        print(name, disk_full.write_failed(*disk_full.full_write(e)))
print("unchanged", path.read_bytes() == before, sorted(os.listdir(disk)))

run = Path({str(run)!r})
disk_full.take_output_dir(run)  # as train_dpo.py does once the recipe is read
fd = os.open(run / "shard.bin", os.O_WRONLY | os.O_CREAT)
try:
    while True:
        os.write(fd, b"x" * 4096)
except OSError as e:
    assert e.filename is None, e
    print(disk_full.write_failed(*disk_full.full_write(e)))
"""
    code, stdout, stderr = in_child(lambda: exec(code, {}), tmpfs=[(folder, "64k"), (run, "64k")])
    assert code == 0, stderr[-3000:]
    lines = stdout.strip().splitlines()
    for name, file in [("metrics", "metrics.jsonl"), ("plot", "training_curves.png"), ("card", "README.md")]:
        assert f"{name} the disk is full: {folder / file} could not be written (" in stdout, stdout
    assert all("free there): free space there, then rerun" in line for line in lines[:3]), lines
    assert lines[3] == "unchanged True ['filler', 'metrics.jsonl']"  # no half-written file, no temporary one
    assert lines[4:] == [
        f"the disk is full: a file could not be written in the output folder, {run}, 0 bytes free there: free "
        "space there, or set --output_dir to a folder with room, then rerun"
    ], stdout


@pytest.mark.slow
def test_every_write_of_a_run_on_a_read_only_file_system_is_one_line(tmp_path):
    """The records (metrics, samples and pushes append the same way), the plot, the card, a checkpoint (torch.save's
    writer loses the errno: the folder is probed) and the final model, on a real read-only mount: why and what to do,
    nothing about space."""
    disk = tmp_path / "run"
    disk.mkdir()
    records.append(disk / "metrics.jsonl", [{"step": 1, "loss": 0.69}])
    (disk / "checkpoint-2").mkdir()
    (disk / "checkpoint-2" / "COMPLETE").touch()
    code = f"""
import torch
from pathlib import Path
from dpotrain.recipe import records, run_record
from dpotrain.train import disk_full
from dpotrain.train.metrics import plot_metrics
from dpotrain.hub.hub import write_model_card
disk = Path({str(disk)!r})
for name, write in [("metrics", lambda: records.append(disk / "metrics.jsonl", [{{"step": 2, "loss": 0.5}}])),
                    ("plot", lambda: plot_metrics([{{"step": 1, "loss": 1.0}}], disk / "training_curves.png")),
                    ("card", lambda: write_model_card(disk, run_record.of({{}}), None))]:
    try:
        write()
        print(name, "written")
    except Exception as e:
        print(name, disk_full.write_failed(*disk_full.full_write(e)))
try:
    torch.save({{"step": 4}}, str(disk / "checkpoint-4" / "optimizer.pt"))
except Exception as e:
    print("checkpoint", disk_full.save_failed(disk / "checkpoint-4", disk_full.why_full(e, disk)))
print("final", disk_full.final_save_failed(disk, disk_full.why_full(RuntimeError("file write failed"), disk)))
"""
    code, stdout, stderr = in_child(lambda: exec(code, {}), read_only=[disk])  # forked: the stack is imported
    assert code == 0, stderr[-3000:]
    why = "the file system is read-only" if os.geteuid() == 0 else "permission is denied"
    fix = (
        "make it writable again (a file system remounted read-only after a disk error needs its administrator)"
        if os.geteuid() == 0
        else "give this job write permission there"
    )
    after = "checkpoint-2 is kept, and the same command goes on from it"
    assert stdout.splitlines() == [
        f"metrics {why}: {disk}/metrics.jsonl could not be written: {fix}, then rerun; {after}",
        f"plot {why}: {disk}/training_curves.png could not be written: {fix}, then rerun; {after}",
        f"card {why}: {disk}/README.md could not be written: {fix}, then rerun; {after}",
        f"checkpoint {why}: checkpoint-4 could not be written in {disk}: {fix}, then rerun; {after}",
        f"final {why}: the final model could not be written in {disk}: {fix}, then rerun; the same command goes on "
        "from checkpoint-2",
    ], stdout


def test_a_failed_save_of_a_run_that_does_not_resume_by_itself_names_the_checkpoint_to_pass(tmp_path):
    """A run of `auto_resume: false` whose checkpoint or final model did not fit was told "the same command goes on
    from checkpoint-2", and the same command then refused: "has checkpoints and auto_resume is false"."""
    from dpotrain.train import disk_full

    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "COMPLETE").touch()
    full = disk_full.FULL[errno.ENOSPC]
    assert str(disk_full.final_save_failed(out, full)).endswith("the same command goes on from checkpoint-2")
    (out / run_record.RESOLVED).write_text(json.dumps({"auto_resume": False}))
    after = (
        f"checkpoint-2 is kept: add --resume_from_checkpoint {out}/checkpoint-2 to go on from it (auto_resume is false)"
    )
    assert str(disk_full.final_save_failed(out, full)).endswith(f"then rerun; {after}")
    assert str(disk_full.save_failed(out / "checkpoint-4", full)).endswith(f"then rerun; {after}")
    # a record edited out of shape (a spread without its mean) is no KeyError in the line: its auto_resume is read alone
    (out / run_record.RESOLVED).write_text(
        json.dumps({"auto_resume": False, "per_device_train_batch_size": {"min": 1}})
    )
    assert str(disk_full.final_save_failed(out, full)).endswith(f"then rerun; {after}")


# --- one line where a traceback was -----------------------------------------------------------------------------------


READ_ONLY = "Read-only file system" if os.geteuid() == 0 else "Permission denied"  # a mount for root, else a mode


def run_in(args, read_only=(), env=None) -> tuple[int, str, str]:
    """`python train_dpo.py --config SMOKE ARGS` as its process ends it (`run_cli`), in a forked child of this process
    with `read_only` folders mounted read-only and `env` read as at import (conftest's `in_child`): the exit code,
    stdout and stderr. A fresh interpreter imported the stack again (~6 CPU-s) for a refusal at the checks."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    return in_child(lambda: run_cli(lambda: train_dpo.main(["--config", SMOKE, *args])), read_only, env=env)


def test_a_read_only_output_location_is_one_line_before_anything_loads(tmp_path, tiny_model_dir):
    shared = tmp_path / "outputs"
    shared.mkdir()
    out = shared / "run"
    code, stdout, stderr = run_in(["--output_dir", str(out), "--model_name_or_path", tiny_model_dir], [shared])
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        f"error: output_dir {str(out)!r}: cannot write in {shared} ({READ_ONLY}): pass --output_dir a "
        "folder this job can write in"
    )
    assert "Data (train)" not in stdout + stderr  # refused before the data loaded, the model too


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_a_path_past_the_file_systems_limits_is_one_line_at_the_checks(tmp_path, monkeypatch, capsys, dry_run):
    """A name over NAME_MAX (255 bytes on Linux's file systems), a path over PATH_MAX (4096 bytes) with the room the
    run needs inside its folder, an input named past the limits: OSError: [Errno 36] File name too long, before."""
    long_name = tmp_path / ("x" * 256) / "run"
    line = refused(tmp_path, monkeypatch, capsys, "--output_dir", str(long_name), *dry_run)
    assert line == (
        f"error: output_dir {str(long_name)!r}: the name 'xxxxxxxxxxxxxxxxxxxxxxxx...' in it is 256 bytes, and this "
        "file system takes names of at most 255 bytes (NAME_MAX): give a shorter name"
    )
    deep = tmp_path / "/".join(["y" * 200] * ((4096 - 256 - len(str(tmp_path))) // 201 + 1))  # under 4096 bytes
    line = refused(tmp_path, monkeypatch, capsys, "--output_dir", str(deep), *dry_run)
    assert line == (
        f"error: output_dir {str(deep)!r}: the path is {len(str(deep))} bytes, and the run's own names inside it take "
        "up to 256 more; this file system takes paths of at most 4096 bytes (PATH_MAX): give a shorter path"
    )
    data = tmp_path / ("z" * 300 + ".jsonl")
    line = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(data), *dry_run)
    assert line.startswith(f"error: dataset_name {str(data)!r}: the name 'zzzzzzzzzzzzzzzzzzzzzzzz...' in it is 306 ")
    recipe = tmp_path / ("r" * 256 + ".yaml")  # read as the arguments are parsed, before the checks
    with pytest.raises(ConfigError, match=rf"^config '{recipe}': the name 'r{{24}}\.\.\.' in it is 261 bytes, "):
        parse_args(["--config", str(recipe), *dry_run])


def test_a_name_near_the_limit_is_written_and_the_dry_runs_record_past_it_is_one_line(tmp_path):
    """A record named within NAME_MAX was written under a temporary name 20-odd bytes longer ('.<name>.<host>.<pid>
    .tmp'): OSError: [Errno 36] File name too long. And the dry run's record beside an output_dir the run takes (a
    name of 243 bytes) is 13 bytes longer: a traceback, not a line naming the fix."""
    from dpotrain import dry_run
    from dpotrain.recipe import writes

    long = tmp_path / ("n" * 250)
    writes.write_text(long, "whole\n")
    assert long.read_text() == "whole\n" and [p.name for p in tmp_path.iterdir()] == [long.name]
    assert dry_run.write_json({}, str(tmp_path / ("o" * 242))).name == "o" * 242 + ".dry-run.json"
    output_dir = tmp_path / ("o" * 243)
    with pytest.raises(ConfigError) as refused:
        dry_run.write_json({}, str(output_dir))
    assert str(refused.value) == (
        "the dry run's record (beside --output_dir; --json prints it instead) "
        f"'{output_dir}.dry-run.json': the name 'oooooooooooooooooooooooo...' in it is 256 bytes, and this file system "
        "takes names of at most 255 bytes (NAME_MAX): give a shorter name"
    )


@pytest.mark.slow
def test_a_model_without_a_chat_template_for_message_lists_is_refused_as_the_analyzer_refuses_it(
    tmp_path, monkeypatch, capsys, tiny_model_dir
):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").unlink()  # an exported model with its tokenizer only
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(model), "--report_to", "none")
    assert line == (
        f"error: the tokenizer of {model} has no chat template, and the data set's rows are message lists, which need "
        "one: give one with --chat_template_path FILE.jinja, or use a model folder whose tokenizer has one "
        "(chat_template.jinja beside tokenizer_config.json, or a chat_template entry in it)"
    )
    assert not (tmp_path / "run").exists()  # before anything was written, the model's weights unread
    analyzer = subprocess.run(
        [
            python(),  # warm: the analyzer's refusal, not its start-up, is under test
            str(ROOT / "scripts" / "analyze_dataset.py"),
            str(ROOT / "data" / "smoke_prefs.jsonl"),
            "--tokenizer",
            str(model),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert analyzer.returncode == 2 and analyzer.stderr.strip().splitlines()[-1] == line, analyzer.stderr[-2000:]


@pytest.mark.slow
def test_wandb_out_of_reach_is_refused_in_seconds_and_offline_mode_asks_nothing(
    tmp_path, monkeypatch, capsys, counted_silent_endpoint
):
    from dpotrain import options
    from dpotrain.recipe.config import parse_args

    endpoint, asked = counted_silent_endpoint  # a server behind a firewall: it takes connections, answers none
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
    monkeypatch.setenv("WANDB_BASE_URL", endpoint)
    line = refused(tmp_path, monkeypatch, capsys, "--report_to", "wandb")
    # In seconds: the refusal is the probe's own deadline ("no answer within 3 s", said by offline.within when it gave
    # up), after one request, none of wandb.init's minutes of retries.
    assert line == (
        f"error: report_to wandb, and W&B does not answer here ({endpoint}: no answer within 3 s): set "
        "WANDB_MODE=offline to log to files (sync them later with `wandb sync`), fix WANDB_BASE_URL / HTTPS_PROXY, or "
        "pass --report_to none"
    )
    assert asked() == 1
    monkeypatch.setenv("WANDB_MODE", "offline")
    options.check_wandb_reachable(parse_args(["--config", SMOKE, "--report_to", "wandb"]))
    assert asked() == 1  # nothing asked


def test_a_read_only_home_names_the_datasets_cache_not_the_data_file(tmp_path, tiny_model_dir):
    """DPOTRAIN_CACHE moved the project's caches off a read-only home; datasets' cache is still there."""
    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    unset = dict.fromkeys(["HF_HOME", "HF_DATASETS_CACHE", "XDG_CACHE_HOME"])  # datasets' default cache
    args = ["--output_dir", str(tmp_path / "run"), "--model_name_or_path", tiny_model_dir, "--report_to", "none"]
    code, _, stderr = run_in(args, [home], env={**unset, "HOME": str(home), "DPOTRAIN_CACHE": str(cache)})
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        f"error: the datasets cache {home}/.cache/huggingface/datasets is not writable ({READ_ONLY} in "
        f"{home}), and datasets caches every data set it reads there, local files too: set HF_HOME (or "
        "HF_DATASETS_CACHE) to a writable folder"
    )


def test_an_unwritable_modules_cache_is_one_line_before_a_model_with_its_own_code_loads(tmp_path, tiny_model_dir):
    """transformers imports a model's own code (`--trust_remote_code true`) from a copy it writes under
    HF_MODULES_CACHE (HF_HOME/modules): one it cannot create (here under a file; a read-only HF_HOME, a folder of
    another user) ended the run's first half in a `NotADirectoryError` traceback from transformers' dynamic modules."""
    from test_architectures import remote_code_model

    model = remote_code_model(tmp_path / "model", tiny_model_dir)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    args = ["--output_dir", str(tmp_path / "run"), "--model_name_or_path", str(model), "--trust_remote_code", "true"]
    code, _, stderr = run_in([*args, "--report_to", "none"], env={"HF_MODULES_CACHE": str(blocked / "modules")})
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        f"error: transformers' modules cache {blocked}/modules is not writable (Not a directory in {blocked}), and "
        "a model with its own code (trust_remote_code) is imported from a copy of that code written there: set "
        "HF_MODULES_CACHE (or HF_HOME) to a writable folder"
    )


def test_a_home_that_is_a_file_is_one_line_naming_home_hf_home_or_hf_token(tmp_path):
    """HOME pointing at a file (a cluster's compute node, a service account): huggingface_hub's read of its saved login
    under HOME, which it allows to be missing but nothing else, ended a dry run in a NotADirectoryError traceback."""
    home = tmp_path / "home"
    home.write_text("")
    unset = dict.fromkeys(["HF_HOME", "XDG_CACHE_HOME", "HF_TOKEN", "HF_TOKEN_PATH"])
    code, _, stderr = run_in(["--output_dir", str(tmp_path / "run"), "--dry-run"], env={**unset, "HOME": str(home)})
    assert code == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        f"error: cannot read the saved Hugging Face token {home}/.cache/huggingface/token (Not a directory): set HOME "
        "to your home folder, or HF_HOME to a folder of yours (the Hub libraries keep their login and caches there), "
        "or HF_TOKEN"
    )


@pytest.mark.slow  # a fresh interpreter importing torch and the libraries (4.6 s in CI's run)
def test_a_torch_compile_cache_that_cannot_be_made_is_one_line_as_the_libraries_load(tmp_path):
    """torch makes TORCHINDUCTOR_CACHE_DIR as the libraries are imported (dynamo's disk cache, with transformers): one
    it cannot make (under a file here; a folder of another user, or a /scratch path not mounted on this node) ended
    every command, a dry run too, in a `NotADirectoryError` traceback of torch's import."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(blocked / "inductor")}
    cmd = [PYTHON, str(ROOT / "train_dpo.py"), "--config", SMOKE, "--dry-run"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: torch's compile cache TORCHINDUCTOR_CACHE_DIR={blocked}/inductor cannot be made (Not a directory: "
        f"{blocked}/inductor): set TORCHINDUCTOR_CACHE_DIR to a folder this job can write in, or unset it"
    )


@pytest.mark.slow
def test_ctrl_c_while_the_libraries_load_is_one_line():
    # SIGINT as a terminal's Ctrl-C delivers it (a shell's background job, which this may run under, ignores it)
    proc = subprocess.Popen(
        [PYTHON, str(ROOT / "train_dpo.py"), "--config", SMOKE, "--dry-run"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # Sent once the run has mapped torch's library: Python is up (its Ctrl-C handler in place) and the libraries are
    # loading (seconds more: transformers, TRL). A fixed 0.5 s could come before the interpreter was up on a loaded
    # machine, and the process died of the signal with nothing said.
    deadline = time.time() + 120
    while "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text():
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and out == "", (proc.returncode, err[-3000:])
    assert err.strip() == "Ctrl-C: stopped while loading the libraries; nothing was started", err[-3000:]


@pytest.mark.slow
def test_ctrl_c_while_prefetch_loads_its_libraries_is_one_line(tmp_path):
    """prefetch.py, which loads the data libraries only (no torch), printed the KeyboardInterrupt traceback of the
    import it hit. Its imports take tenths of a second, too quick for a timed SIGINT to land in them on every machine
    (a clean-clone CI's 0.2 s came after them): sent as `dpotrain.data.mixture`'s import starts."""
    ctrl_c_in(tmp_path, "import:dpotrain.data.mixture", ["scripts/prefetch.py", "--config", SMOKE])


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [
        ["train_dpo.py", "--config", SMOKE, "--dry-run"],
        ["scripts/analyze_dataset.py", "--config", SMOKE],
        ["scripts/preflight.py", "--config", SMOKE],
        ["scripts/push_to_hub.py", "outputs/smoke-dpo"],
    ],
    ids=["train_dpo", "analyzer", "preflight", "push_to_hub"],
)
def test_ctrl_c_inside_torchs_cxx_set_up_is_one_line_not_an_abort(tmp_path, command):
    """A Ctrl-C that landed while torch's C++ set-up ran Python code (`torch._C._c10d_init`, during `import torch`)
    aborted the process: the KeyboardInterrupt raised through C++ ended in "terminate called after throwing an instance
    of 'python_error'" (or of 'pybind11::error_already_set', a few calls later) and SIGABRT (a core dump message), not
    in the one line. Seen once in a CI's analyzer Ctrl-C test; landed there every time by tests/helpers/ctrl_c_in.py."""
    ctrl_c_in(tmp_path, "torch._C._c10d_init", command)


def ctrl_c_in(tmp_path, where: str, command: list[str]) -> None:
    """`command` given a Ctrl-C at `where` (tests/helpers/ctrl_c_in.py) ends in the one line, exit 130, stdout empty."""
    sent = tmp_path / "sent"
    proc = subprocess.run(
        [PYTHON, str(ROOT / "tests" / "helpers" / "ctrl_c_in.py"), *command],
        cwd=ROOT,
        env={**os.environ, "DPOTRAIN_TEST_CTRL_C_IN": where, "DPOTRAIN_TEST_CTRL_C_SENT": str(sent)},
        capture_output=True,
        text=True,
        timeout=300,
        # SIGINT as a terminal's Ctrl-C delivers it (a shell's background job, which this may run under, ignores it)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert sent.exists(), f"{command[0]} no longer reaches {where}: pick another point\n{proc.stderr}"
    assert proc.returncode == 130 and proc.stdout == "", (proc.returncode, proc.stderr[-3000:])
    assert proc.stderr.strip() == "Ctrl-C: stopped while loading the libraries; nothing was started", proc.stderr


def test_ctrl_c_ends_a_dry_run_at_once_in_one_line(tmp_path, monkeypatch, capsys):
    """A dry run saves nothing a stop could wait for: Ctrl-C while it reads the data ends it at once. It printed
    `Ctrl-C: saving a checkpoint at the end of this step, then stopping`, went on to the end and exited 0 (a preflight
    loading its model alike)."""
    import train_dpo
    from dpotrain import stages
    from dpotrain.recipe.errors import run_cli

    def pressed(*args, **kwargs):  # the terminal's Ctrl-C, while the data are read
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # Python runs the handler at its next instruction
        raise AssertionError("the dry run went on after Ctrl-C")

    monkeypatch.setattr(stages, "first_half", pressed)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's foreground job (conftest restores it)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main(["--config", SMOKE, "--output_dir", str(out), "--dry-run"]))
    err = capsys.readouterr().err
    assert ended.value.code == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == "Ctrl-C: stopped" and "saving a checkpoint" not in err, err[-3000:]
    assert not out.exists() and not out.with_name("run.dry-run.json").exists()


def test_a_checkpoint_this_job_cannot_read_is_said_as_a_read_with_the_read_fix(tmp_path, monkeypatch):
    """A checkpoint folder made another user's (chmod 700) stops the resume's look at its MANIFEST.json with EACCES,
    which was said as a refused write ('MANIFEST.json could not be written: give this job write permission there'),
    naming a run_files.json the run never wrote. It is said as the read it was, with the read's fix."""
    from dpotrain.train import disk_full

    folder = tmp_path / "run" / "checkpoint-2"
    folder.mkdir(parents=True)
    real = os.access
    # as this job sees it (root sees every folder): checkpoint-2 can be neither entered nor written
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != folder and real(path, mode, **kw))
    error = PermissionError(errno.EACCES, "Permission denied", str(folder / "MANIFEST.json"))
    assert disk_full.full_write(error) is None  # not a write the disk refused
    assert disk_full.read_denied(RuntimeError("no OSError behind it")) is None
    line = str(disk_full.read_denied(error))
    assert f"{folder / 'MANIFEST.json'} could not be read" in line and f"chmod -R a+rX {folder}" in line, line
    assert "written" not in line and "run_files.json" not in line, line
