"""The project's libraries come from its virtual environment: outside it, one line naming the fix, not a traceback.

`train_dpo.py` and every script in scripts/ call `require()` (most through `entry_point`) before they import anything
but the standard library (this module imports nothing else at its top, so it runs under any python3). It looks the
packages up without importing them. Then `load_env` reads the project's `.env`, before the libraries are imported.
"""

import contextlib
import hashlib
import importlib.util
import io
import os
import re
import shlex
import signal
import sys
import threading
from pathlib import Path

# What the entry points import first (import names, not the distributions of requirements.txt, which installs them).
STACK = ("torch", "transformers", "trl", "datasets", "dotenv", "yaml")
ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def loading_libraries():
    """Around an entry point's imports of the stack (seconds): Ctrl-C there has started nothing and loses nothing, so it
    ends in one line, exit 130 (128 + SIGINT, as a shell reports it), not in the traceback of the import it hit."""
    try:
        yield
    except KeyboardInterrupt:
        print("\nCtrl-C: stopped while loading the libraries; nothing was started", file=sys.stderr)
        sys.exit(130)
    except OSError as e:
        # torch makes its compile cache as transformers imports it (dynamo's disk cache): one it cannot make ended
        # every command, a dry run too, in the traceback of that import
        folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if not (folder and e.filename and _on_the_way(os.fsdecode(e.filename), folder)):
            raise
        print(
            f"error: torch's compile cache TORCHINDUCTOR_CACHE_DIR={folder} cannot be made ({e.strerror}: "
            f"{os.fsdecode(e.filename)}): set TORCHINDUCTOR_CACHE_DIR to a folder this job can write in, or unset it",
            file=sys.stderr,
        )
        sys.exit(2)


def _on_the_way(path: str, folder: str) -> bool:
    """Whether `path` is `folder`, a folder above it or a file inside it."""
    path, folder = (Path(os.path.abspath(os.path.expanduser(p))) for p in (path, folder))
    return path == folder or path in folder.parents or folder in path.parents


def import_torch() -> None:
    """`import torch`, first of the stack inside `loading_libraries` (after `load_env`: libgomp reads OMP_NUM_THREADS as
    torch loads it), with Ctrl-C held back until it ends, then raised there. torch's C++ set-up calls Python code
    (`torch._C._c10d_init`, ...), and a KeyboardInterrupt raised in it aborted the process ("terminate called after
    throwing an instance of 'pybind11::error_already_set'", SIGABRT, a core dump message) instead of the one line.
    Only torch's import: holding Ctrl-C through all of the stack's let transformers print to stdout first."""
    previous = signal.getsignal(signal.SIGINT)
    # Held only where Python handles Ctrl-C (not in a background job, which ignores it) and can swap its handler
    if "torch" in sys.modules or not callable(previous) or threading.current_thread() is not threading.main_thread():
        import torch  # noqa: F401

        return
    pressed = []
    signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        import torch  # noqa: F401
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        previous(signal.SIGINT, None)  # Python's own handler raises KeyboardInterrupt: `loading_libraries` says it


@contextlib.contextmanager
def entry_point(root: Path, command: bool):
    """Around an entry point's imports of the stack, in their order: the venv checked (`require`); run as a command
    (not imported), the project's `.env` (`load_env`: the libraries read HF_HUB_OFFLINE, HF_HOME, HF_ENDPOINT as
    they are imported); torch first (`import_torch`). A Ctrl-C while they load is one line (`loading_libraries`).
    What the libraries print while imported goes to stderr: transformers prints "[INFO] Running in WANDB offline mode"
    to stdout with WANDB_MODE=offline, which came before a dry run's `--json` and broke `| jq`."""
    require()
    with loading_libraries(), contextlib.redirect_stdout(sys.stderr):
        if command:
            load_env(root)
        import_torch()
        yield


def _shown(path: Path) -> str:
    """`path` as a command typed here would name it: relative inside the current folder, else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def project_file(name: str) -> str:
    """A file of the project (`scripts/prefetch.py`) as a printed command names it, to be typed back in the folder the
    command ran in: from the project root there (a Slurm job runs there), else its path from here."""
    return _shown(ROOT / name)


def require() -> None:
    """Ends the process with one `error:` line (exit 1) when a package of the stack is not installed for this Python;
    else puts this Python's own bin folder first on PATH (`own_tools_first`)."""
    missing = next((name for name in STACK if importlib.util.find_spec(name) is None), None)
    if missing is None:
        own_tools_first()
        return
    venv = ROOT / ".venv"
    # quoted as a shell reads them: a project in a folder with spaces printed commands that broke when pasted
    activate, python = shlex.quote(_shown(venv / "bin" / "activate")), shlex.quote(_shown(venv / "bin" / "python"))
    setup = shlex.quote(_shown(ROOT / "scripts" / "setup_env.sh"))
    fix = f"run `source {activate}` first, or call {python}"
    if not (venv / "bin" / "python").exists():
        fix = f"run `bash {setup}` (it creates .venv), then {fix}"
    else:
        fix += f" (`bash {setup}` installs what is missing)"
    sys.exit(f"error: {missing} is not installed for {sys.executable}: {fix}")


# What `load_env` read from each project's `.env` (None: a bare `NAME` line), for `hidden`'s messages to speak of that
# reading, not of the file read again. A message names a variable, never its value (HF_TOKEN, WANDB_API_KEY).
_ENV_FILE_VALUES: dict[Path, dict[str, str | None]] = {}


def load_env(root: Path) -> None:
    """The project's `.env` in `root` (HF_TOKEN, WANDB_API_KEY, HF_HUB_OFFLINE, ...) into the environment, which wins
    over it. Read before the stack is imported, since huggingface_hub and datasets read HF_HUB_OFFLINE, HF_HOME and
    HF_ENDPOINT once, as they are imported (read after them, `.env`'s HF_HUB_OFFLINE=1 left an offline job retrying
    every file for minutes); read in main() instead for a caller that imported them (a notebook, the tests), whose
    libraries are then handed its offline switches."""
    from dotenv import dotenv_values  # `require` checked it is installed

    given = {name for name in CACHE_FOLDERS if os.environ.get(name)}  # the environment's, before the `.env`'s
    text = check_env_file(root / ".env")
    name_unread_env_file(Path(root))
    # As load_dotenv: the environment wins, a bare `NAME` line sets nothing; the text checked, then its folders expanded
    # (a `$VAR` may name a variable set further down the file). An empty variable wins too (`HF_TOKEN= cmd` says "no
    # token", and the tests mean it so): where it hides `.env`'s value, the message asking for it says so (`hidden`).
    values = {} if text is None else dotenv_values(stream=io.StringIO(text, newline=None))
    _ENV_FILE_VALUES[Path(root)] = dict(values)
    refuse_launcher_variables(root / ".env", values)
    taken = {k: v for k, v in values.items() if v is not None and k not in os.environ}
    os.environ.update(taken)
    for name, value in taken.items():
        try:
            os.environ[name] = expand_folder(name, value)
        except Unexpanded as e:
            if e.why != "unset":  # `$EMPTY/hf` would be `/hf`; `${X:-y}` no variable read
                said = f"{e.args[0]} is set empty" if e.why == "empty" else f"{e.args[0]} is not read there"
                sys.exit(f"error: .env sets {name}={value}, but {said}: write the folder's absolute path in .env")
            sys.exit(
                f"error: .env sets {name}={value}, but {e.args[0]} is not set: export {e.args[0]} "
                "before running, or write the folder's absolute path in .env"
            )
    for name in CACHE_FOLDERS:
        _anchor_cache_folder(name, root if name not in given else None)
    if "huggingface_hub" in sys.modules or "datasets" in sys.modules:  # imported before this read: told now
        from dpotrain.recipe import hub_switches

        hub_switches.take_late_switches()


# The `.env` files of other folders `name_unread_env_file` has named: once each, however often `.env` is read.
_NAMED_UNREAD: set[Path] = set()


def name_unread_env_file(root: Path) -> None:
    """A `.env` in the folder the command was typed in (a Slurm job's: the folder submitted from), which is not the
    project's: only the project's is read, and this one's HF_TOKEN, WANDB_MODE=offline or HF_HOME went unread without
    a word (the job's caches in the home quota; the dry run asking to "add WANDB_API_KEY=... to .env" of a key added
    there). Named once, on stderr, by the launch's main process (in a job, by launch.sh's dry run before the launch);
    it is still not read."""
    from dpotrain.recipe import errors, launcher

    try:
        folder = Path(os.environ.get("DPOTRAIN_SUBMIT_DIR") or os.getcwd())
    except OSError:  # typed in a folder removed since: none to look in
        return
    path, own = folder / ".env", root / ".env"
    if path in _NAMED_UNREAD or not launcher.launched_main() or not os.path.lexists(path):
        return
    # A launch by scripts/launch.sh (it sets DPOTRAIN_SUBMIT_DIR): its dry run, before the launch, named it in the log
    if launcher.under_launcher() and os.environ.get("DPOTRAIN_SUBMIT_DIR"):
        return
    with contextlib.suppress(OSError):
        if folder.resolve() == root.resolve() or (os.path.exists(own) and os.path.samefile(path, own)):
            return
    _NAMED_UNREAD.add(path)
    errors.warn(
        f"{path} is not read: every command reads the project's .env alone ({own}), so what it sets is not set here: "
        f"move its lines into {own}, or set them in the shell"
    )


def hidden(name: str, root: Path | None = None) -> str:
    """A message's last clause where an empty `name` in the environment hides `.env`'s value (`export HF_TOKEN=` in a
    shell profile: the message asking to add it to `.env`, which the user had done, named no cause); else nothing.
    `.env` as `load_env` read it for the project in `root`: a command that did not read it hides nothing of it."""
    value = os.environ.get(name)
    in_file = _ENV_FILE_VALUES.get(Path(root or ROOT), {}).get(name)
    if value and not value.strip():  # `HF_TOKEN="  "`: set, so the user looks no further than that it is
        if value == in_file:  # `.env`'s line, which an `unset` in the shell would not touch
            return f" (.env sets {name} to white space only: give its value there)"
        return f" ({name} is set to white space only: give its value, or unset {name})"
    if value != "" or not in_file:
        return ""
    return f" (.env sets {name}, but an empty {name} in the environment wins over it: unset {name})"


def env_file_gave(name: str) -> Path | None:
    """The project's `.env` where the environment's value of `name` is the one it gave, as `load_env` read it; None
    where the environment sets another or none (`export HF_TOKEN=...` in a shell profile wins over `.env`'s)."""
    value = os.environ.get(name)
    return ROOT / ".env" if value is not None and _ENV_FILE_VALUES.get(ROOT, {}).get(name) == value else None


def is_utf16(data: bytes) -> bool:
    """Whether `data` is UTF-16 text, as PowerShell 5's `>` and Notepad's "Unicode" save it: its byte-order mark, or
    (without one) a NUL beside every ASCII letter. One rule for the recipe, `.env` and the data files."""
    return data.startswith((b"\xff\xfe", b"\xfe\xff")) or data.count(b"\0") * 3 > len(data)


def check_env_file(path: Path) -> str | None:
    """`.env`'s text, every line of it readable; None where there is none. Unchecked, python-dotenv skips a line it
    cannot read (an unclosed quote, `NAME: value`), with a warning naming no file, and what it set was then missing
    (push_to_hub.py: "add HF_TOKEN=... to .env"); one not UTF-8 (UTF-16 as PowerShell 5 writes it) was a
    UnicodeDecodeError traceback from every entry point."""
    if not os.path.lexists(path):
        return None
    # Skipped as absent, python-dotenv's way, a `.env` there but not readable left every value in it unset without a
    # word (HF_HOME, HF_HUB_OFFLINE, WANDB_MODE=offline ignored, a job's cache in the home quota); unreadable, it
    # was a PermissionError traceback from every entry point.
    if path.is_symlink() and not path.exists():
        sys.exit(f"error: {path} is a link to {os.readlink(path)}, which is not there: point it at your .env file")
    if not path.is_file():
        sys.exit(f"error: {path} is not a file (a folder?): the project's .env is a file of NAME=value lines")
    from dotenv.parser import parse_stream

    try:
        data = path.read_bytes()
    except OSError as e:  # another user's .env in a shared checkout (mode 600)
        sys.exit(f"error: cannot read {path} ({e.strerror}): give the user running this read permission on it")
    if is_utf16(data):  # without its byte-order mark it decodes, and its NULs were os.environ's "embedded null byte"
        sys.exit(f"error: {path} is UTF-16 text, not the UTF-8 python-dotenv reads: save it as UTF-8")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:  # Latin-1 (`HF_TOKEN=hf_café`): was a traceback
        line = data[: e.start].count(b"\n") + 1  # its number, never its bytes: the line may hold a token
        sys.exit(f"error: {path} line {line} is not UTF-8 text, which python-dotenv reads: save it as UTF-8")
    bad = next((b.original.line for b in parse_stream(io.StringIO(text, newline=None)) if b.error), None)
    if bad is not None:  # its number, never its text: the line may hold a token
        sys.exit(
            f"error: {path} line {bad} is not NAME=value (python-dotenv cannot read it, so it sets nothing): write it "
            "as NAME=value, with any quote closed"
        )
    return text


# Read by scripts/launch.sh alone, from the environment the job starts with (the shell never reads `.env`); nothing in
# Python reads them.
LAUNCHER_ONLY = ("RECIPE", "ACCELERATE_CONFIG", "VENV", "PREFLIGHT", "CPU_PROCESSES_PER_NODE", "MAIN_PROCESS_PORT")


def refuse_launcher_variables(path: Path, values: dict) -> None:
    """A `.env` setting a variable of launch.sh's: the job ran without it, without a word (PREFLIGHT=1: no preflight;
    CPU_PROCESSES_PER_NODE=2: one process; RECIPE: the script's default recipe). One the environment has the same
    value of is harmless."""
    name = next((k for k in LAUNCHER_ONLY if values.get(k) is not None and values[k] != os.environ.get(k)), None)
    if name is not None:
        sys.exit(
            f"error: {path} sets {name}, which only scripts/launch.sh reads, from the environment a job starts with "
            f"(never from .env): remove it from .env and give it on the command line ({name}=... sbatch "
            "scripts/dpo_train.sh ...)"
        )


# The cache folders the entry points and the libraries read (huggingface_hub and datasets as they are imported).
CACHE_FOLDERS = ("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "DPOTRAIN_CACHE")


def expand_folder(name: str, value: str) -> str:
    """A folder `.env` gives (HF_HOME, HF_DATASETS_CACHE, TRITON_CACHE_DIR, ...) with `~` and `$VAR` read as a shell
    reads them: python-dotenv expands only `${VAR}`, and datasets and triton take the rest literally, so
    `HF_DATASETS_CACHE=~/ds` filled a folder named `~` in whatever folder the command ran in. `Unexpanded` (a KeyError)
    names a variable that is not set or set empty (a shell's empty one would have put the cache at the root)."""
    return shell_expanded(value) if is_folder_name(name) else value


def is_folder_name(name: str) -> bool:
    """Whether variable `name` names a folder (HF_HOME, HF_DATASETS_CACHE, TRITON_CACHE_DIR, ...) by its ending."""
    return name.endswith(("HOME", "CACHE", "DIR"))


# A variable named like a secret (HF_TOKEN, WANDB_API_KEY, ..._PASSWORD): a name part token, secret, password or
# api_key, as scripts/launch.sh masks such flags in the Slurm log. No message quotes its value.
_SECRET_NAME = re.compile(r"(^|[_.-])(token|secret|password|api[_-]?key)([_.-]|$)", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    """Whether variable `name` holds a secret (HF_TOKEN, WANDB_API_KEY), whose value no line may print."""
    return bool(_SECRET_NAME.search(name))


class Unexpanded(KeyError):
    """A `$` in a value `shell_expanded` does not read: args[0] the variable's name (`why` "unset" or "empty"), or the
    text it does not read (`why` "syntax": `${NAME:-x}`, which the shell reads and a recipe does not)."""

    def __init__(self, name: str, why: str):
        super().__init__(name)
        self.why = why


# `$$`, `$NAME`, `${NAME}`, or `${` and what follows up to its `}` (syntax not read); any other `$` is literal
_VARIABLE = re.compile(r"\$(?:(\$)|([A-Za-z_][A-Za-z0-9_]*)|\{([A-Za-z_][A-Za-z0-9_]*)\}|(\{[^}]*\}?))")


def shell_expanded(value: str, environ=None) -> str:
    """`value` with a leading `~`, `$NAME` and `${NAME}` read as a shell reads them, `$$` a literal `$`, any other `$`
    (`run$5`, `cost$`) literal. One rule for a recipe's paths and its `env:` block: os.path.expandvars left an unset
    variable as written (then refused) and expanded an empty one to nothing, `$EMPTY/runs/a` being `/runs/a`, and
    read `${NAME:-x}` as a variable named `NAME`. Raises `Unexpanded`. `environ`: os.environ, or what is set so far."""
    environ = os.environ if environ is None else environ

    def one(match: re.Match) -> str:
        literal, name, braced, syntax = match.groups()
        if literal:
            return "$"
        if syntax is not None:
            raise Unexpanded(match[0], "syntax")
        name = name or braced
        if environ.get(name) is None:
            raise Unexpanded(name, "unset")
        if not environ[name]:
            raise Unexpanded(name, "empty")
        return environ[name]

    return _VARIABLE.sub(one, os.path.expanduser(value))


def _anchor_cache_folder(name: str, env_file_folder: Path | None) -> None:
    """A relative cache folder made absolute, once, where it was written: a `.env`'s in the project, the environment's
    in the folder it was set in (a Slurm job's: DPOTRAIN_SUBMIT_DIR). Read from each command's own folder, it was one
    folder for prefetch.py and the analyzer, another for the job (lengths measured again, prefetched files missed)."""
    value = os.environ.get(name)
    if value is not None and not value.strip():
        # Set empty (`HF_HOME=` left blank in .env, `export HF_DATASETS_CACHE=`): the Hub libraries join their folders
        # to it, so each command cached in the folder it ran in (./hub, ./datasets). Unset: their default, as ours.
        del os.environ[name]
        return
    if not value or os.path.isabs(os.path.expanduser(value)):
        if value:  # a `~` the shell left (quoted, or passed on by a program): datasets made a folder named `~` here
            os.environ[name] = os.path.expanduser(value)
        return
    folder = env_file_folder or os.environ.get("DPOTRAIN_SUBMIT_DIR") or os.getcwd()
    os.environ[name] = os.path.normpath(os.path.join(folder, value))


def own_tools_first() -> None:
    """This Python's bin folder (its venv's) first on PATH where it holds `ninja`, as activating the venv would:
    DeepSpeed builds its JIT ops with the `ninja` on PATH, and a system ninja of another version hashes the build
    differently, so runs with and without the venv activated rebuilt the op (~30 s on 2 cores) each time. And the
    ops are built in the venv (`torch_extensions_default`)."""
    own = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if os.path.isfile(os.path.join(own, "ninja")) and path.split(os.pathsep)[0] != own:
        os.environ["PATH"] = own + os.pathsep + path if path else own
    if "TORCH_EXTENSIONS_DIR" not in os.environ and (folder := torch_extensions_default()):
        os.environ["TORCH_EXTENSIONS_DIR"] = folder


def torch_extensions_default() -> str | None:
    """Where DeepSpeed's JIT ops are built unless TORCH_EXTENSIONS_DIR says: in this venv. torch's default,
    ~/.cache/torch_extensions/<py>_<device>, is one folder for every venv, and a build records its venv's paths, so
    two checkouts (or two projects) rebuilt each other's ops at every switch (~45 s on 2 cores, minutes on a GPU node)
    and waited on each other's build lock. A venv reached through a link (a checkout sharing another's `.venv`) builds
    in a folder of its own spelling inside the real venv: each spelling records other paths, so in torch's default (or
    in the real venv's own folder) the checkouts sharing it rebuilt in turn, a rank waiting 1-3 min on the lock and
    the build each time. None (torch's default) for no venv, or one this user cannot write in (a shared install)."""
    prefix = sys.prefix
    real = os.path.realpath(prefix)
    if prefix == sys.base_prefix or not os.access(real, os.W_OK):
        return None
    if real == prefix:
        return os.path.join(prefix, "torch_extensions")
    spelling = hashlib.sha256(prefix.encode()).hexdigest()[:12]
    return os.path.join(real, "torch_extensions", "linked", spelling)
