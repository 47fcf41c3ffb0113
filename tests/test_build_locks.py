"""A job killed while it compiles a JIT op (DeepSpeed builds one on first use) does not block the next job.

torch.utils.cpp_extension, which DeepSpeed's op builders use, took its build lock as a file whose existence blocked
(FileBaton) up to torch 2.13: a builder killed mid-compile left it, and every later job waited on it forever, silently.
torch 2.15, the version requirements.txt pins, holds an OS lock on that file instead (filelock's `flock`), which the
kernel releases when its holder dies: the next build takes it and compiles again. The project relied on this when it
dropped its own stale-lock check; this test holds the pinned torch to it, with a real compile killed mid-build.
TORCH_EXTENSIONS_DIR points at a test folder: the user's own cache is never touched.
"""

import os
import signal
import subprocess
import time

import pytest

from conftest import PYTHON

# A real C++ extension through torch's JIT path (the one DeepSpeed's op builders use): it takes long enough to
# compile (torch headers) to be killed mid-build.
BUILD = (
    "from torch.utils.cpp_extension import load_inline\n"
    "m = load_inline(name='dpotrain_lock_probe', cpp_sources='int probe() { return 1; }', functions=['probe'])\n"
    "print('built', m.probe())\n"
)


@pytest.mark.slow
def test_a_build_killed_mid_compile_leaves_nothing_that_blocks_the_next_build(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    folder = tmp_path / "dpotrain_lock_probe"
    # Its own session: the kill reaches the compiler (ninja, c++) too, as a job's end does.
    build = subprocess.Popen(
        [PYTHON, "-c", BUILD], env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.time() + 120
        while not (folder / "build.ninja").exists():  # written under the lock, before the compiler starts
            assert build.poll() is None and time.time() < deadline, "the build never started compiling"
            time.sleep(0.05)
        assert build.poll() is None, "the build ended before it was killed: nothing was killed mid-build"
    finally:
        os.killpg(build.pid, signal.SIGKILL)  # a job killed mid-build
        build.wait()
    assert (folder / "lock").exists() and not list(folder.glob("*.so"))  # the lock file stays; no op was built

    # The next job: it builds the op and loads it, in the time a build takes (torch 2.13 waited here forever).
    again = subprocess.run([PYTHON, "-c", BUILD], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == "built 1", again.stderr[-3000:]
