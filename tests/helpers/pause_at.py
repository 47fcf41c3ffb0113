"""`python tests/helpers/pause_at.py ARGS`: train_dpo.py ARGS, stopped (SIGSTOP, by itself) at one exact point, so that
a test kills it or changes its world there however fast the machine runs. Polling for a file raced the run: on a fast
machine the reference stage merged its parts, or training logged its next step, between two looks 0.05 s apart.

The point is given by the files the run writes, as Python's audit hooks see them (nothing of the project is replaced):
- DPOTRAIN_TEST_PAUSE_AFTER: an fnmatch pattern of a path renamed into place (the project writes every file it keeps
  to a temporary name, then renames it), e.g. `*/checkpoint-2/COMPLETE`; empty: from the start (a run replacing
  another removes its files before it renames any);
- DPOTRAIN_TEST_PAUSE_AT: a pattern of a path opened after that rename (`*` for the next file opened at all): the
  process stops before that open, with the renamed file in place;
- DPOTRAIN_TEST_PAUSE_AT_COUNT (1 unless given): stop before the Nth such open rather than the first, where no file is
  renamed between the opens (metrics.jsonl is appended to once per logged step: 2 stops before the second step's);
- DPOTRAIN_TEST_PAUSE_AT_EVENT (`open` unless given): the audit event DPOTRAIN_TEST_PAUSE_AT is matched on, e.g.
  `os.remove` to stop before a file is deleted (shutil.rmtree gives the name alone, relative to its folder);
- DPOTRAIN_TEST_PAUSED_FILE: where it writes its process id first (conftest.paused_pid waits for it and the stop);
- DPOTRAIN_TEST_PAUSE_SCRIPT (`train_dpo.py` unless given): the project's script to run, from its root, e.g.
  `scripts/analyze_dataset.py`. With DPOTRAIN_TEST_PAUSE_AT_EVENT `import`, DPOTRAIN_TEST_PAUSE_AT is a module's name,
  matched as it is first imported (before its code runs).
Under the tests' warm interpreter the process that stops is the forked child, not the client the test started: signal
the id written (the client exits as its child did)."""

import fnmatch
import os
import runpy
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AFTER, AT = os.environ["DPOTRAIN_TEST_PAUSE_AFTER"], os.environ["DPOTRAIN_TEST_PAUSE_AT"]
PAUSED_FILE = os.environ["DPOTRAIN_TEST_PAUSED_FILE"]
COUNT = int(os.environ.get("DPOTRAIN_TEST_PAUSE_AT_COUNT", "1"))
EVENT = os.environ.get("DPOTRAIN_TEST_PAUSE_AT_EVENT", "open")
SCRIPT = os.environ.get("DPOTRAIN_TEST_PAUSE_SCRIPT", "train_dpo.py")
state = {"armed": not AFTER, "done": False, "seen": 0}


def hook(event: str, args: tuple) -> None:
    if state["done"]:
        return
    if event == "os.rename" and fnmatch.fnmatch(os.fsdecode(args[1]), AFTER):
        state["armed"] = True
    elif event == EVENT and state["armed"] and isinstance(args[0], (str, bytes, os.PathLike)):
        if fnmatch.fnmatch(os.fsdecode(args[0]), AT) and os.fsdecode(args[0]) != PAUSED_FILE:
            state["seen"] += 1
            if state["seen"] < COUNT:
                return
            state["done"] = True
            with open(PAUSED_FILE + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(PAUSED_FILE + ".tmp", PAUSED_FILE)
            os.kill(os.getpid(), signal.SIGSTOP)


if __name__ == "__main__":
    sys.addaudithook(hook)
    script = str(ROOT / SCRIPT)
    sys.argv[0] = script
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` lays out its sys.path
    runpy.run_path(script, run_name="__main__")
