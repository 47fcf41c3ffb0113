"""A job killed while it compiles a JIT op (DeepSpeed builds one on first use) does not block the next job; every
way of starting a run compiles with the same `ninja`, so none finds another's build stale.

torch.utils.cpp_extension, which DeepSpeed's op builders use, took its build lock as a file whose existence blocked
(FileBaton) up to torch 2.13: a builder killed mid-compile left it, and every later job waited on it forever, silently.
torch 2.15, the version requirements.txt pins, holds an OS lock on that file instead (filelock's `flock`), which the
kernel releases when its holder dies: the next build takes it and compiles again. The project relied on this when it
dropped its own stale-lock check; this test holds the pinned torch to it, with a real compile killed mid-build.
TORCH_EXTENSIONS_DIR points at a test folder: the user's own cache is never touched.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from conftest import PYTHON, ROOT

# A real C++ extension through torch's JIT path (`load`, the one DeepSpeed's op builders use): a Python module of a
# few lines against Python's own header, which compiles in about a second. The torch headers of `load_inline` took
# ~30 s of a busy core's time to compile in the second build, only to be long enough for the first to be killed
# mid-build; the first build's compiler (COMPILER, as CXX) now holds it there instead.
SOURCE = """#include <Python.h>
static PyObject* probe(PyObject*, PyObject*) { return PyLong_FromLong(1); }
static PyMethodDef methods[] = {{"probe", probe, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "dpotrain_lock_probe", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_dpotrain_lock_probe(void) { return PyModule_Create(&module); }
"""
BUILD = (
    "import sys\n"
    "from torch.utils.cpp_extension import load\n"
    "m = load(name='dpotrain_lock_probe', sources=[sys.argv[1]])\n"
    "print('built', m.probe())\n"
)
# The compiler of the build that is killed: the real one (`c++` on PATH) for torch's checks of its version, and for a
# compile (`-c`) its pid in the file `$0.compiling` and a wait for the kill. ninja starts each compile in a process
# group of its own, which the kill of the build's group does not reach: the test kills it by that pid.
COMPILER = """#!/bin/sh
case " $* " in *" -c "*) echo $$ > "$0.compiling"; exec sleep infinity ;; esac
exec c++ "$@"
"""


@pytest.mark.slow
def test_a_build_killed_mid_compile_leaves_nothing_that_blocks_the_next_build(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    folder = tmp_path / "ext" / "dpotrain_lock_probe"
    source, compiler = tmp_path / "probe.cpp", tmp_path / "held" / "c++"
    source.write_text(SOURCE)
    compiler.parent.mkdir()
    compiler.write_text(COMPILER)
    compiler.chmod(0o755)
    compiling = Path(f"{compiler}.compiling")
    # Its own session: the kill reaches ninja too, as a job's end does.
    build = subprocess.Popen(
        [PYTHON, "-c", BUILD, str(source)],
        env={**env, "CXX": str(compiler)},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        # ninja runs the compiler once torch wrote build.ninja under the lock: its pid, written whole (a new line)
        while not (compiling.exists() and compiling.read_text().endswith("\n")):
            assert build.poll() is None and time.time() < deadline, "the build never started compiling"
            time.sleep(0.05)
        assert build.poll() is None, "the build ended before it was killed: nothing was killed mid-build"
    finally:
        os.killpg(build.pid, signal.SIGKILL)  # a job killed mid-build
        build.wait()
        if compiling.exists() and compiling.read_text().endswith("\n"):  # its compiler, which the kill missed
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(compiling.read_text()), signal.SIGKILL)
    assert (folder / "build.ninja").exists() and not list(folder.glob("*.o"))  # killed mid-compile
    assert (folder / "lock").exists() and not list(folder.glob("*.so"))  # the lock file stays; no op was built

    # The next job: it builds the op and loads it, in the time a build takes (torch 2.13 waited here forever).
    again = subprocess.run([PYTHON, "-c", BUILD, str(source)], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == "built 1", again.stderr[-3000:]


def test_a_run_started_without_the_venv_activated_compiles_with_the_venvs_ninja(tmp_path):
    """torch's JIT builds run the `ninja` on PATH. scripts/launch.sh puts the venv's bin first; `.venv/bin/python
    train_dpo.py` from a shell that did not activate it found a system ninja of another version first, whose build log
    hashes commands differently: each compiled DeepSpeed's op again (~30 s on 2 cores) after the other had."""
    system = tmp_path / "bin"
    system.mkdir()
    (system / "ninja").write_text("#!/bin/sh\necho 1.11.1\n")  # a system ninja, first on a login shell's PATH
    (system / "ninja").chmod(0o755)
    probe = (
        "import shutil, sys; sys.path.insert(0, sys.argv[1])\n"
        "from dpotrain.recipe import venv; venv.require(); print(shutil.which('ninja'))"
    )
    env = {**os.environ, "PATH": f"{system}:/usr/bin:/bin"}
    found = subprocess.run([PYTHON, "-c", probe, str(ROOT)], env=env, capture_output=True, text=True, check=True)
    own = Path(PYTHON).parent / "ninja"
    assert own.is_file(), "the venv has no ninja: DeepSpeed's requirements install one"
    assert found.stdout.strip() == str(own), found.stdout
    assert shutil.which("ninja", path=env["PATH"]) == str(system / "ninja")  # what it would have found


def test_each_venv_builds_deepspeeds_ops_in_a_folder_of_its_own(tmp_path):
    """torch's default build folder, ~/.cache/torch_extensions/<py>_<device>, is shared by every venv, and a build
    records its venv's paths (`-I <venv>/.../deepspeed/ops/csrc/...`): two checkouts rebuilt each other's ops at every
    switch (seen: one built, the other compiled again in the same folder). Two real venvs here, each with the
    project's packages through a .pth file: each gets its own folder; a user's TORCH_EXTENSIONS_DIR is kept. A venv
    reached through a link (a checkout sharing another's `.venv`) kept torch's default, which every such checkout
    shared, each spelling's paths in its build: two worktrees' ZeRO-2 launches rebuilt deepspeed_shm_comm there in
    turn (22 builds of 56-188 s in one morning), a rank waiting on the other's lock and then building. Now each link
    gets its own folder, apart from the real venv's and from another link's."""
    probe = (
        "import os, sys; sys.path.insert(0, sys.argv[1])\n"
        "from dpotrain.recipe import venv; venv.require(); print(os.environ.get('TORCH_EXTENSIONS_DIR'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}

    def built_in(venv: Path, **extra) -> str:
        python = venv / "bin" / "python"
        found = subprocess.run([python, "-c", probe, str(ROOT)], env=env | extra, capture_output=True, text=True)
        assert found.returncode == 0, found.stderr
        return found.stdout.strip()

    venvs = [tmp_path / "a" / ".venv", tmp_path / "b" / ".venv"]
    for venv in venvs:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
        packages = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
        (packages / "project.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    assert [built_in(v) for v in venvs] == [str(v / "torch_extensions") for v in venvs]
    assert built_in(venvs[0], TORCH_EXTENSIONS_DIR="/scratch/ops") == "/scratch/ops"
    links = [tmp_path / "link1", tmp_path / "link2"]
    for link in links:
        link.symlink_to(venvs[0])
    linked = [built_in(link) for link in links]
    assert "None" not in linked and len(set(linked)) == 2, linked
    for folder in linked:
        assert Path(folder).parent.parent == venvs[0] / "torch_extensions"  # in the venv, not in ~/.cache
