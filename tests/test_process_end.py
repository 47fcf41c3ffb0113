"""A command's end (`errors.run_command`): what Python's exit does first, then no interpreter teardown.

With the stack imported, the teardown (every module freed, the heap collected) cost each process ~1-2.5 CPU-s
(BENCHMARKS.md, "Start-up"): every rank, dry run, analyzer and refusal. Skipping it must lose nothing a user reads:
the exit code, the last line under `| tee`, what threads and exit handlers still write (W&B's files: test_honest_runs).
"""

import contextlib
import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import conftest
from conftest import ROOT, in_child, python

SMOKE = str(ROOT / "configs" / "smoke.yaml")

COMMAND = textwrap.dedent("""
    import atexit, ctypes, os, sys, threading, time
    sys.path.insert(0, {root!r})
    from dpotrain.recipe.errors import {runner}

    class Teardown:  # freed only by the interpreter's teardown, when it clears this module
        def __del__(self, write=os.write):
            write(2, b"teardown ran\\n")

    KEPT = Teardown()

    def upload():  # a non-daemon thread still writing, as a background Hub upload would
        time.sleep(0.5)
        print("thread done")

    def main():
        atexit.register(lambda: print("exit handler ran"))
        threading.Thread(target=upload).start()
        ctypes.CDLL(None).printf(b"from C\\n")  # C stdio, block-buffered on a pipe
        print("last line of main")
        return 3

    {runner}(main)
""")


def command(tmp_path, runner: str) -> subprocess.CompletedProcess:
    script = tmp_path / "command.py"
    script.write_text(COMMAND.format(root=str(ROOT), runner=runner))
    shell = f'"{sys.executable}" "{script}" | tee "{tmp_path / "log"}"; exit ${{PIPESTATUS[0]}}'
    # Buffered, as a plain `python` on a pipe is: Python's stdout and C's stdio both hold the last lines until flushed.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.slow
def test_a_command_ends_after_its_threads_and_exit_handlers_with_its_code_and_no_teardown(tmp_path):
    ended = command(tmp_path, "run_command")
    assert ended.returncode == 3, ended.stderr
    lines = (tmp_path / "log").read_text().splitlines()
    assert sorted(lines) == sorted(["from C", "last line of main", "thread done", "exit handler ran"]), lines
    # Python's order: main's output, the threads it waits for, then the exit handlers.
    python_lines = [line for line in lines if line != "from C"]
    assert python_lines == ["last line of main", "thread done", "exit handler ran"], lines
    assert "teardown ran" not in ended.stderr and "Traceback" not in ended.stderr, ended.stderr


@pytest.mark.slow
def test_the_dry_run_and_a_refusal_end_with_their_code_and_last_line_under_a_pipe(tmp_path):
    """The real command, warm or fresh (conftest.python): the summary's last line through `| tee`, and a refusal's
    `error:` line as the last of stderr; no nanobind leak report (triton's, printed at a teardown that saw its objects
    still alive) after them."""
    log = tmp_path / "log"
    dry = f'"{python()}" "{ROOT / "train_dpo.py"}" --config "{SMOKE}" --output_dir "{tmp_path / "run"}" --dry-run'
    ended = subprocess.run(
        ["bash", "-c", f'{dry} | tee "{log}"; exit ${{PIPESTATUS[0]}}'], capture_output=True, text=True, timeout=600
    )
    assert ended.returncode == 0, ended.stderr[-3000:]
    assert log.read_text().splitlines()[-1].lstrip().startswith("everything:"), log.read_text()[-2000:]
    assert "nanobind" not in ended.stderr, ended.stderr[-3000:]

    refusal = f"{dry} --beta -1 2>&1"
    ended = subprocess.run(
        ["bash", "-c", f'{refusal} | tee "{log}"; exit ${{PIPESTATUS[0]}}'], capture_output=True, text=True, timeout=600
    )
    assert ended.returncode == 2, ended.stdout[-3000:]
    assert (
        log.read_text().splitlines()[-1]
        == "error: beta must be > 0 (got -1.0); OLMo 3's length-normalized DPO uses --beta 5"
    )


@pytest.mark.slow  # a pytest session of its own (3.1 s in CI's run)
def test_a_test_that_fails_before_waiting_on_its_forked_child_leaves_no_child_behind(tmp_path):
    """`start_child`'s forked child (a training run a test stops or remounts under) was killed by nothing but the
    test's own `wait()`: a test that failed before it left the child running into the tests after it, a training
    process on the 2 cores, or holding a run's lock. The child is now killed at the test's teardown, failed or not."""
    pid_file = tmp_path / "child.pid"
    (tmp_path / "test_leaves.py").write_text(
        "import time\n"
        "from conftest import start_child\n\n"
        "def test_fails_before_wait():\n"
        "    child = start_child(lambda: time.sleep(600))\n"
        f"    open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "    assert False, 'failed before wait()'\n"
    )
    code, out, _ = inner_pytest(tmp_path / "test_leaves.py")
    pid = int(pid_file.read_text())
    try:
        assert code == 1 and "1 failed" in out, out[-3000:]
        assert not running(pid), f"the failed test's child {pid} still runs"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # the old conftest's leftover, not the test run's next ones'


@pytest.mark.slow  # a pytest session of its own (2.9 s in CI's run)
def test_the_processes_a_forked_child_started_end_with_its_test(tmp_path):
    """`no_child_left` killed the forked child alone: what it started (a DataLoader worker, a launched subprocess)
    ran on into the tests after it, also where the test failed before its `wait()`, or waited on a child that ended
    and left one behind. Each child leads a process group of its own, killed whole at the teardown."""
    files = {name: tmp_path / f"{name}.pid" for name in ("failed", "waited")}
    (tmp_path / "test_leaves.py").write_text(
        "import subprocess, sys, time\n"
        "from conftest import start_child\n\n"
        "def start(pid_file):\n"
        "    sleeper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "    open(pid_file, 'w').write(str(sleeper.pid))\n\n"
        "def test_fails_before_wait():\n"
        f"    child = start_child(lambda: (start({str(files['failed'])!r}), time.sleep(600)))\n"
        f"    while not open({str(files['failed'])!r}, 'a+').tell(): time.sleep(0.05)\n"
        "    assert False, 'failed before wait()'\n\n"
        "def test_waits_on_a_child_that_left_one():\n"
        f"    assert start_child(lambda: start({str(files['waited'])!r})).wait()[0] == 0\n"
    )
    code, out, _ = inner_pytest(tmp_path / "test_leaves.py")
    pids = {name: int(path.read_text()) for name, path in files.items()}
    try:
        assert code == 1 and "1 failed, 1 passed" in out, out[-3000:]
        assert not [name for name, pid in pids.items() if running(pid)], pids  # neither started process runs on
    finally:
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # the old conftest's leftovers, not the test run's next ones'


def inner_pytest(test_file: Path) -> tuple[int, str, str]:
    """A pytest session of its own on `test_file` with this suite's conftest, in a forked child of this test's process
    (`in_child`): the conftest under test is the one imported here (no fresh interpreter importing torch, datasets and
    transformers again, ~6 CPU-s, for a few milliseconds of test). The child's output is in files, not a pipe: a child
    left behind would hold a pipe open. Its exit code, stdout and stderr."""

    def session() -> None:
        # The warm server this worker may hold is not the inner session's to stop (its pytest_unconfigure would).
        conftest._Warm.server = None
        args = [str(test_file), "-p", "conftest", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml")]
        sys.exit(pytest.main([*args, "--rootdir", str(ROOT)]))

    return in_child(session)


def running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie waiting to be reaped)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


@pytest.mark.slow  # each case starts W&B's service in a forked child: 1.4-2.6 s on 2 cores
@pytest.mark.parametrize(
    ("ending", "code"),
    [("the final save refused (EIO)", 1), ("a stop request's checkpoint", 75), ("Ctrl-C", 130)],
)
def test_a_failed_run_ends_its_w_and_b_run_with_its_exit_code_before_its_last_line(tmp_path, ending, code):
    """A run's one-line error was not its last line: W&B's closing lines ("wandb: You can sync this run ...") came
    after it, printed by W&B's exit handler. `run_cli`, which turns every RunError into the run's line (here the final
    save's, refused by the file system after training), ends the open W&B run first, with the exit code: the line is
    last. The W&B run's end state is the one W&B's exit handler gave before (the process's exit code in its exit
    record), for a stop and a Ctrl-C too."""
    from test_honest_runs import wandb_records

    from dpotrain.cluster import collectives
    from dpotrain.recipe import errors
    from dpotrain.train import disk_full

    out = tmp_path / "run"
    out.mkdir()

    def main():
        if code == 1:  # as publish.save_and_push meets it: every rank's outcome of the final save
            refused = OSError(errno.EIO, "Input/output error", str(out / "model.safetensors"))
            collectives.every_rank_outcome(disk_full.final_write(refused, out))
        if code == 130:
            raise KeyboardInterrupt
        return code  # a stop request's: checkpointed, its line printed, the requeue goes on from it

    def run():  # a run's end, as train_dpo.py's: its W&B run open, then run_command's end
        import wandb

        os.dup2(2, 1)  # one stream, in the order written
        sys.stdout = sys.stderr
        wandb.init(project="p", dir=str(tmp_path), mode="offline")
        errors.run_command(main)

    exited, _, log = in_child(run, env={"WANDB_SILENT": "false", "WANDB_CONSOLE": "off"})
    lines = log.strip().splitlines()
    assert exited == code, log[-3000:]
    if code != 75:  # a stop's own line is printed before it returns (train_dpo.py), not by run_cli
        last = f"error: the final model could not be written in {out}" if code == 1 else "Ctrl-C: stopped"
        assert lines[-1].startswith(last), log[-3000:]
        assert any("You can sync this run" in line for line in lines[:-1]), log[-3000:]  # W&B's closing lines
    [run_file] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    [exit_record] = [r.exit for r in wandb_records(run_file) if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == code, (ending, exit_record)


@pytest.mark.parametrize("fault", [KeyboardInterrupt, ConnectionResetError])
def test_a_w_and_b_run_that_cannot_end_leaves_the_runs_line_last(fault, monkeypatch, capsys):
    """`run_cli` ends an open W&B run before the run's line; W&B's ending failing (its service gone, its upload cut by
    a second Ctrl-C) raised from there, and a traceback took the place of the run's line and exit code. Fault injected
    at W&B's `finish`, the one call made."""
    import types

    from dpotrain.recipe import errors

    def finish(exit_code):
        raise fault("W&B's upload cut")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(run=object(), finish=finish))
    with pytest.raises(SystemExit) as ended:
        errors.run_cli(lambda: (_ for _ in ()).throw(errors.RunError("the final model could not be written")))
    assert ended.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == "error: the final model could not be written"
    assert lines[-2].startswith(f"note: W&B could not end its run ({fault.__name__}: W&B's upload cut)")
