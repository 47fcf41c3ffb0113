"""A build lock left by a process killed while compiling a JIT op is reported before a job would wait on it forever.

The lock here is made the way DeepSpeed's ops make theirs: torch.utils.cpp_extension compiling an extension, with
TORCH_EXTENSIONS_DIR pointing at a test folder (the user's own cache is never touched).
"""

import os
import signal
import subprocess
import time

from conftest import PYTHON, ROOT

# A real C++ extension through torch's JIT path (the one DeepSpeed's op builders use): it takes long enough to
# compile (torch headers) to be checked, and killed, mid-build.
BUILD = (
    "from torch.utils.cpp_extension import load_inline\n"
    "load_inline(name='dpotrain_lock_probe', cpp_sources='int probe() { return 1; }', functions=['probe'])\n"
)


def check_locks(env) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "dpotrain.build_locks"], cwd=ROOT, env=env, capture_output=True, text=True)


def test_a_killed_build_leaves_a_lock_that_is_reported_with_the_fix(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    lock = tmp_path / "dpotrain_lock_probe" / "lock"
    # Its own session: the kill reaches the compiler (ninja, c++) too, as a job's end does.
    build = subprocess.Popen([PYTHON, "-c", BUILD], env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.time() + 120
        while not lock.exists():
            assert build.poll() is None and time.time() < deadline, "the build never took its lock"
            time.sleep(0.05)

        # While the builder lives, it holds the lock open: a build in progress, nothing to report.
        live = check_locks(env)
        assert (live.returncode, live.stderr) == (0, "")
        assert build.poll() is None and lock.exists(), "the build ended before the check: nothing was checked live"
    finally:
        os.killpg(build.pid, signal.SIGKILL)  # a job killed mid-build
        build.wait()

    assert lock.exists()  # what the killed builder leaves behind
    stale = check_locks(env)
    assert stale.returncode == 2
    assert "Traceback" not in stale.stderr
    lines = stale.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: stale build lock"), stale.stderr
    assert "dpotrain_lock_probe" in lines[0] and f"rm {lock}" in lines[0]


def test_no_lock_nothing_to_say(tmp_path):
    (tmp_path / "some_op").mkdir()  # a finished build: its folder without a lock
    result = check_locks({**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_a_lock_released_while_it_is_checked_is_not_stale(tmp_path):
    """torch's FileBaton.release closes the lock, then deletes it: a check between the two must not call it stale."""
    import threading

    from dpotrain.build_locks import stale_locks

    lock = tmp_path / "some_op" / "lock"
    lock.parent.mkdir()
    os.close(os.open(lock, os.O_CREAT | os.O_EXCL))  # taken the way FileBaton takes it, and closed: mid-release
    deleted = threading.Timer(0.05, lock.unlink)
    deleted.start()
    assert stale_locks(tmp_path, settle_s=1.0) == []
    deleted.join()

    os.close(os.open(lock, os.O_CREAT | os.O_EXCL))  # the same, never deleted: a builder that died
    assert stale_locks(tmp_path, settle_s=0.05) == [lock]


def launch_train(tmp_path, env, timeout):
    """`accelerate launch train_dpo.py` on 2 processes with the project's DeepSpeed ZeRO-2 config, as the README runs
    it. Past `timeout` the whole process group is killed (ranks waiting on a lock would outlive their launcher)."""
    cmd = [str(ROOT / ".venv" / "bin" / "accelerate"), "launch", "--config_file", str(ROOT / "accelerate_config.yaml"),
           "--num_processes", "2", str(ROOT / "train_dpo.py"), "--config", str(ROOT / "configs" / "smoke.yaml"),
           "--output_dir", str(tmp_path / "out"), "--report_to", "none"]  # fmt: skip
    env = {**os.environ, "PATH": f"{os.path.dirname(PYTHON)}:{os.environ['PATH']}", **env}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"train_dpo.py still running after {timeout} s: it waits on the lock") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.monotonic() - start


def test_a_stale_lock_is_refused_by_train_dpo_under_accelerate_launch(tmp_path):
    """Not only launch.sh: the README's own `accelerate launch train_dpo.py` is refused with the line, on each rank,
    before anything loads (without the check both ranks wait on the lock forever: the timeout fails the test)."""
    lock = tmp_path / "ext" / "deepspeed_shm_comm" / "lock"  # what a job killed while DeepSpeed built its op leaves
    lock.parent.mkdir(parents=True)
    lock.touch()
    result, seconds = launch_train(tmp_path, {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}, timeout=300)
    print(f"refused in {seconds:.1f} s")
    assert result.returncode != 0
    errors = {line for line in result.stderr.splitlines() if line.startswith("error:")}
    assert len(errors) == 1, result.stderr[-3000:]  # the same one line from each rank
    (line,) = errors
    assert (
        line.startswith("error: stale build lock of the JIT-compiled op(s) deepspeed_shm_comm") and f"rm {lock}" in line
    )
    assert result.stderr.count(line) == 2  # both ranks checked their node before DeepSpeed started
    assert "Loading weights" not in result.stdout + result.stderr and not (tmp_path / "out").exists()
    assert lock.exists()  # reported, never removed (a job on another node may be building)
