"""Shared fixtures: the built-in tiny model (built once per session, offline) and the project paths."""

import ast
import atexit
import contextlib
import errno
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from stat import S_ISDIR, S_ISLNK, S_ISREG
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

# Nothing in the tests may reach the Hub; W&B only ever runs offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The tests write only their own files: datasets caches every data set it reads under HF_HOME, local files too, and
# the suite's thousands of runs would pile up in the user's ~/.cache/huggingface (gigabytes over a few runs). Set before
# anything imports datasets or huggingface_hub, and inherited by every subprocess, Slurm job and the warm server.
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="dpotrain-tests-hf-")
for _name in ("HF_DATASETS_CACHE", "HF_HUB_CACHE"):
    os.environ.pop(_name, None)
atexit.register(shutil.rmtree, os.environ["HF_HOME"], ignore_errors=True)

# datasets' and transformers' loggers write through a StreamHandler bound to the sys.stderr of the moment they are first
# imported. First imported inside a test that captures its output (capsys), they would write to that test's closed
# stream ever after, and a later test's log line became a "--- Logging error ---" traceback in its output
# (`pytest tests/test_refusals.py` alone failed so; the whole suite imports them while collecting). Imported here,
# under pytest's session-long capture, after HF_HOME is set.
import datasets  # noqa: E402
import transformers  # noqa: E402, F401

# Under scripts/test.sh's two workers, torch computes on one thread in each worker and in its warm interpreter's
# children (launched ranks get one from torchrun already): torch's two OpenMP threads per process wait for each other
# at every parallel region, and beside the other worker's processes an in-process training test ran 4-8x slower than
# alone (test_architectures 39 s -> 298 s), so two workers were no faster than one. Not OMP_NUM_THREADS, which jobs
# and launches inherit and `nproc` reports as the CPU count (scripts/launch.sh's "N CPUs" line).
TORCH_THREADS = "1" if os.environ.get("PYTEST_XDIST_WORKER") else ""
if TORCH_THREADS:
    import torch

    torch.set_num_threads(int(TORCH_THREADS))


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory):
    """Runs started by module- and session-scoped fixtures (set up before a test's `own_cache`: the README's Slurm job
    and the uninterrupted run it is compared with, among them) keep their reference log-probs in the session's folder,
    never in the user's ~/.cache/dpotrain, where an earlier session's reference would be reused instead of scored as
    on a fresh machine."""
    os.environ["DPOTRAIN_CACHE"] = str(tmp_path_factory.mktemp("session-cache"))


@pytest.fixture(autouse=True)
def outside_slurm(request, monkeypatch):
    """Every test but the `slurm` ones runs as in a shell outside any Slurm job: pytest run in an allocation or a batch
    job has SLURM_JOB_ID, SLURM_EXPORT_ENV, SBATCH_SIGNAL, ..., which the code under test reads (a job's start, its
    time-limit warning, the run lock's job: two racing runs of one job id are one job's requeue) and which the runs a
    test starts in a subprocess (`{**os.environ}`) would inherit. The `slurm` tests are left as they are: their clients
    strip the outer job's variables from what they hand the test cluster (tests/slurm_cluster.py, `_FOREIGN_ENV`)."""
    if request.node.get_closest_marker("slurm"):
        return
    for name in [name for name in os.environ if name.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
        monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    """Every test gets an empty DPOTRAIN_CACHE: a reference scored by another test, in other micro-batches, would be
    reused (the cache is layout-free by design, README "The reference stage") and move step 1 off its exact ln 2."""
    monkeypatch.setenv("DPOTRAIN_CACHE", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(autouse=True)
def own_environment():
    """Every test leaves the environment as it found it. Tests call `train_dpo.main` and the scripts' `main` in this
    process, and a run sets variables for itself (its recipe's `env:` block, .env, W&B's, DeepSpeed's): a user's
    process runs one command and ends, but here the next test would start with them."""
    before = dict(os.environ)
    yield
    for name in set(os.environ) - set(before):
        del os.environ[name]
    os.environ.update(before)


# What a run in this process changes about signals: GracefulStop handles these, and `train_dpo.main` ends by ignoring
# them (GracefulStop.release: a process about to exit must not die of a late preemption signal).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


@pytest.fixture(autouse=True)
def own_signals():
    """Every test leaves the signals as it found them: an ignored signal stays ignored in every process started after
    it (a run called in this process once left its stop signals ignored, and the next test's `cmd | tee` pipeline had
    a tee that Ctrl-C no longer ended). A test that sets handlers of its own needs no cleanup."""
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield
    for sig, handler in before.items():
        if handler is not None:  # None: set outside Python, left as it is
            signal.signal(sig, handler)


def submitted(command: str, folder) -> dict:
    """A printed `[NAME=value ...] sbatch --nodes=N --gpus-per-node=G SCRIPT ARGS...`, pasted in `folder`, as Slurm and
    scripts/launch.sh take it: the script run there (sbatch reads a relative one there) in a job of N nodes of G GPUs
    with the command's environment, printing its launch (LAUNCH_PRINT_ONLY). Returns what `accelerate launch` gets:
    its config file, machines and processes, and train_dpo.py's arguments (`train`), read in the project (the job runs
    there) by a job submitted from `folder`."""
    import shlex

    words = shlex.split(command)
    at = words.index("sbatch")
    given = dict(word.split("=", 1) for word in words[:at])
    options = {}
    for word in words[at + 1 :]:
        if not word.startswith("--"):
            break
        name, _, value = word.removeprefix("--").partition("=")
        options[name] = value
    assert set(options) == {"nodes", "gpus-per-node"}, command
    script = words[at + 1 + len(options) :]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DPOTRAIN_"))}
    env = {k: v for k, v in env.items() if k not in ("RECIPE", "ACCELERATE_CONFIG")} | given
    env |= {"LAUNCH_PRINT_ONLY": "1", "SLURM_SUBMIT_DIR": str(folder), "SLURM_JOB_NUM_NODES": options["nodes"]}
    env["SLURM_GPUS_PER_NODE"] = options["gpus-per-node"]
    result = subprocess.run(["bash", *script], cwd=folder, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (command, result.stderr)
    node = shlex.split(result.stdout)  # srun ... bash -c "...; exec accelerate launch ..."
    launch = shlex.split(node[node.index("-c") + 1].split("; exec ", 1)[1])
    value = lambda flag: launch[launch.index(flag) + 1]  # noqa: E731
    return {
        "config": value("--config_file"),
        "machines": int(value("--num_machines")),
        "processes": int(value("--num_processes")),
        "train": launch[launch.index("train_dpo.py") + 1 :],
    }


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The built-in 2-layer OLMo 3 and its tokenizer, built in a session folder (not the user's outputs/)."""
    from dpotrain.data import builtin

    os.environ["DPOTRAIN_BUILTIN_DIR"] = str(tmp_path_factory.mktemp("builtin"))
    return builtin.materialize_model("builtin:tiny-olmo3")


def tiny_model(model_type: str, folder, tokenizer_dir: str, **config) -> str:
    """A random 2-layer, 64-wide `model_type` (seed 0) with the built-in tokenizer, saved in `folder`; `config` changes
    the shape or adds what the family needs (test_architectures' FAMILIES)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **(shape | config)), dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def model_with_a_token_past_its_embedding(tmp_path, tiny_model_dir, token: str) -> tuple[Path, int]:
    """A copy of the tiny model whose tokenizer holds the added `token` at id `rows`, one past its embedding's rows
    (config.json's vocab_size): (the folder, rows). The vocabulary check passes it where nothing the run writes holds
    it; what a pair's text or a pad token feeds is another matter."""
    from dpotrain.data import lengths

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    tokenizer = lengths.load_tokenizer(str(folder))
    rows = len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [token]})  # id `rows`, no embedding row
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": rows}))
    return folder, rows


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory, tiny_model_dir):
    """A Llama-style model (no sliding window, no QK-norm) with the built-in tokenizer."""
    return tiny_model("llama", tmp_path_factory.mktemp("llama"), tiny_model_dir)


def smoke_recipe(output_dir, model, *flags):
    """The smoke recipe (configs/smoke.yaml) parsed for a run inside the test process: `model`, the run folder
    `output_dir`, no tracker (W&B is a test of its own), then `flags`."""
    from dpotrain.recipe.config import parse_args

    smoke = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--model_name_or_path", str(model)]
    return parse_args([*smoke, "--output_dir", str(output_dir), "--report_to", "none", *flags])


def built(recipe, train, eval_dataset=None, callbacks=()):
    """The run's ready run (dpotrain/train_stage.py) on pairs the test holds: the run's checks, its first half on
    these pairs (`stages.given_pairs`), then the one builder, `train_stage.build_run` (the trainer with its plan)."""
    from dpotrain import stages, train_stage

    launch = stages.checks(recipe)
    spec = stages.first_half(recipe, launch, pairs=stages.given_pairs(recipe, launch, train, eval_dataset))
    return train_stage.build_run(spec, callbacks=callbacks)


def adding_specials(model_dir, tmp_path, single: str):
    """A copy of the tiny model whose tokenizer adds special tokens itself (`single`: its post-processor's template,
    as Llama's tokenizer.json adds BOS, or one saved with add_eos_token)."""
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    specials = {t: {"id": t, "ids": [ids[t]], "tokens": [t]} for t in ("<|endoftext|>", "<|im_end|>") if t in single}
    tokenizer["post_processor"] = {"type": "TemplateProcessing", "single": [], "pair": [], "special_tokens": specials}
    for part in single.split():
        kind = {"id": "A", "type_id": 0} if part == "$A" else {"id": part, "type_id": 0}
        tokenizer["post_processor"]["single"].append({"Sequence" if part == "$A" else "SpecialToken": kind})
    tokenizer["post_processor"]["pair"] = tokenizer["post_processor"]["single"]
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    return model


def ready(run):
    """The trainer of a ready run (`built`) after its reference stage, as train_dpo.py trains it."""
    run.score_reference()
    return run.trainer


@functools.cache
def parse_once(source: str) -> ast.Module:
    """`ast.parse(source)`, once per text in a process: the source checks (test_layout, test_upstream, test_resolved)
    walk the same ~110 files, and each of 17 tests parsed them again (~0.6 CPU-s a pass). The trees are shared, so a
    test reads them and never changes one; kept for the process (~50 MiB)."""
    return ast.parse(source)


@functools.cache
def walk_once(tree: ast.AST) -> tuple[ast.AST, ...]:
    """`ast.walk(tree)` of a `parse_once` tree (or a node of one), listed once per process: the same checks walked
    each tree again in every test, several times in some (~0.2 CPU-s a pass over the package)."""
    return tuple(ast.walk(tree))


# --- start-up paid once per session (tests/helpers/warm.py) -----------------------------------------------------------

BASE_ENV = dict(os.environ)  # after the defaults above: the environment the warm server imports under
WARM_HELPER = ROOT / "tests" / "helpers" / "warm.py"


def _agent(module: str) -> str:
    """A launcher's agent (`module`'s `main`) as a script for the warm interpreter, ended as the project's commands end
    (dpotrain/recipe/errors.py: `end_with`): a warm child's teardown also collects the server's heap, ~2 CPU-s. A launch
    whose rank failed ends on the agent's own exception (torch's ChildFailedError), as most launches here do: its
    traceback printed and exit code 1, as the interpreter ends on one, without the teardown (16 s of a launch's 18 s
    at load 16)."""
    return (
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom {module} import main\n"
        "from dpotrain.recipe.errors import end_with\n"
        "try:\n    sys.exit(main())\nexcept SystemExit as ended:\n    end_with(ended)\n"
        "except Exception:\n    sys.excepthook(*sys.exc_info())\n    end_with(SystemExit(1))\n"
    )


class _Warm:
    """The session's warm server, started on first use; DPOTRAIN_TESTS_COLD=1 runs every launch as a fresh
    interpreter instead (what the server saves: ~7 CPU-seconds of imports per process)."""

    server: subprocess.Popen | None = None
    folder: Path | None = None
    started_for = ""

    @classmethod
    def clients(cls) -> Path | None:
        if os.environ.get("DPOTRAIN_TESTS_COLD") == "1":
            return None
        if cls.server is None:
            import tempfile

            cls.folder = Path(tempfile.mkdtemp(prefix="dpotrain-warm-"))
            cls.started_for = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]  # its ~8 s start, said
            env = {
                **BASE_ENV,
                "DPOTRAIN_WARM_LOG": str(cls.folder / "requests.log"),
                "DPOTRAIN_WARM_THREADS": TORCH_THREADS,
            }
            serve = [PYTHON, str(WARM_HELPER), "serve", str(cls.folder / "socket"), str(ROOT)]
            with open(cls.folder / "server.log", "w") as log:
                cls.server = subprocess.Popen(
                    serve, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env
                )
            if cls.server.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the warm server did not start: {(cls.folder / 'server.log').read_text()[-3000:]}")
            for name, unbuffered in (("python", False), ("python-u", True)):  # torchrun's ranks run `python -u`
                client = cls.folder / name
                client.write_text(
                    f"#!{PYTHON} -S\nimport sys\nsys.path.insert(0, {str(WARM_HELPER.parent)!r})\n"
                    f"import warm\nwarm.client({str(cls.folder / 'socket')!r}, {PYTHON!r}, "
                    f"sys.argv[1:], {unbuffered})\n"
                )
                client.chmod(0o755)
            # `accelerate launch` itself imports torch and transformers (~6 CPU-seconds a launch): run warm too.
            (cls.folder / "accelerate_cli.py").write_text(_agent("accelerate.commands.accelerate_cli"))
            # torchrun's agent, for the tests' bare gloo launches (~4 CPU-seconds of torch imports a launch).
            (cls.folder / "torchrun.py").write_text(_agent("torch.distributed.run"))
        return cls.folder

    @classmethod
    def stop(cls) -> str | None:
        """Stop the server; returns what it ran: how many processes started warm, and why the others did not."""
        if cls.server is None:
            return None
        import shutil
        from collections import Counter

        cls.server.stdin.close()
        cls.server.wait(timeout=30)
        cls.server = None
        log = cls.folder / "requests.log"
        lines = log.read_text().splitlines() if log.exists() else []
        shutil.rmtree(cls.folder, ignore_errors=True)
        fresh = Counter(line.removeprefix("fresh ") for line in lines if line.startswith("fresh "))
        summary = (
            f"warm python: {len(lines) - sum(fresh.values())} of {len(lines)} processes started warm (the server "
            f"started for {cls.started_for})"
        )
        return "\n".join([summary, *(f"  fresh x{n}: {why}" for why, n in fresh.most_common())])


@pytest.hookimpl(tryfirst=True)  # before xdist's own (trylast), which starts the workers
def pytest_sessionstart(session):
    """Under workers, each collects every test module, and pytest rewrites the modules' asserts as it imports them:
    ~8.5 CPU-s a worker for the suite's ~5,600 asserts, done again on every run where PYTHONDONTWRITEBYTECODE is set
    (this VM, CI's) or the clone is fresh (CI). A child of the controller rewrites them once, beside the workers'
    start, into pytest's own cache (tests/__pycache__, git-ignored), which each worker reads as it imports a module
    (pytest checks each cached file against its source and rewrites one not yet written itself). Uses pytest's
    rewrite functions as pytest itself calls them (requirements-dev.txt pins pytest); without them this only skips the
    head start."""
    if not session.config.getoption("numprocesses", None) or hasattr(session.config, "workerinput"):
        return
    from _pytest.assertion import rewrite

    if not all(hasattr(rewrite, name) for name in ("_read_pyc", "_rewrite_test", "_write_pyc", "get_cache_dir")):
        return
    pid = os.fork()
    if pid:
        _REWRITER.append(pid)
        return
    try:  # the child: never returns into pytest
        state = session.config.stash[rewrite.assertstate_key]
        for source in [ROOT / "tests" / "conftest.py", *sorted((ROOT / "tests").glob("test_*.py"))]:
            pyc = rewrite.get_cache_dir(source) / (source.stem + rewrite.PYC_TAIL)
            if rewrite._read_pyc(source, pyc) is None:
                pyc.parent.mkdir(parents=True, exist_ok=True)
                stat, code = rewrite._rewrite_test(source, session.config)
                rewrite._write_pyc(state, code, stat, pyc)  # written whole, then renamed into place
    finally:
        os._exit(0)


_REWRITER: list[int] = []  # the controller's child of pytest_sessionstart, reaped in pytest_unconfigure


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m deselection, which reads the markers added here
def pytest_collection_modifyitems(items):
    """`extended`, `slurm` and `gpu` tests are `slow` too: a -m on the command line replaces pyproject's
    `-m "not extended"`, and the fast tier, `-m "not slow"`, must still leave out what is beyond CI's budget, what
    submits jobs to a real Slurm and what trains on a GPU."""
    for item in items:
        if any(item.get_closest_marker(name) for name in ("extended", "slurm", "gpu")):
            item.add_marker(pytest.mark.slow)
        item.add_marker(pytest.mark.xdist_group(_worker_group(item)))


def _worker_group(item) -> str:
    """Under scripts/test.sh's two workers (pytest-xdist, `--dist loadgroup`), the tests one worker runs in turn: a
    module's tests together, so that its module-scoped fixtures (a Slurm job, a trained run) are made once; and every
    test that submits to the session's Slurm cluster on one worker, since jobs of two workers would wait for each
    other's CPUs, and one test's higher-priority job would preempt another's. The tests that read the README's demo
    run (`demo_run`, a session fixture: each worker makes its own) go with them, as the README's CPU line after the
    demo is a Slurm test: the demo then runs once in a suite, not on both workers (31 s and 35 s in CI's run)."""
    return "slurm" if {"slurm", "slurm2", "demo_run"} & set(item.fixturenames) else item.module.__name__


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which sends this order to the controller
def pytest_collection_finish(session):
    """The test modules imported torch, transformers, TRL and DeepSpeed while being collected, and what that made
    lives as long as this process: out of the collector's sight (gc.freeze), so that the full collections of the
    in-process runs (Python's own, and accelerate's gc.collect() as each training starts) do not walk it each time.
    Under workers, the groups are handed out longest first (`_longest_groups_first`)."""
    import gc

    if getattr(session.config.option, "loadgroup", False):  # a worker under `--dist loadgroup` (xdist sets it)
        session.items[:] = _longest_groups_first(session.items)
    gc.collect()
    gc.freeze()


def _longest_groups_first(items: list) -> list:
    """The tests that run, whole groups in turn, the group with the most `slow` tests first (then the most tests),
    each group's own order kept. With scripts/test.sh's `--no-loadscope-reorder` the controller hands out the groups in
    this order, each to the worker that runs short of tests: the longest first leaves short ones to even out the end.
    xdist's own order, by number of tests, sends groups of a few long tests last: in six CI runs' schedules replayed
    from their junit times, one worker then ran on 16-50 s after the other had ended, 0-2 s in this order."""
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(_worker_group(item), []).append(item)
    slow = {name: sum(bool(item.get_closest_marker("slow")) for item in group) for name, group in groups.items()}
    order = sorted(groups, key=lambda name: (-slow[name], -len(groups[name])))  # stable: ties keep their order
    return [item for name in order for item in groups[name]]


@pytest.hookimpl(optionalhook=True)  # an xdist hook, run by the controller as each worker's collection arrives
def pytest_xdist_node_collection_finished(node, ids):
    """Under `--dist loadgroup` a worker ends each test's id with its group (`...::test@slurm`, every test has one
    here), and the controller sends a group to one worker by that mark. pytest 9.2 keeps ids where xdist 3.8 no longer
    writes, so the groups were lost without a word (pytest-dev/pytest-xdist#1386): a module's fixtures were made on
    both workers, and two workers' Slurm jobs held the same nodes. A lost group now stops the run before any test."""
    if node.config.getvalue("dist") != "loadgroup":
        return
    lost = [nodeid for nodeid in ids if nodeid.rfind("@") <= nodeid.rfind("]")]  # xdist: "@" past any params
    if lost:
        pytest.exit(
            f"pytest-xdist did not group {len(lost)} tests by their xdist_group (first: {lost[0]}): install the pytest"
            " and pytest-xdist of requirements-dev.txt (bash scripts/setup_env.sh --dev)",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


WORKER_SUMMARIES = []  # under workers (scripts/test.sh), each worker's warm interpreter summary, for the controller's


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which sends the worker's output to the controller
def pytest_sessionfinish(session):
    """A worker's warm interpreter ends with its session, and its summary goes to the controller (xdist's
    `workeroutput`), which prints each in its own summary: a worker prints none."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["warm"] = _Warm.stop() or ""


@pytest.hookimpl(optionalhook=True)  # an xdist hook: pytest without xdist has none
def pytest_testnodedown(node, error):
    summary = getattr(node, "workeroutput", {}).get("warm")
    if summary:
        WORKER_SUMMARIES.append(f"{node.gateway.id}: {summary}")


def pytest_terminal_summary(terminalreporter):
    for summary in [_Warm.stop(), *WORKER_SUMMARIES]:
        if summary:
            terminalreporter.write_line(summary)


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker
        config.add_cleanup(_end_worker)  # pytest's cleanups run last-added first: this one after the others added since


def _end_worker():
    """A worker's results and summary are with the controller (xdist's "workerfinished", at its session's end) and its
    session is closed; what is left is the interpreter's finalization, which tears down the torch, transformers and
    DeepSpeed the tests imported, object by object: seconds the controller waited for at the suite's end, with nothing
    to show for them. The exit handlers still run (this session's HF_HOME, multiprocessing's children); then it ends."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def pytest_unconfigure(config):
    _Warm.stop()
    for pid in _REWRITER:
        os.waitpid(pid, 0)
    import gc

    # What pytest_collection_finish froze, back in the collector's sight for the interpreter's finalization: frozen,
    # triton's nanobind bindings (imported with transformers on a CUDA build of torch) report it as leaked, in
    # hundreds of lines after the summary.
    gc.unfreeze()


PAUSE_AT = ROOT / "tests" / "helpers" / "pause_at.py"  # train_dpo.py, stopped by itself at one point of its run


def pause_env(after: str, at: str, paused_file: Path, count: int = 1) -> dict:
    """The environment for `python PAUSE_AT ARGS` (tests/helpers/pause_at.py): stop before opening a path matching
    `at` for the `count`th time, once a path matching `after` was renamed into place."""
    return {
        "DPOTRAIN_TEST_PAUSE_AFTER": after,
        "DPOTRAIN_TEST_PAUSE_AT": at,
        "DPOTRAIN_TEST_PAUSE_AT_COUNT": str(count),
        "DPOTRAIN_TEST_PAUSED_FILE": str(paused_file),
    }


def pause_here() -> None:
    """In a forked child (`start_child`, given `pause_env` as its env): `python PAUSE_AT` from here on, its audit hook
    stopping the child at the point, for a run the test starts in-process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pause_at", PAUSE_AT)
    pause_at = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pause_at)
    sys.addaudithook(pause_at.hook)


def paused_pid(paused_file: Path, proc: subprocess.Popen, timeout: float = 300) -> int:
    """The id of the process that stopped itself at the point (`pause_env`), once it is stopped: signal that one (the
    warm interpreter's child, where the test started its client)."""
    deadline = time.time() + timeout
    while not paused_file.exists():
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.02)
    pid = int(paused_file.read_text())
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":  # its state: stopped
        assert time.time() < deadline, f"process {pid} did not stop at the point"
        time.sleep(0.01)
    return pid


def signal_paused(paused_file: Path, proc: subprocess.Popen, signum: int, timeout: float = 300) -> str:
    """`signum` sent to the process paused at the point (`paused_pid`), which then goes on to take it; the launch's
    output once it has ended (killed if the test fails first, never left running)."""
    try:
        pid = paused_pid(paused_file, proc, timeout)
        to_main_thread(pid, signum)
        os.kill(pid, signal.SIGCONT)
        return proc.communicate(timeout=timeout)[0]
    finally:
        proc.kill()


def to_main_thread(pid: int, signum: int) -> None:
    """`signum` sent to the main thread of the stopped process `pid` (tgkill), which takes it as it continues. Sent to
    the process, whichever of its threads ran first once continued took it (torch's OpenMP workers too), and on a
    loaded machine the main thread ran on past the point its handler was to be heard at before that thread had tripped
    Python's signal flag: a stop asked while step 2's samples were written was honoured at step 3 (1 in 60 continues
    beside 4 busy loops, none sent to the main thread). A person's or Slurm's signal lands late like that too: the
    tests ask at an exact point, and the main thread is where Python runs the handler."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(pid, pid, signum) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill of process {pid}: {os.strerror(ctypes.get_errno())}")


def python() -> str:
    """The interpreter for a test's `python SCRIPT ARGS`: the session's warm one (its imports already done; a script
    of another copy of the project, or an environment that differs in what libraries read while importing, gets a
    fresh interpreter: tests/helpers/warm.py), or this one."""
    folder = _Warm.clients()
    return str(folder / "python") if folder else PYTHON


def warm_venv() -> str:
    """A `VENV` for scripts/launch.sh whose `bin/python` is `python()`: the job's dry run and preflight (`python
    train_dpo.py`, `python scripts/preflight.py`) start warm, ~6 CPU-s of imports each, which launch.sh's own lines
    (its checks, what it runs and refuses) do not depend on; its `python -m`/`-c` helpers the client hands to the venv's
    own Python, and `bin/accelerate` is the venv's. The venv itself where the tests run cold."""
    folder = _Warm.clients()
    if folder is None:
        return sys.prefix
    venv = folder / "venv"
    if not venv.exists():
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "python").symlink_to(folder / "python")
        (venv / "bin" / "accelerate").symlink_to(os.path.join(os.path.dirname(PYTHON), "accelerate"))
    return str(venv)


def rank_python() -> list[str]:
    """`accelerate launch` options that start each rank as `python()` does: `--no_python <warm python -u>`."""
    folder = _Warm.clients()
    return ["--no_python", str(folder / "python-u")] if folder else []


def ddp_config(folder: Path, processes: int = 2) -> Path:
    """An accelerate config of plain DDP on `processes` CPU processes, written in `folder`. Port 0: a free one, not
    29500, which a launch of the other test worker may hold (scripts/test.sh)."""
    config = folder / f"ddp{processes}.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_machines: 1\n"
        f"num_processes: {processes}\nmain_process_port: 0\nmixed_precision: 'no'\nuse_cpu: false\n"
    )
    return config


def accelerate_launch() -> list[str]:
    """`accelerate launch`: the venv's accelerate CLI on the warm interpreter, as `python()` runs a script. Only for
    launches that run to their end; a test that signals or kills the launcher runs the venv's own `accelerate`."""
    folder = _Warm.clients()
    if folder is None:
        return [os.path.join(os.path.dirname(PYTHON), "accelerate"), "launch"]
    return [str(folder / "python"), str(folder / "accelerate_cli.py"), "launch"]


def torchrun_launch() -> list[str]:
    """`python -m torch.distributed.run`, on the warm interpreter as `accelerate_launch` runs accelerate's CLI; only
    for launches that run to their end."""
    folder = _Warm.clients()
    return [str(folder / "python"), str(folder / "torchrun.py")] if folder else [PYTHON, "-m", "torch.distributed.run"]


def smoke_command(launcher: list[str], model_dir: str, *args: str) -> list[str]:
    """`train_dpo.py` with the smoke recipe on `model_dir`, after `launcher` (`[python()]`, or an accelerate launch)."""
    smoke = str(ROOT / "configs" / "smoke.yaml")
    return [*launcher, str(ROOT / "train_dpo.py"), "--config", smoke, "--model_name_or_path", model_dir, *args]


def launch_env(cache, **more: str) -> dict:
    """A launched run's environment: its own project cache, and the venv's bin first on PATH (for `accelerate`)."""
    path = f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"
    return {**os.environ, "DPOTRAIN_CACHE": str(cache), "PATH": path, **more}


def launch_smoke(processes: int, args: list[str], env: dict | None = None, timeout: int = 900) -> None:
    """What a Slurm job of the smoke recipe launches (scripts/launch.sh: `accelerate launch` of `processes` with
    accelerate_config.yaml, ZeRO-2), run here outside Slurm, which changes nothing it computes: the uninterrupted run
    a preempted job is compared with. Ranks start as `rank_python()`; the venv's bin is first on PATH, as in a job."""
    bin_dir = os.path.dirname(PYTHON)
    cmd = [
        *accelerate_launch(),
        "--config_file",
        str(ROOT / "accelerate_config.yaml"),
        "--num_processes",
        str(processes),
        *rank_python(),
        str(ROOT / "train_dpo.py"),
        "--config",
        str(ROOT / "configs" / "smoke.yaml"),
        *args,
    ]
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", **(env or {})}
    result = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-3000:]


@contextlib.contextmanager
def launch_smoke_meanwhile(out: Path, processes: int, args: list[str], env: dict | None = None):
    """`launch_smoke` in a thread: the uninterrupted run a Slurm job is compared with, started as the job stops (its
    signal sent), so that it runs while the job saves, sleeps in a requeue's BeginTime or a slow checkpoint, and starts
    again, the node's CPUs idle or half idle (one after the other, it added its whole length to the job's; from the
    job's submission, it shared the CPUs with the job's first start and lengthened it). Yields a Future of `out`;
    leaving waits for the launch. The environment is this thread's now: a test started meanwhile that changes
    os.environ does not reach it (PATH: launch_smoke's own)."""
    env = {k: v for k, v in os.environ.items() if k != "PATH"} | (env or {})
    with ThreadPoolExecutor(1) as pool:
        future: Future = pool.submit(lambda: launch_smoke(processes, args, env=env) or out)
        yield future


def run_train(args: list[str], cwd: Path = ROOT, env: dict | None = None, timeout: int = 600):
    """`python train_dpo.py ARGS` as a user runs it; returns the CompletedProcess (stdout+stderr in .stdout)."""
    return subprocess.run(
        [python(), str(ROOT / "train_dpo.py"), *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def sealed_checkpoint(folder: Path) -> Path:
    """A checkpoint folder as a complete save leaves it, made without training: the state a resume needs (stand-in
    bytes), then its manifest and COMPLETE mark, sealed as a run seals them (checkpoint_manifest.seal)."""
    from dpotrain.train import checkpoint_manifest
    from dpotrain.train.checkpoints import MARKER

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"):
        (folder / name).write_text(f"{name}\n")
    checkpoint_manifest.seal(folder, MARKER, "{}\n", is_main=True, model=["model.safetensors"])
    return folder


def failing_stat(monkeypatch, failing: Path, error: int = errno.ESTALE) -> None:
    """`failing`'s stat raises `error` (NFS's ESTALE), and Path.exists(), is_file(), is_dir() and is_symlink()
    answer as Python 3.14's do (cpython gh-118243): False for every OSError, not only a missing path, so a test shows
    on any Python what a look by them does there (tests/test_unanswered_looks.py, tests/test_hub_push.py)."""
    real_stat = Path.stat

    def stat(path, *args, **kwargs):
        if path == failing:
            raise OSError(error, os.strerror(error), str(path))
        return real_stat(path, *args, **kwargs)

    def answers(path, **kwargs) -> os.stat_result | None:
        try:
            return path.stat(**kwargs)
        except OSError:
            return None

    def kind(test):
        return lambda path, **kw: (found := answers(path, **kw)) is not None and test(found.st_mode)

    monkeypatch.setattr(Path, "stat", stat)
    monkeypatch.setattr(Path, "is_file", kind(S_ISREG))
    monkeypatch.setattr(Path, "is_dir", kind(S_ISDIR))
    monkeypatch.setattr(Path, "exists", lambda path, **kw: answers(path, **kw) is not None)
    monkeypatch.setattr(Path, "is_symlink", lambda path: kind(S_ISLNK)(path, follow_symlinks=False))


@pytest.fixture(scope="session")
def silent_endpoint():
    """An HF_ENDPOINT that never answers, as a Hub behind a firewall that drops packets: a local port that listens
    (so a connection may even open) but never accepts and never replies. Unlike a name this machine cannot look up,
    it behaves the same on every machine."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def counted_silent_endpoint():
    """A silent endpoint (as `silent_endpoint`) of one test's own, and `asked()`: how many connections were opened to
    it so far, so that a test checks the number of requests (none, one per run) rather than the seconds they took.
    Counted from the listening socket's queue, no thread: a client's connect() returns once the kernel has queued the
    connection (loopback), so one a call made is counted when the call has returned. Each is held open unanswered."""
    import socket

    held = []
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        sock.setblocking(False)

        def asked() -> int:
            with contextlib.suppress(BlockingIOError):
                while True:
                    held.append(sock.accept()[0])
            return len(held)

        yield f"http://127.0.0.1:{sock.getsockname()[1]}", asked
    for connection in held:
        connection.close()


# What a newcomer's new terminal has: no venv active, system tools only, a home of its own (empty caches).
FRESH_PATH = "/usr/local/bin:/usr/bin:/bin"
# Secrets a user's environment (or .env) holds: no file the demo writes may contain them (tests/test_training.py).
DEMO_SECRETS = {"HF_TOKEN": "hf_SECRETdoNotLeak123", "WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567"}


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, silent_endpoint):
    """The README's first command, `bash scripts/demo.sh`, once per session, as a newcomer runs it: in a fresh bash
    (FRESH_PATH, nothing activated) in a copy of the project, so that the quickstart's later lines (.env,
    outputs/) never touch this checkout. Nothing downloads: the copy's .venv is this checkout's, pip has no index, and
    the Hub never answers (HF_ENDPOINT), so a step that needed either fails. W&B logs offline (`--report_to wandb`,
    the demo script's overrides) with the secrets of DEMO_SECRETS set, for tests/test_training.py to check the run;
    tests/test_readme.py goes on with the quickstart in the same copy and shell environment.

    Returns (the copy, the environment, the CompletedProcess: stdout and stderr together)."""
    import shutil

    venv = ROOT / ".venv"
    if not (venv / "bin" / "python").exists():
        pytest.skip("no .venv in the project: bash scripts/setup_env.sh --dev makes it (the demo downloads nothing)")
    project = tmp_path_factory.mktemp("newcomer") / "dpotrain"
    ignored = (".git", ".venv", "outputs", "logs", "__pycache__", ".pytest_cache", ".ruff_cache", "wandb", ".env")
    shutil.copytree(ROOT, project, ignore=shutil.ignore_patterns(*ignored, "*.out"))
    (project / "outputs").mkdir()
    (project / "logs").mkdir()
    (project / ".venv").symlink_to(venv.resolve())
    home = tmp_path_factory.mktemp("home")
    env = {
        "HOME": str(home),
        "PATH": FRESH_PATH,
        "LANG": "C.UTF-8",
        "HF_ENDPOINT": silent_endpoint,
        "PIP_NO_INDEX": "1",
        "WANDB_MODE": "offline",
        **DEMO_SECRETS,
    }
    result = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", "bash scripts/demo.sh --report_to wandb"],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )
    return project, env, result


@pytest.fixture(scope="session")
def slurm():
    """A real single-node Slurm (tests/slurm/cluster.sh), skipped with the reason where it cannot be installed.

    The node advertises this machine's real CPU count (`slurmd -C`), so jobs are submitted as the README shows them
    for a small CPU-only node.
    """
    from slurm_cluster import slurm_cluster

    yield from slurm_cluster()


@pytest.fixture(scope="session")
def slurm2():
    """A real two-node Slurm on this machine: each slurmd in a network namespace of its own, skipped with the
    reason where namespaces cannot be made. Its clients run in the controller's namespace (SlurmCluster.run)."""
    from slurm_cluster import DEFAULT_STATE_DIR, slurm_cluster

    yield from slurm_cluster(DEFAULT_STATE_DIR.with_name(DEFAULT_STATE_DIR.name + "-2nodes"), nodes=2)


# A collective timeout that is no default of torch (600, 1800), DeepSpeed (600) or transformers (1800): a launch run
# with `--ddp_timeout GROUP_TIMEOUT_S` through REPORT_GROUPS shows that every process group it made holds the recipe's.
GROUP_TIMEOUT_S = 1234
REPORT_GROUPS = str(ROOT / "tests" / "helpers" / "report_groups.py")


def assert_every_group_has_the_recipes_timeout(log: str) -> None:
    """The launch's log (through REPORT_GROUPS, `--ddp_timeout GROUP_TIMEOUT_S`): both ranks report process groups,
    and every one of them holds the recipe's timeout (DeepSpeed makes one of its own inside `deepspeed.initialize`)."""
    assert f"Collective timeout: {GROUP_TIMEOUT_S} s (ddp_timeout) for every process group" in log
    reports = dict(re.findall(r"process groups of rank (\d): (\{.*\})", log))
    assert sorted(reports) == ["0", "1"], log[-3000:]
    for rank, groups in reports.items():
        timeouts = eval(groups)  # {'0': 1234.0, ...}: a dict literal printed by the helper
        assert timeouts and set(timeouts.values()) == {float(GROUP_TIMEOUT_S)}, (rank, timeouts)


def run_bounded(cmd: list[str], limit: float, **popen):
    """Run `cmd` in a process group of its own, as a job's launcher and its ranks; past `limit` seconds the whole
    group is killed, so a rank left waiting (in a collective, on a lock) fails its test instead of stalling the suite.
    Returns (exit code, or None when killed; stdout; stderr)."""
    proc = subprocess.Popen(cmd, text=True, start_new_session=True, **popen)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    """A saved DatasetDict with a held-out split (evaluation needs one)."""
    from dpotrain.data import builtin

    rows = builtin.make_preference_rows(60, seed=13)
    path = tmp_path_factory.mktemp("data") / "pairs"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:48]), "test": datasets.Dataset.from_list(rows[48:])}
    ).save_to_disk(path)
    return path


def in_read_only(folder: Path, fn) -> tuple[int, str, str]:
    """`fn()` in a forked child of this process in which `folder` is read-only (root, whom file modes do not stop: a
    read-only bind mount in a mount namespace of the child's own; otherwise the folder's mode): `in_child`'s exit
    code, stdout and stderr."""
    return in_child(fn, read_only=[folder])


def in_child(fn, read_only=(), tmpfs=(), bind=(), env=None) -> tuple[int, str, str]:
    """`fn()` in a forked child of this process, in a mount namespace of its own (root) where each folder of
    `read_only` is a read-only bind mount of itself (otherwise the folder's mode), each `(folder, size)` of `tmpfs`
    a tmpfs of that size (`"1m"`: a real disk that fills up) and each `(folder, at)` of `bind` that folder mounted a
    second time at `at` (a container's `-B`, a site's two names of one file system), with `env` set (None unsets a
    variable) and read again as the Hub libraries read it while being imported (tests/helpers/warm.py: `_reread`,
    which test_warm.py compares with a fresh interpreter). Returns the child's exit code (a SystemExit's, as
    `run_cli` ends a command; 1 where `fn` raised, its traceback on stderr), stdout and stderr, read at their
    descriptors (what C code and a handler made before the fork write too). Forked, not a fresh interpreter under
    `unshare`: the code under test is imported already (train_dpo.py's stack: ~6-7 CPU-s a fresh start, for a refusal
    of a few milliseconds)."""
    return start_child(fn, read_only, tmpfs, bind, env).wait()


class Child:
    """A forked child of this process (`start_child`) as a test waits on it and signals it: `pid`, `poll()`, `stdout`
    (its output so far, for an assertion's message) and `wait()`: its exit code, stdout and stderr."""

    def __init__(self, pid: int, streams: Path):
        self.pid, self.streams, self.returncode = pid, streams, None

    @property
    def stdout(self):
        return open(self.streams / "out")  # noqa: SIM115 - read once by an assertion's message

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> tuple[int, str, str]:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        out, err = (self.streams / "out").read_text(), (self.streams / "err").read_text()
        shutil.rmtree(self.streams)
        if self.returncode == 77:
            pytest.skip(f"cannot mount in a mount namespace here ({err.strip()}: needs CAP_SYS_ADMIN)")
        return self.returncode, out, err


# The children `start_child` forked in this test: what is left of each one's process group, and the child where no
# `wait()` reaped it, is killed at the test's teardown (`no_child_left`)
STARTED_CHILDREN: list[Child] = []


@pytest.fixture(autouse=True)
def no_child_left():
    """A test's forked children end with it: one that failed before its `wait()` left a training run going into the
    tests after it (on the 2 cores, holding its run's lock). Killed and reaped at teardown, failed test or not, with
    the processes it started (a DataLoader worker, a launched subprocess; left running by a child reaped too): each
    child leads a process group of its own (`start_child`), killed whole."""
    yield
    while STARTED_CHILDREN:
        child = STARTED_CHILDREN.pop()
        # Its group outlives a reaped child while a process it started runs, so the group's id is not reused by then
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)  # stopped (SIGSTOP) or not
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)  # killed before its setsid(): still in this process's group
            os.waitpid(child.pid, 0)
        shutil.rmtree(child.streams, ignore_errors=True)


def start_child(fn, read_only=(), tmpfs=(), bind=(), env=None) -> Child:
    """`in_child`'s forked child, started and not waited for: a test that stops it, or changes its mounts (`nsenter
    -t PID -m`), while it runs. Killed at the test's teardown where no `wait()` reaped it (`no_child_left`)."""
    import io
    import traceback

    if os.geteuid() != 0:
        if tmpfs or bind:
            pytest.skip("needs a mount in a mount namespace of its own (root)")
        for folder in read_only:
            folder.chmod(0o555)
    streams = Path(tempfile.mkdtemp())
    out, err = streams / "out", streams / "err"
    for path in (out, err):
        path.touch()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest (os._exit: not pytest's atexit, which removes HF_HOME)
        code = 1
        try:
            os.setsid()  # a session and process group of its own: the teardown kills what it starts with it
            for fd, path in ((1, out), (2, err)):
                os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
            sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
            sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
            if os.geteuid() == 0 and not _mount(read_only, tmpfs, bind):
                code = 77
            else:
                code = _run_in_child(fn, env)
        except BaseException:  # noqa: BLE001 - whatever ends `fn`, the child exits here, never into pytest
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    STARTED_CHILDREN.append(child := Child(pid, streams))
    return child


def _run_in_child(fn, env) -> int:
    """`fn()` under `env` (the forked child of `in_child`): its exit code, as a command's SystemExit gives it. The
    project's answers kept once per process (`functools.cache`) are forgotten first, as a fresh interpreter starts
    without them: `data.check_datasets_cache`, which an earlier test's dry run in this worker answered for another
    HF_DATASETS_CACHE, let a read-only one through; so is accelerate's state, for a run that trains here."""
    import functools
    import importlib

    # OpenMP's worker threads are not forked: a parallel region waits for them forever once this process used them
    # (torch's two threads outside the workers). On one thread torch computes inline, as in a worker's processes.
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    for module in [m for name, m in list(sys.modules.items()) if name.startswith("dpotrain.") and m is not None]:
        for value in list(vars(module).values()):
            if isinstance(value, functools._lru_cache_wrapper):
                value.cache_clear()
    # The streams' state as a fresh interpreter has it: an in-process test's Ctrl-C left the worker's as heard
    if "dpotrain.recipe.terminal" in sys.modules:
        importlib.reload(sys.modules["dpotrain.recipe.terminal"])
    # accelerate's singletons, as an earlier in-process run or dry run of this worker left them (its world, device,
    # mixed precision, accumulation): a fresh interpreter has none, and a run trained here builds its own.
    if "accelerate.state" in sys.modules:
        state = sys.modules["accelerate.state"]
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()
    if env:
        sys.path.insert(0, str(WARM_HELPER.parent))
        import warm

        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        warm._reread()
    try:
        fn()
    except SystemExit as ended:
        return 0 if ended.code is None else ended.code if isinstance(ended.code, int) else 1
    return 0


def _mount(read_only, tmpfs, bind) -> bool:
    """This process in a mount namespace of its own (mounts private, as `unshare --mount` makes them) with `in_child`'s
    mounts; False, the error on stderr, where the kernel refuses."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rdonly, ms_remount, ms_bind, ms_rec, ms_private = 0x20000, 1, 32, 4096, 16384, 1 << 18
    steps = [lambda: libc.unshare(clone_newns), lambda: libc.mount(b"none", b"/", None, ms_rec | ms_private, None)]
    for folder, at in bind:
        path, at_path = os.fsencode(folder), os.fsencode(at)
        steps.append(lambda path=path, at_path=at_path: libc.mount(path, at_path, None, ms_bind, None))
    for folder, size in tmpfs:
        path = os.fsencode(folder)
        steps.append(lambda path=path, size=size: libc.mount(b"tmpfs", path, b"tmpfs", 0, f"size={size}".encode()))
    for folder in read_only:
        path = os.fsencode(folder)
        steps.append(lambda path=path: libc.mount(path, path, None, ms_bind, None))
        steps.append(lambda path=path: libc.mount(path, path, None, ms_remount | ms_bind | ms_rdonly, None))
    for step in steps:
        if step() != 0:
            print(os.strerror(ctypes.get_errno()), file=sys.stderr)
            return False
    return True


@pytest.fixture(scope="module")
def cli():
    """scripts/analyze_dataset.py as a module: `cli.main(argv)` returns the exit status. It hides GPUs on import;
    undone here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("analyze_dataset", ROOT / "scripts" / "analyze_dataset.py")
    module = importlib.util.module_from_spec(spec)
    with mock.patch.dict(os.environ):
        spec.loader.exec_module(module)
    return module


def spawn_ranks(fn, args: tuple, processes: int, folder: Path, timeout: int = 600) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs=processes)`, each rank started as `rank_python()` starts a
    launch's: spawn starts fresh interpreters, each importing torch, transformers and DeepSpeed again (~7 CPU-seconds a
    process) to run a few forwards. `fn(rank, *args)` as spawn calls it: a module-level function of a test module,
    `args` literals; a rank that fails fails the test with the ranks' output."""
    script = folder / f"spawn_{fn.__name__}.py"
    script.write_text(
        # Without torchrun's agent store: the ranks meet on the port `fn` gives them, as spawn's do.
        "import os, sys\nos.environ.pop('TORCHELASTIC_USE_AGENT_STORE', None)\n"
        f"sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
        f"from {fn.__module__} import {fn.__name__}\n{fn.__name__}(int(os.environ['LOCAL_RANK']), *{tuple(args)!r})\n"
    )
    cmd = [*torchrun_launch(), "--standalone", "--nproc_per_node", str(processes)]
    # The venv's bin first, as every launch of the tests: a rank that loads DeepSpeed builds its op with the `ninja` on
    # PATH, and a system ninja of another version found the venv's build stale and compiled it again (and the next
    # launch, back), minutes on busy cores.
    result = subprocess.run(
        [*cmd, *rank_python(), str(script)],
        cwd=ROOT,
        env={**os.environ, "PATH": f"{os.path.dirname(PYTHON)}:{os.environ['PATH']}"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-4000:]
