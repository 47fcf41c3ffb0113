"""A GPU lease call on the CPU (benchmarks/gpu_lease.sh, docs/gpu-benchmarks.md): the same flow as on a lent GPU at
tiny sizes, so the kit is known to work before a GPU comes; the deadline's rule; a piece cut off keeping what it
finished; the install of carried wheels (once per machine, FlashAttention 4 joined from two calls and checked)."""

import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import zipfile

import pytest

from conftest import PYTHON, ROOT, python

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_lease  # noqa: E402
import wheel_xz  # noqa: E402

LEASE = ROOT / "benchmarks" / "gpu_lease.sh"
MIB = 1 << 20


def lease_call(out, work, *args: str, cpu: bool = True, wheels=None, timeout: int = 600):
    # The CPU trial's pieces on the session's warm interpreter (~5 CPU-s of imports each, not what the trial checks)
    env = {**os.environ, "GPU_LEASE_WORK": str(work), "PYTHON": python() if cpu else PYTHON}
    if cpu:
        env["GPU_LEASE_CPU"] = "1"
    if wheels is not None:
        env["GPU_LEASE_WHEELS"] = str(wheels)
    result = subprocess.run(
        ["bash", str(LEASE), str(out), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    return result, result.stdout.strip().splitlines()


def check_out_folder(out) -> None:
    """What comes back from a call: at most 8 files, each far below the tool's 16 MiB, none of them a model."""
    files = sorted(p for p in out.rglob("*") if p.is_file())
    assert 0 < len(files) <= 8 and {p.name for p in files} <= set(gpu_lease.OUT_FILES), files
    assert all(p.stat().st_size < MIB for p in files), [(p.name, p.stat().st_size) for p in files]


@pytest.mark.slow  # ~2.5 min on 2 busy cores: the environment check, the model once, three pieces at tiny sizes
def test_cpu_trial_runs_lease_one_and_brings_back_a_few_small_files(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    # Lease 1's pieces but e2e-think: end_to_end.py --tiny on think-like pairs is test_benchmarks.py's end-to-end test,
    # and the lease's e2e command is e2e-multiturn's on other data. 900 s, not a GPU call's 540: the shares are GPU
    # seconds, and on 2 cores at load 8 the environment check alone (imports) took 47 s of its 60 s share.
    result, lines = lease_call(out, work, "900", "tests,think-recipe,e2e-multiturn", timeout=960)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "installed: nothing (CPU trial uses the venv)" in result.stdout
    assert lines[-1].startswith("RESULT device=CPU "), lines[-3:]
    for name in ("environment", "model", "tests", "think-recipe", "e2e-multiturn"):
        assert f" {name}=finished" in lines[-1], (name, lines[-1])
    check_out_folder(out)
    saved = json.loads((out / "results.json").read_text())
    assert all(p["status"] == "finished" for p in saved["pieces"].values()), saved["pieces"]
    env = json.loads((out / "environment.json").read_text())
    assert env["upstream"] == "ok" and env["versions"]["torch"] and env["kernels"]["imports"]["trl"] == "ok"
    # the GPU tests: collected from their own files, every one skipped here with its reason
    tests = saved["results"]["tests"]["tests"]
    assert tests and all(t["outcome"] == "skipped" and t["reason"].strip() for t in tests.values()), tests
    assert all(node.split("::")[0].startswith("tests/test_") for node in tests)
    # the think recipe's own settings trained on pairs its template takes, and no final model was written
    recipe = saved["results"]["think-recipe"]
    assert recipe["exit_code"] == 0 and len(recipe["steps"]) == 2, recipe
    assert recipe["final_model"].startswith("not saved") and recipe["first_vs_steady"] > 0
    assert all("tokens_per_second" in s and "memory/planned_gib" in s for s in recipe["steps"]), recipe["steps"]
    # end to end: plain TRL at the project's token budget, the attention named in every row
    rows = {r["path"]: r for r in saved["results"]["e2e-multiturn"]["results"]}
    assert rows["trl"]["pair_tokens"] == rows["project"]["pair_tokens"], rows
    assert rows["trl"]["forward"].startswith("padded, 2 pairs a micro-batch") and rows["trl"]["attention"] == "sdpa"
    assert rows["project"]["attention"] and rows["project"]["end_to_end_less_compile_s"] > 0
    # one model, written once in the work folder, shared by the pieces
    assert (work / "model-tiny" / "config.json").exists() and not list(out.rglob("*.safetensors"))
    assert (out / "table.md").read_text().count("| finished |") == 5


def test_a_tiny_budget_skips_every_piece_with_its_reason_and_still_ends_with_result(tmp_path):
    result, lines = lease_call(tmp_path / "out", tmp_path / "work", "3", "tests,e2e-think")
    assert result.returncode == 0, result.stderr[-2000:]
    assert lines[-1].startswith("RESULT device=CPU used="), lines[-3:]
    assert lines[-1].endswith("/3s environment=skipped model=skipped tests=skipped e2e-think=skipped"), lines[-1]
    pieces = json.loads((tmp_path / "out" / "results.json").read_text())["pieces"]
    assert [p["status"] for p in pieces.values()] == ["skipped"] * 4, pieces
    assert pieces["tests"]["reason"].startswith("needs at least 60s, ")
    assert pieces["e2e-think"]["reason"] == "no model: skipped"
    check_out_folder(tmp_path / "out")


def test_an_unknown_piece_is_refused_before_anything_runs(tmp_path):
    result, _ = lease_call(tmp_path / "out", tmp_path / "work", "100", "tests,e2e-thinking")
    # the script's output, its errors included, goes to stdout and OUT/lease.log
    assert result.returncode == 1 and "unknown piece(s) e2e-thinking: pick from tests, think-recipe" in result.stdout
    assert not (tmp_path / "out" / "results.json").exists()


def test_each_piece_gets_its_share_and_spare_time_goes_first():
    assert gpu_lease.limit_for(500, 200, 150) == 350  # the later pieces' shares are left to them
    assert gpu_lease.limit_for(300, 200, 150) == 200  # its share, though the later ones then get less
    assert gpu_lease.limit_for(120, 200, 150) == 120  # never past the deadline
    assert gpu_lease.limit_for(-5, 200, 0) == 0


def test_the_model_may_take_all_but_the_least_the_pieces_after_it_need(tmp_path, monkeypatch):
    """The pieces after the model need it (lease 1 on an H100 lost its think recipe to a model cut at its 40 s
    share, 62 s into a 68 s write): the model is held back only by the least the later pieces need, a piece by their
    shares."""
    held_back = {}

    def step(lease, name, piece, later, python):
        held_back[name] = later
        lease.outcomes[name] = {"status": "finished"}
        return True

    monkeypatch.setattr(gpu_lease, "run_step", step)
    lease = gpu_lease.Lease(tmp_path / "out", tmp_path / "work", time.time() + 600, 600, cpu=True)
    lease.out.mkdir(parents=True)
    gpu_lease.run_all(lease, ["tests", "think-recipe", "e2e-think"], PYTHON)
    pieces = gpu_lease.PIECES
    assert held_back["model"] == sum(pieces[n].least_s for n in ("tests", "think-recipe", "e2e-think"))
    assert held_back["tests"] == pieces["think-recipe"].share_s + pieces["e2e-think"].share_s
    assert held_back["environment"] == gpu_lease.MODEL.share_s + sum(
        pieces[n].share_s for n in ("tests", "think-recipe", "e2e-think")
    )


@pytest.mark.slow  # a real process group killed at its limit (~2 s)
def test_a_piece_cut_off_at_its_limit_keeps_what_it_finished(tmp_path):
    """The piece writes one measurement, starts a child and waits: at its limit the whole group is killed, and the
    measurement is in OUT/results.json."""
    # A piece that outlives its sleep says so in a file: run_piece returns only once the piece has ended, so the file
    # is there if it was let run (its own end), absent if the kill ended it, whatever the machine's load.
    script = (
        "import json, subprocess, sys, time; open(sys.argv[1], 'w').write(json.dumps(dict(paths=['trl'])));"
        "child = subprocess.Popen(['sleep', '600']); open(sys.argv[1] + '.child', 'w').write(str(child.pid));"
        "time.sleep(60); open(sys.argv[1] + '.outlived', 'w').close()"
    )
    piece = gpu_lease.Piece(60, 1, "part.json", "a measurement, then a hang", ("-c", script, "{json}"))
    lease = gpu_lease.Lease(tmp_path / "out", tmp_path / "work", time.time() + 60, 60, cpu=True)
    lease.out.mkdir()
    outcome = gpu_lease.run_piece(lease, "slow", piece, 1, PYTHON)
    assert outcome["status"] == "cut off at its limit of 1s", outcome
    assert not (tmp_path / "work" / "slow" / "part.json.outlived").exists()  # killed, not let run its 60 s
    assert json.loads((lease.out / "results.json").read_text())["results"]["slow"] == {"paths": ["trl"]}
    child = int((tmp_path / "work" / "slow" / "part.json.child").read_text())
    if not ended(child):
        os.kill(child, signal.SIGKILL)  # not left behind by a failing test
        pytest.fail("the piece's own child outlived the group's kill")


def ended(pid: int) -> bool:
    """Whether `pid` ends (or has ended) within a minute: a SIGKILLed process is gone in milliseconds, the child of the
    test above sleeps 600 s unless killed, so only a child the kill missed reaches the minute. Waits on a pidfd
    (readable once the process has ended, reaped or not), not a sleep of a guessed length."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True  # ended and reaped already
    try:
        return bool(select.select([fd], [], [], 60)[0]) and not running(pid)
    finally:
        os.close(fd)


def running(pid: int) -> bool:
    """A process that is neither gone nor a zombie (killed, not yet reaped by whoever inherited it)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


# --- the install of carried folders (the GPU machine's step; here with the venv's pip into a folder of its own) ---


def wheel(folder, name: str, version: str = "0.1", size: int = 0) -> str:
    """A pure-Python wheel built by hand (no network, no build tool); `size` bytes of data to split."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n".encode(),
        f"{name}/blob.bin": os.urandom(size),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{n},{wheel_xz.record_hash(data)},{len(data)}\n" for n, data in files.items())
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for n, data in {**files, f"{info}/RECORD": (record + f"{info}/RECORD,,\n").encode()}.items():
            z.writestr(n, data)
    return path.name


def packed(folder, big: str) -> str:
    """`big` as lease 2 carries FlashAttention 4's libraries wheel: an xz tar of its files (benchmarks/wheel_xz.py)."""
    wheel_xz.pack(folder / big, folder / f"{big}.tar.xz")
    return f"{big}.tar.xz"


def sums(folder, names) -> str:
    return "".join(f"{hashlib.sha256((folder / n).read_bytes()).hexdigest()}  {n}\n" for n in names)


@pytest.mark.slow  # three calls of the script, pip into a folder in each
def test_carried_wheels_install_once_and_fa4_joins_across_two_calls(tmp_path):
    wheels, work = tmp_path / "whl", tmp_path / "work"
    core = wheels / "core"
    core.mkdir(parents=True)
    # one the venv lacks, one it has at a later version (kept as it is: the image's peft when new enough)
    names = [wheel(core, "kitprobe"), wheel(core, "pyyaml", "0.1")]
    (core / "SHA256SUMS").write_text(sums(core, names))
    big = packed(tmp_path, wheel(tmp_path, "kitkernel", size=300_000))
    halves = (tmp_path / big).read_bytes()
    for part, data in (("fa4-1", halves[:150_000]), ("fa4-2", halves[150_000:])):
        (wheels / part).mkdir()
        (wheels / part / f"{big}.part-{'aa' if part == 'fa4-1' else 'ab'}").write_bytes(data)
        (wheels / part / "SHA256SUMS").write_text(sums(tmp_path, [big]))
    first = wheels / "first"
    first.mkdir()
    for name in ("core", "fa4-1"):
        (first / name).symlink_to(wheels / name)
    result, lines = lease_call(tmp_path / "o1", work, "0", "tests", cpu=False, wheels=first)
    assert "core: installed kitprobe-0.1-py3-none-any.whl" in result.stdout, result.stdout[-2000:]
    assert "image has pyyaml" in result.stdout and "fa4: waiting for fa4-2 (the next call)" in result.stdout
    assert lines[-1].startswith("RESULT "), lines[-3:]
    assert (work / "site" / "kitprobe" / "__init__.py").exists() and not (work / "site" / "pyyaml").exists()
    second = wheels / "second"
    second.mkdir()
    (second / "fa4-2").symlink_to(wheels / "fa4-2")
    result, _ = lease_call(tmp_path / "o2", work, "0", "tests", cpu=False, wheels=second)
    assert f"fa4: joined {big}, checked, installed 1 wheels" in result.stdout, result.stdout[-2000:]
    assert "core: installed earlier on this machine (not carried in this call)" in result.stdout
    assert (work / "site" / "kitkernel" / "blob.bin").stat().st_size == 300_000
    result, _ = lease_call(tmp_path / "o3", work, "0", "tests", cpu=False, wheels=first)
    assert "core: installed earlier on this machine" in result.stdout and "fa4: installed earlier" in result.stdout
    env = json.loads((tmp_path / "o3" / "environment.json").read_text())  # its check skipped at a budget of 0
    assert env["install"] == ["core: installed earlier on this machine", "fa4: installed earlier on this machine"]


def test_a_packed_wheel_unpacks_to_its_files_and_one_that_differs_from_its_record_is_refused(tmp_path):
    """FlashAttention 4's libraries wheel travels as an xz tar of its files (27 MiB less to carry): unpacked on the
    machine, it is the same files again, each checked against the wheel's RECORD, or nothing at all."""
    big = wheel(tmp_path, "kitkernel", size=5000)
    again = wheel_xz.unpack(tmp_path / packed(tmp_path, big), tmp_path / "again")
    assert again.name == big
    with zipfile.ZipFile(tmp_path / big) as one, zipfile.ZipFile(again) as other:
        assert {n: one.read(n) for n in one.namelist()} == {n: other.read(n) for n in other.namelist()}
    changed = tmp_path / "changed" / big
    changed.parent.mkdir()
    with zipfile.ZipFile(tmp_path / big) as one, zipfile.ZipFile(changed, "w") as other:
        for n in one.namelist():  # one file changed after the RECORD was written, as a damaged build would be
            other.writestr(n, one.read(n) + (b"!" if n.endswith("blob.bin") else b""))
    with pytest.raises(SystemExit, match=r"its files do not match its RECORD \(differ from the RECORD: kitkernel/blob"):
        wheel_xz.unpack(changed.parent / packed(changed.parent, big), tmp_path / "refused")
    assert list((tmp_path / "refused").iterdir()) == []  # no wheel, no partial one


@pytest.mark.slow
def test_a_damaged_part_fails_the_check_and_installs_nothing(tmp_path):
    wheels, work = tmp_path / "whl", tmp_path / "work"
    big = wheel(tmp_path, "kitkernel", size=100_000)
    data = bytearray((tmp_path / big).read_bytes())
    for part, piece in (("fa4-1", data[:50_000]), ("fa4-2", data[50_000:])):
        (wheels / part).mkdir(parents=True)
        (wheels / part / "SHA256SUMS").write_text(sums(tmp_path, [big]))
        piece[-1] ^= 0xFF if part == "fa4-2" else 0  # one flipped byte in transit
        (wheels / part / f"{big}.part-{'aa' if part == 'fa4-1' else 'ab'}").write_bytes(piece)
    result, lines = lease_call(tmp_path / "out", work, "0", "tests", cpu=False, wheels=wheels)
    assert "fa4: FAILED its sha256 check after the join" in result.stdout, result.stdout[-2000:]
    assert not (work / "site" / "kitkernel").exists() and lines[-1].startswith("RESULT ")


def deepspeed_sdist(folder) -> str:
    """A source distribution standing in for DeepSpeed's: its setup.py does what DeepSpeed's does on the lent
    machine, whose torch sees a GPU: the accelerator detected is `cuda` (unless DS_ACCELERATOR names one), and with
    it setup.py asks nvcc for the CUDA version (`installed_cuda_version()`, for its cupy extra), which a machine
    without the CUDA toolkit fails (MissingCUDAException: "CUDA_HOME does not exist")."""
    import io
    import tarfile

    setup = (
        "import os\n"
        "from setuptools import setup\n"
        "if os.environ.get('DS_ACCELERATOR', 'cuda') == 'cuda':\n"
        "    raise SystemExit('MissingCUDAException: CUDA_HOME does not exist, unable to compile CUDA op(s)')\n"
        "setup(name='deepspeed', version='0.1', packages=['deepspeed'])\n"
    )
    name = "deepspeed-0.1.tar.gz"
    with tarfile.open(folder / name, "w:gz") as tar:
        for path, text in (("setup.py", setup), ("deepspeed/__init__.py", "__version__ = '0.1'\n")):
            data = text.encode()
            info = tarfile.TarInfo(f"deepspeed-0.1/{path}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return name


@pytest.mark.slow  # pip builds a source distribution
def test_deepspeed_builds_on_the_cpu_accelerator_as_the_rehearsal_built_it(tmp_path):
    """Lease 3 carries DeepSpeed's source distribution and builds it on the lent machine. There its torch sees a GPU,
    so DeepSpeed's setup.py takes the `cuda` accelerator and runs nvcc, which the image (a Python with pip's torch)
    need not have: the build failed there, where the CPU rehearsal (gpu_image_trial.sh: the `cpu` accelerator) built
    it. The build takes the `cpu` accelerator on both (no op is built: DS_BUILD_OPS=0; DeepSpeed detects the GPU
    when it runs)."""
    wheels, work = tmp_path / "whl", tmp_path / "work"
    ds = wheels / "ds"
    ds.mkdir(parents=True)
    names = [wheel(ds, "hjsonprobe"), deepspeed_sdist(ds)]
    (ds / "SHA256SUMS").write_text(sums(ds, names))
    result, lines = lease_call(tmp_path / "out", work, "0", "tests", cpu=False, wheels=wheels)
    assert "ds: installed hjsonprobe-0.1-py3-none-any.whl deepspeed-0.1.tar.gz" in result.stdout, result.stdout[-3000:]
    assert (work / "site" / "deepspeed" / "__init__.py").exists() and lines[-1].startswith("RESULT "), lines[-3:]


@pytest.mark.slow  # a pytest session over the GPU test files: collecting them imports the stack
def test_gpu_tests_launch_the_interpreter_itself_not_the_warm_server(tmp_path):
    """benchmarks/gpu_tests.py (the `tests` and `tests-recipes` pieces): a GPU test's launch gets the interpreter
    itself. The suite's warm server, started by a session's first launch, imports the whole stack and DeepSpeed to
    serve `python SCRIPT` launches (~20 s of a lease's device time); the GPU tests launch `python -m ...`, which it
    hands back to a fresh interpreter, so it served nothing there."""
    probe = tmp_path / "test_launch_probe.py"
    probe.write_text(
        "import pytest\n\n\n@pytest.mark.gpu\ndef test_launch_interpreter():\n"
        "    from conftest import PYTHON, python\n\n    assert python() == PYTHON\n"
    )
    out = tmp_path / "tests.json"
    config = ["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT)]
    # gpu_tests.py itself on the warm interpreter: the launch checked is the one of the GPU test it runs
    cmd = [python(), str(ROOT / "benchmarks" / "gpu_tests.py"), "--out", str(out), "--", *config, str(probe)]
    env = {k: v for k, v in os.environ.items() if k != "DPOTRAIN_TESTS_COLD"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tests = json.loads(out.read_text())["tests"]
    found = [entry for node, entry in tests.items() if node.endswith("::test_launch_interpreter")]
    assert [e["outcome"] for e in found] == ["passed"], (found, result.stdout[-2000:])
