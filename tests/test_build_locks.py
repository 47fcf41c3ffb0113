"""A build lock left by a process killed while compiling a JIT op is reported before a job would wait on it forever.

The lock here is made the way DeepSpeed's ops make theirs: torch.utils.cpp_extension compiling an extension, with
TORCH_EXTENSIONS_DIR pointing at a test folder (the user's own cache is never touched).
"""

import os
import signal
import subprocess
import time

import pytest

from conftest import PYTHON, ROOT, run_bounded

# A real C++ extension through torch's JIT path (the one DeepSpeed's op builders use): it takes long enough to
# compile (torch headers) to be checked, and killed, mid-build.
BUILD = (
    "from torch.utils.cpp_extension import load_inline\n"
    "load_inline(name='dpotrain_lock_probe', cpp_sources='int probe() { return 1; }', functions=['probe'])\n"
)


def check_locks(env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "dpotrain.cluster.build_locks"], cwd=ROOT, env=env, capture_output=True, text=True
    )


@pytest.mark.slow
def test_a_killed_build_leaves_a_lock_that_is_reported_with_the_fix(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    lock = tmp_path / "dpotrain_lock_probe" / "lock"
    # Its own session: the kill reaches the compiler (ninja, c++) too, as a job's end does.
    build = subprocess.Popen(
        [PYTHON, "-c", BUILD], env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
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


def test_the_folder_checked_is_torchs_own_found_without_importing_torch(tmp_path, monkeypatch):
    """launch.sh runs the check before every job: it reads torch's folder rule without paying torch's import."""
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # torch's default root follows it; the real cache untouched
    probe = (
        "import sys\nfrom dpotrain.cluster.build_locks import extensions_root\n"
        "print(extensions_root(), 'torch' in sys.modules)"
    )
    shown = subprocess.run([PYTHON, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    torchs = os.path.dirname(_get_build_directory("dpotrain_probe", verbose=False))
    assert shown == [torchs, "False"] and torchs.startswith(str(tmp_path))


def test_a_lock_released_while_it_is_checked_is_not_stale(tmp_path):
    """torch's FileBaton.release closes the lock, then deletes it: a check between the two must not call it stale."""
    import threading

    from dpotrain.cluster.build_locks import stale_locks

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
    cmd = [
        str(ROOT / ".venv" / "bin" / "accelerate"),
        "launch",
        "--config_file",
        str(ROOT / "accelerate_config.yaml"),
        "--num_processes",
        "2",
        str(ROOT / "train_dpo.py"),
        "--config",
        str(ROOT / "configs" / "smoke.yaml"),
        "--output_dir",
        str(tmp_path / "out"),
        "--report_to",
        "none",
    ]
    env = {**os.environ, "PATH": f"{os.path.dirname(PYTHON)}:{os.environ['PATH']}", **env}
    start = time.monotonic()
    code, out, err = run_bounded(cmd, timeout, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if code is None:
        raise AssertionError(f"train_dpo.py still running after {timeout} s: it waits on the lock")
    return subprocess.CompletedProcess(cmd, code, out, err), time.monotonic() - start


@pytest.mark.slow
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


# A live builder, as torch's JIT build holds its lock (FileBaton): taken, held until told, then released.
HOLD = """
import sys
from torch.utils.file_baton import FileBaton
baton = FileBaton(sys.argv[1])
assert baton.try_acquire()
print("held", flush=True)
sys.stdin.readline()
baton.release()
"""


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def ranks_of(launcher_pid: int) -> list[int]:
    ranks = []
    for stat in os.listdir("/proc"):
        try:
            parent = int(open(f"/proc/{stat}/stat").read().rsplit(")", 1)[1].split()[1])
            cmdline = open(f"/proc/{stat}/cmdline").read()
        except (OSError, ValueError):
            continue
        if parent == launcher_pid and "train_dpo.py" in cmdline:
            ranks.append(int(stat))
    return ranks


@pytest.mark.slow
@pytest.mark.extended  # ~7 min: it builds DeepSpeed's op for real
def test_a_lock_held_by_a_live_build_is_waited_for_not_refused(tmp_path, tiny_model_dir):
    """Both ranks pass the check while another process builds the op (they wait on its lock, using no CPU), and train
    once it is done."""
    import json

    from dpotrain.data import builtin

    # The op built once for real: when the lock goes, the waiting ranks load what the builder left.
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    build = (
        "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('ShareMemCommBuilder').load()"
    )
    subprocess.run([PYTHON, "-c", build], env=env, check=True, capture_output=True, timeout=600)
    lock = tmp_path / "ext" / "deepspeed_shm_comm" / "lock"
    assert (lock.parent / "deepspeed_shm_comm.so").exists() and not lock.exists()
    # Now another job on this node rebuilds it: it holds the lock.
    holder = subprocess.Popen([PYTHON, "-c", HOLD, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in builtin.make_preference_rows(16, seed=2)))
    cmd = [
        str(ROOT / ".venv" / "bin" / "accelerate"),
        "launch",
        "--config_file",
        str(ROOT / "accelerate_config.yaml"),
        "--num_processes",
        "2",
        str(ROOT / "train_dpo.py"),
        "--config",
        str(ROOT / "configs" / "smoke.yaml"),
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name",
        str(data),
        "--output_dir",
        str(tmp_path / "out"),
        "--max_steps",
        "1",
        "--warmup_steps",
        "0",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
    ]
    env["PATH"] = f"{os.path.dirname(PYTHON)}:{os.environ['PATH']}"
    launch = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        # Both ranks past the check and waiting on the lock: alive, and idle for 3 s (imports keep a process busy).
        deadline, idle_since, last = time.time() + 300, None, None
        while True:
            assert launch.poll() is None, launch.stdout.read()[-3000:]  # refused, or failed: not waiting
            assert time.time() < deadline, "the ranks never settled to wait on the lock"
            ranks = ranks_of(launch.pid)
            now = [cpu_seconds(pid) for pid in ranks] if len(ranks) == 2 else None
            if now is None or now != last:
                idle_since, last = time.time(), now
            elif time.time() - idle_since > 3:
                break
            time.sleep(0.5)
        assert lock.exists() and holder.poll() is None  # the build was live all along
        holder.communicate("release\n", timeout=60)  # the build is done: its lock is gone
        log = launch.communicate(timeout=600)[0]
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
        holder.kill()
    assert launch.returncode == 0, log[-3000:]
    assert "error: stale build lock" not in log and (tmp_path / "out" / "run_complete.json").exists()
