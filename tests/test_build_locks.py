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
