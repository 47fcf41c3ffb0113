"""The project's libraries come from its virtual environment: outside it, one line naming the fix, not a traceback.

`train_dpo.py` and every script in scripts/ call `require()` before they import anything but the standard library
(this module imports nothing else at its top, so it runs under any python3). It looks the packages up without
importing them. Then `load_env` reads the project's `.env`, before the libraries are imported.
"""

import importlib.util
import os
import sys
from pathlib import Path

# What the entry points import first (import names, not the distributions of requirements.txt, which installs them).
STACK = ("torch", "transformers", "trl", "datasets", "dotenv", "yaml")
ROOT = Path(__file__).resolve().parents[2]


def _shown(path: Path) -> str:
    """`path` as a command typed here would name it: relative inside the current folder, else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def project_file(name: str) -> str:
    """A file of the project (`scripts/prefetch.py`, `train_dpo.py`) as a printed command names it, to be typed back
    in the folder the command ran in: `scripts/prefetch.py` from the project root (a Slurm job runs there), else its
    path from here. Named from the project root alone, a command printed by a run started elsewhere (`python
    ~/dpotrain/train_dpo.py --config ~/dpotrain/configs/my.yaml`) found no such script where its other paths hold."""
    return _shown(ROOT / name)


def require() -> None:
    """Ends the process with one `error:` line (exit 1) when a package of the stack is not installed for this Python;
    else puts this Python's own bin folder first on PATH (`own_tools_first`)."""
    missing = next((name for name in STACK if importlib.util.find_spec(name) is None), None)
    if missing is None:
        own_tools_first()
        return
    venv = ROOT / ".venv"
    fix = f"run `source {_shown(venv / 'bin' / 'activate')}` first, or call {_shown(venv / 'bin' / 'python')}"
    if not (venv / "bin" / "python").exists():
        fix = f"run `bash {_shown(ROOT / 'scripts' / 'setup_env.sh')}` (it creates .venv), then {fix}"
    else:
        fix += f" (`bash {_shown(ROOT / 'scripts' / 'setup_env.sh')}` installs what is missing)"
    sys.exit(f"error: {missing} is not installed for {sys.executable}: {fix}")


def load_env(root: Path) -> None:
    """The project's `.env` in `root` (HF_TOKEN, WANDB_API_KEY, HF_HUB_OFFLINE, ...) into the environment, which wins
    over it. Each entry point reads it here twice: as a command, before it imports the stack, since huggingface_hub and
    datasets read HF_HUB_OFFLINE, HF_HOME and HF_ENDPOINT once, as they are imported (read after them, a `.env`'s
    HF_HUB_OFFLINE=1 left a job on a node without network retrying every file for minutes); and in main(), for a caller
    that imported it (a notebook, the tests), whose Hub libraries are imported already: its offline switches are then
    handed to them."""
    from dotenv import load_dotenv  # `require` checked it is installed

    load_dotenv(root / ".env")
    if "huggingface_hub" in sys.modules or "datasets" in sys.modules:  # imported before this read: told now
        from dpotrain.recipe import hub_switches

        hub_switches.take_dotenv_switches()


def own_tools_first() -> None:
    """This Python's bin folder (its venv's) first on PATH where it holds `ninja`, as activating the venv would.
    DeepSpeed compiles its JIT ops (on CPU its shared-memory communication op) with the `ninja` found on PATH: a
    system ninja of another version hashes the build's commands differently, so a run started without the venv
    activated and one started by scripts/launch.sh (which puts the venv first) each found the other's build stale and
    compiled the op again, ~30 s on 2 cores, every time they alternated."""
    own = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if os.path.isfile(os.path.join(own, "ninja")) and path.split(os.pathsep)[0] != own:
        os.environ["PATH"] = own + os.pathsep + path if path else own
