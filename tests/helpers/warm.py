"""A Python that has already imported the training stack, for the tests' launches of `train_dpo.py`.

Most of a tiny CPU run is start-up: each `python train_dpo.py`, and each rank of an `accelerate launch`, imports torch,
transformers, TRL, PEFT, datasets and DeepSpeed (~7 CPU-seconds) to train for one. `serve` pays that once per test
session: it imports them, then forks a child for each request, and the child runs the script as `python SCRIPT ARGS`
would (`__main__`, its own argv, environment, working folder, stdin/stdout/stderr, exit code or signal). The client
(`client`, run by the two executables conftest writes: `python` and `python -u`) stands where the process would: it
hands its file descriptors over, forwards the signals it gets to the child, exits as the child did, and when it dies
the child is killed. So `accelerate launch --no_python <client> train_dpo.py ...` starts ranks that torchrun's agent
watches and signals as usual.

A child can only run what a fresh interpreter would have run the same way: the environment variables that libraries
read while being imported (HF_ENDPOINT, HF_HOME, ...) were read once, in `serve`, and what the imports print was printed
there, once (transformers' line under WANDB_MODE=offline: RUNTIME_PREFIXES). So a request is run warm only
when its environment differs from the server's in variables read at run time (the project's DPOTRAIN_*, the launcher's
rank variables, PATH); otherwise, and for a script of another copy of the project (whose `dpotrain` the server has
not imported), the client `exec`s the real interpreter.
Each request is logged to the file named by the server's DPOTRAIN_WARM_LOG: run warm, or fresh and why.
"""

import contextlib
import gc
import importlib
import json
import os
import select
import signal
import socket
import struct
import sys

# Variables read at run time only (torchrun's and accelerate's per-rank settings, the project's own): they may differ
# between the server and a request.
# SLURM_*: the project reads them when a run starts (run_lock, options); no library of the stack reads them while it is
# imported (W&B does at init). WANDB_*: wandb reads them when a run starts (`wandb.init`, `wandb.Settings()`), not
# while imported (tests/test_warm.py compares its modules' constants with a fresh interpreter's under other WANDB_*).
# One import reads WANDB_MODE: transformers' integration_utils prints "[INFO] Running in WANDB offline mode" where it
# is "offline", and sets nothing. The server made that import: no child prints the line, whatever its WANDB_MODE and
# the server's (a server keyed on WANDB_MODE would not change that), where a fresh interpreter under "offline" does.
# A test that reads that line runs a fresh interpreter (test_newcomer's of `--json` with W&B offline).
RUNTIME_PREFIXES = (
    "DPOTRAIN_", "ACCELERATE_", "FSDP_", "TORCHELASTIC_", "TORCH_NCCL_", "NCCL_", "PYTEST_", "SLURM_", "WANDB_",
    "GPU_LEASE_",  # benchmarks/gpu_lease.sh's switches (its CPU trial, its work folder), read by no library
)  # fmt: skip
RUNTIME_KEYS = {
    "PATH",
    "PWD",
    "OLDPWD",
    "_",
    "SHLVL",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "PYTHONUNBUFFERED",
    "PYTHONPATH",
    "CUDA_VISIBLE_DEVICES",
    "COLUMNS",
    "LINES",
    "GPUS_PER_NODE",  # scripts/launch.sh's node size, read by the project's plan (cluster/engine.py) at run time
    "RECIPE",  # scripts/launch.sh's own switches (`warm_venv` runs its Python warm), read by no library
    "PREFLIGHT",
    "VENV",
    "NETRC",  # read when a login is looked up (requests', W&B's), never while a library is imported
    "SLOW_CHECKPOINT_S",  # tests/helpers/slow_checkpoint.py's delay, read by that script as it starts
    "PYTHON",  # benchmarks/gpu_lease.sh's interpreter for its pieces, read by no library
}
# What the Hub libraries read from these while being imported, a child reads again (`_reread`): a request differing in
# them (the Hub tests' own HF_ENDPOINT, HF_HOME and offline switches) still runs warm. HF_TOKEN: read when used.
REREAD_KEYS = {"HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_TOKEN", "HF_TOKEN_PATH"}
REREAD_KEYS |= {"HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"}
# tqdm's defaults (TQDM_ASCII: scripts/launch.sh exports it before its dry run and preflight), read while tqdm is
# imported: a child given others wraps tqdm's `__init__` again (`_reread_tqdm`), as tqdm's std.py does.
REREAD_PREFIX = "TQDM_"
TQDM_TYPES = {"total": float, "ncols": int, "miniters": float, "position": int, "nrows": int}  # tqdm 4.x std.py's
ACCELERATE_CONFIG = "accelerate.commands.config.config_args"
# Imported by the server after train_dpo: what a run imports later (`serve`). The trainer module brings TRL's
# DPOTrainer and with it wandb (~0.35 CPU-s a training process), whose import makes two temporary folders
# (wandb-media, wandb-artifacts) removed at exit by whichever process exits: each child gets folders of its own
# (`_own_wandb_folders`), or the first child to exit removed the server's and a later child's wandb.Table failed.
MORE_MODULES = ("datasets", "deepspeed.runtime.zero.muon.muon_optimizer", "dpotrain.train.trainer")

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def _runtime(key: str) -> bool:
    return (
        key in RUNTIME_KEYS or key in REREAD_KEYS or key.startswith(REREAD_PREFIX) or key.startswith(RUNTIME_PREFIXES)
    )


def import_time_differences(env: dict[str, str], base: dict[str, str], set_by_imports: dict[str, str]) -> list[str]:
    """The variables of `env` a fresh interpreter could have read differently while importing than `serve` did, whose
    environment was `base` before its imports set `set_by_imports` (torch sets a few for itself)."""
    differ = {k for k in set(env) | set(base) if env.get(k) != base.get(k) and not _runtime(k)}
    return sorted(k for k in differ if env.get(k) not in (None, set_by_imports.get(k, base.get(k))))


def _projects_of(request: dict) -> set[str]:
    """The folders holding a `dpotrain` package that the request's script could import: its own folder or one above,
    and its PYTHONPATH."""
    script = os.path.realpath(os.path.join(request["cwd"], request["argv"][0]))
    folders = [os.path.dirname(script)]
    while folders[-1] != os.path.dirname(folders[-1]):
        folders.append(os.path.dirname(folders[-1]))
    folders += [os.path.join(request["cwd"], p) for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    return {os.path.realpath(f) for f in folders if os.path.isfile(os.path.join(f, "dpotrain", "__init__.py"))}


def _send(sock, payload: dict, fds=()) -> None:
    data = json.dumps(payload).encode()
    message = struct.pack("!I", len(data)) + data
    sent = socket.send_fds(sock, [message], list(fds)) if fds else sock.send(message)
    sock.sendall(message[sent:])


def _recv(sock) -> tuple[dict | None, list[int]]:
    """One message and the file descriptors sent with it; None for the message when the peer has gone. Its length
    first, then no byte past it: the server's two answers (the pid, the status of a child that ended at once) may
    arrive together, and one read of both left JSON with extra data."""
    data, fds, _, _ = socket.recv_fds(sock, 4, 3)
    while data and len(data) < 4:
        more = sock.recv(4 - len(data))
        if not more:
            return None, fds
        data += more
    if len(data) < 4:
        return None, fds
    size, data = struct.unpack("!I", data)[0], b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            return None, fds
        data += more
    return json.loads(data), fds


# --- the server -------------------------------------------------------------------------------------------------------


def serve(path: str, project: str) -> None:
    """Import the stack, then fork a child per request on the Unix socket `path`, until stdin closes (the test session
    that started it ended). Says "ready" on stdout once listening; anything the imports print goes to stderr."""
    ready_fd = os.dup(1)
    os.dup2(2, 1)
    base = dict(os.environ)
    sys.path.insert(0, project)  # the project's modules, imported below once for every child
    import deepspeed  # noqa: F401
    import matplotlib.pyplot  # noqa: F401  (training_curves.png)
    import peft  # noqa: F401
    import torch
    import transformers.models.olmo3.modeling_olmo3  # noqa: F401  (the built-in model's)
    import trl  # noqa: F401

    import train_dpo  # noqa: F401  (and with it the project's modules)

    # What each child imported again for itself (profiled in session 38): train_dpo imports datasets only when a run
    # gets there (with the trainer, ~0.8 CPU-s a rank, ~930 modules; the trainer left to the child: MORE_MODULES), and
    # DeepSpeed's optimizer check as the engine starts imports its Muon optimizer, whose module-level torch.compile
    # imports dynamo and inductor (~1-1.5 CPU-s a DeepSpeed rank). Their import-time settings (TORCHINDUCTOR_*, ...)
    # are no run-time keys: a request that differs in one starts fresh.
    for name in MORE_MODULES:  # after train_dpo, as a run imports them
        importlib.import_module(name)
    # Each model load (`from_pretrained`) first builds transformers' table of checkpoint key renames for every
    # architecture, once per process (~0.3 CPU-s, a sixth of a warm tiny run): built here, once for every child.
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    get_checkpoint_conversion_mapping("olmo3")

    if os.environ.get("DPOTRAIN_WARM_THREADS"):  # tests/conftest.py's TORCH_THREADS: every child computes on these
        torch.set_num_threads(int(os.environ["DPOTRAIN_WARM_THREADS"]))

    # What the imports made lives as long as any child: out of the collector's sight (gc.freeze), so that a child's
    # full collections (Python's own, and accelerate's gc.collect() as each training starts) do not walk it each time.
    gc.collect()
    gc.freeze()
    sys.path.remove(project)  # a child's sys.path[0] is its script's folder, as in a fresh interpreter
    set_by_imports = {k: v for k, v in os.environ.items() if base.get(k) != v}
    log = base.get("DPOTRAIN_WARM_LOG")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    os.write(ready_fd, b"ready\n")
    os.close(ready_fd)
    server = os.getpid()
    waiting: dict[int, socket.socket] = {}  # child pid -> its client's connection
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [], 0.05)
        if sys.stdin in ready and not sys.stdin.readline():
            break
        if listener in ready:
            conn, _ = listener.accept()
            try:
                pid = _start(conn, listener, project, base, set_by_imports, log)
            except OSError:  # the client went away mid-request (killed with its test): nothing of it to keep
                if os.getpid() != server:
                    raise  # a child's own error ends the child, never resumes serving
                pid = None
            if pid is None:
                conn.close()
            else:
                waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    _send(conn, {"status": status})
                except OSError:
                    pass  # the client is gone (killed): its child was killed with it
                conn.close()
    listener.close()
    os.unlink(path)


def _start(conn, listener, project: str, base: dict, set_by_imports: dict, log: str | None) -> int | None:
    """Read a request from `conn` and fork its child (its pid), or answer that it must start fresh (None)."""
    request, fds = _recv(conn)
    differences = ["(no request)"]
    if request:
        differences = import_time_differences(request["env"], base, set_by_imports)
        # A client in a mount namespace of its own (conftest's `in_child` with read_only folders) sees other files: a
        # child forked here would write where the client cannot
        if request.get("mounts") != os.readlink("/proc/self/ns/mnt"):
            differences.append("(another mount namespace)")
        for copy in _projects_of(request):
            if copy != os.path.realpath(project):
                differences.append(f"(another copy of the project: {copy})")
    if log:
        with open(log, "a") as f:
            script = os.path.basename(request["argv"][0]) if request else "?"
            f.write(f"fresh {script}: {' '.join(differences)}\n" if differences else f"warm {script}\n")
    pid = None if differences else os.fork()
    if pid == 0:
        listener.close()
        _child(conn, request, fds, base, set_by_imports)  # never returns: exits as the script makes it
    for fd in fds:
        os.close(fd)
    try:
        _send(conn, {"fallback": True} if pid is None else {"pid": pid})
    except OSError:
        pass  # the client is gone already: a child dies with it (`_child`), and is reaped as any other
    return pid


def _child(conn, request: dict, fds: list[int], base: dict[str, str], set_by_imports: dict[str, str]) -> None:
    """Become `python [-u] SCRIPT ARGS` as the client was started; exits as the script makes it: the interpreter's own
    exit (atexit handlers, stdio flushed, exit code or signal), or a project command's end, which runs the same handlers
    and skips the teardown (dpotrain/recipe/errors.py: `end_process`)."""
    import atexit
    import ctypes
    import io
    import runpy
    import threading

    from dpotrain.recipe.errors import end_with  # imported with train_dpo by the server

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the server
    # The client's signals as a fresh interpreter would start with them, not the server's: an ignored one stays
    # ignored (the run leaves it so), SIGINT raises KeyboardInterrupt, the others their default.
    for sig in FORWARDED:
        default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        signal.signal(sig, signal.SIG_IGN if int(sig) in request.get("ignored", ()) else default)
    # Last at exit: the server's frozen objects back in the collector's sight for the interpreter's teardown, as a
    # fresh interpreter's are: frozen, triton's nanobind bindings (imported with transformers on a CUDA build of torch)
    # report them as leaked, in hundreds of lines after the script's own last line.
    atexit.register(gc.unfreeze)
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**set_by_imports, **request["env"]})  # what the imports of a fresh interpreter would have set
    _own_wandb_folders()
    if any(base.get(k) != request["env"].get(k) for k in REREAD_KEYS):
        _reread()
    if any(base.get(k) != request["env"].get(k) for k in {*base, *request["env"]} if k.startswith(REREAD_PREFIX)):
        _reread_tqdm()
    threads = request["env"].get("OMP_NUM_THREADS")
    if threads and threads != base.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(threads))  # what torch would have taken from it at start-up
    unbuffered = request["unbuffered"] or bool(request["env"].get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "w", closefd=False)
        line = name == "stderr" or raw.isatty()
        stream = io.TextIOWrapper(
            raw if unbuffered else io.BufferedWriter(raw),
            write_through=unbuffered,
            line_buffering=line,
            errors="backslashreplace",
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)

    def die_with_the_client():
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die_with_the_client, daemon=True, name="warm-client-watch").start()
    script = os.path.abspath(request["argv"][0])
    sys.argv = [script if i == 0 else a for i, a in enumerate(request["argv"])]
    extra = [os.path.abspath(p) for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[0:1] = [os.path.dirname(script), *extra]  # as a fresh interpreter lays out its sys.path
    # Its end as the project's commands end (dpotrain/recipe/errors.py: `end_with`): Python's exit without the teardown,
    # which in a child frees the server's modules and collects its whole heap (~2 CPU-s, a fresh interpreter's ~1.5) and
    # frees nothing the system does not. The script's namespace is dropped first, so that what it left open is closed
    # as the teardown would close it; an uncaught exception ends the usual way (its traceback, code 1).
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as ended:
        end_with(ended)
    end_with(SystemExit(0))


def _own_wandb_folders() -> None:
    """wandb's import made its staging folders (a `tempfile.TemporaryDirectory` each), removed at the exit of the
    process holding them: a child takes new ones in their place, and leaves the server's to the server's own exit."""
    import tempfile

    private = sys.modules["wandb.sdk.data_types._private"]  # wandb-media, shared by name by its media types
    artifact = sys.modules["wandb.sdk.artifacts.artifact"].Artifact  # wandb-artifacts
    for holder, name, suffix in ((private, "MEDIA_TMP", "wandb-media"), (artifact, "_TMP_DIR", "wandb-artifacts")):
        folder = getattr(holder, name)
        folder._finalizer.detach()  # the server's folder: never removed by a child
        own = tempfile.TemporaryDirectory(suffix)
        # The object its importers hold, now the child's: its name and removal at exit are `own`'s, which lives as long
        # as the child (`own`'s collection would remove the folder at once)
        folder.name, folder._finalizer, folder._own = own.name, own._finalizer, own


def _reread_tqdm() -> None:
    """tqdm's `envwrap` read the TQDM_* defaults into `tqdm.__init__` (a partialmethod of the function) as the server
    imported it: wrapped again from the function with this environment's, the bars of tqdm and of every subclass
    (transformers', huggingface_hub's) take them as in a fresh interpreter (tests/test_warm.py compares them)."""
    from tqdm import std, utils

    init = vars(std.tqdm)["__init__"]
    std.tqdm.__init__ = utils.envwrap("tqdm", is_method=True, types=TQDM_TYPES)(getattr(init, "func", init))


def _reread() -> None:
    """Read the environment again as huggingface_hub, datasets, transformers and accelerate did while being imported:
    the Hub libraries' constants modules run again, the few values other modules computed from them are computed
    again, and every module's copy of a value that moved (`from ... import HF_MODULES_CACHE`) is replaced.
    tests/test_warm.py compares the result with a fresh interpreter's."""
    import importlib
    import types

    modules = [sys.modules[n] for n in ("huggingface_hub.constants", "datasets.config") if n in sys.modules]
    modules += [sys.modules[n] for n in ("transformers.utils.hub", ACCELERATE_CONFIG) if n in sys.modules]
    before = [dict(vars(m)) for m in modules]
    for module in modules[:2]:  # constants only; the other two define classes that must stay the ones in use
        importlib.reload(module)
    hub = sys.modules.get("huggingface_hub.constants")
    if "transformers.utils.hub" in sys.modules:  # transformers/utils/hub.py's, as of transformers 5.23
        default = os.path.join(hub.HF_HOME, "modules")
        sys.modules["transformers.utils.hub"].HF_MODULES_CACHE = os.getenv("HF_MODULES_CACHE", default)
    if ACCELERATE_CONFIG in sys.modules:  # accelerate/commands/config/config_args.py's, as of accelerate 1.15
        config = sys.modules[ACCELERATE_CONFIG]
        default = os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
        config.hf_cache_home = os.path.expanduser(os.environ.get("HF_HOME", default))
        config.cache_dir = os.path.join(config.hf_cache_home, "accelerate")
        config.default_json_config_file = os.path.join(config.cache_dir, "default_config.yaml")
        config.default_yaml_config_file = config.default_config_file = config.default_json_config_file
    moved = {}  # name -> (old value, new value)
    for module, old in zip(modules, before, strict=True):
        for name, value in old.items():
            new = vars(module).get(name)
            if isinstance(value, (str, bool, int, os.PathLike, type(None))) and new is not value and new != value:
                moved[name] = (value, new)
    # A path's old string is one object, made at import: a default argument that is it was made from it.
    paths = {id(old): new for old, new in moved.values() if isinstance(old, (str, os.PathLike))}
    computed = {id(m) for m in modules}  # theirs were computed above
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", {})
        for name, (old, new) in moved.items():
            if id(module) not in computed and names.get(name) is old:
                names[name] = new
        # type(), not isinstance(): that reads __class__, which warns on some of torch's deprecated names
        for function in [f for f in names.values() if type(f) is types.FunctionType and f.__defaults__]:
            if any(id(d) in paths for d in function.__defaults__):
                function.__defaults__ = tuple(paths.get(id(d), d) for d in function.__defaults__)
    if "huggingface_hub.hf_api" in sys.modules:  # the instance behind huggingface_hub.upload_folder and the like
        sys.modules["huggingface_hub.hf_api"].api.endpoint = hub.ENDPOINT


# --- the client -------------------------------------------------------------------------------------------------------


def client(path: str, real_python: str, args: list[str], unbuffered: bool = False) -> None:
    """Run `python ARGS` (`python -u ARGS` when `unbuffered`) in a child of the server at `path`, or as `real_python`
    when it cannot run there."""
    while args and args[0] == "-u":
        unbuffered, args = True, args[1:]

    def real():
        os.execv(real_python, [real_python, *(["-u"] if unbuffered else []), *args])

    if not args or args[0].startswith("-"):
        real()
    # The signals this process started with ignored (a shell's background job: SIGINT; nohup: SIGHUP), which a
    # fresh interpreter in its place would start with ignored too.
    ignored = [int(sig) for sig in FORWARDED if signal.getsignal(sig) == signal.SIG_IGN]
    # The others are forwarded from before the child exists (it may run, and be signalled by the test, before this
    # process reads its id): one that comes first is sent on once the id is known.
    child, pending = None, []
    # Python runs a handler again inside itself when the next signal comes: a flood (the test's SIGTERM as often as it
    # can land) nested it until a RecursionError ended the client, -15 in its teardown. One call sends them all.
    sending = False

    def forward(sig, _frame):
        nonlocal sending
        if sig not in pending:
            pending.append(sig)
        while child is not None and pending and not sending:  # checked again once done: one may have come in between
            sending = True
            while pending:
                try:
                    os.kill(child, pending.pop(0))
                except ProcessLookupError:
                    pass  # ended already: its status is on its way
            sending = False

    for sig in FORWARDED:
        if int(sig) not in ignored:
            signal.signal(sig, forward)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        request = {"argv": args, "env": dict(os.environ), "cwd": os.getcwd(), "unbuffered": unbuffered}
        request["mounts"] = os.readlink("/proc/self/ns/mnt")
        _send(sock, request | {"ignored": ignored}, (0, 1, 2))
        answer, _ = _recv(sock)
    except OSError:
        answer = None
    if not answer or "pid" not in answer:
        sock.close()
        for sig in pending:  # as they would have ended the fresh interpreter started now
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        real()  # exec: the handlers set above go back to the defaults
    child = answer["pid"]
    if pending:
        forward(pending[0], None)
    answer, _ = _recv(sock)
    # The child has ended: a signal from now on (torchrun's agent stops the ranks left once one has ended) must not
    # end this process otherwise than the child did. Blocked, not ignored: Python 3.11 raises "Signal 15 ignored due
    # to race condition" out of signal.signal() when one is pending, and its teardown (skipped: nothing of this
    # process's own is left to flush) puts the default handlers back.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    status = answer["status"] if answer else -1
    if status == -1 or os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status) if status != -1 else signal.SIGKILL
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # the two a process cannot handle (signal() raises EINVAL)
            with contextlib.suppress(OSError):  # the race above: this process ends of `sig` all the same
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    serve(sys.argv[2], sys.argv[3])  # `python warm.py serve SOCKET PROJECT`; clients: conftest._Warm
