"""`python tests/helpers/ctrl_c_in.py SCRIPT ARGS`: SCRIPT ARGS (train_dpo.py, scripts/analyze_dataset.py), given a
Ctrl-C (SIGINT to itself) at one exact point of its imports, however fast the machine runs: where the C function named
by DPOTRAIN_TEST_CTRL_C_IN (e.g. `torch._C._c10d_init`, which `import torch` calls) first calls Python code. A SIGINT
sent 0.5 s in landed there only now and then (on a fast machine), where the KeyboardInterrupt, raised in Python code
that torch's C++ called, aborted the process (SIGABRT, "terminate called after throwing ... KeyboardInterrupt").

The point is found with `sys.setprofile` (the Python code torch's C++ runs there is importlib's module lock for a module
already loaded, which raises no audit event); the profiler is off once it is reached, and nothing of the project is
replaced. `import:NAME` instead names a module: the signal is sent as its import starts (the "import" audit event), for
a script whose imports are too quick for a timed SIGINT to land in them. DPOTRAIN_TEST_CTRL_C_SENT: a file written just
before the signal, so that a test knows the point was met."""

import os
import runpy
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHERE, SENT = os.environ["DPOTRAIN_TEST_CTRL_C_IN"], Path(os.environ["DPOTRAIN_TEST_CTRL_C_SENT"])
in_c = []  # (frame, C function) of the C calls under way, innermost last


def profile(frame, event, arg) -> None:
    if event == "c_call":
        in_c.append((frame, arg))
    elif event in ("c_return", "c_exception"):
        if in_c and in_c[-1][0] is frame:
            in_c.pop()
    elif event == "call" and in_c and in_c[-1][0] is frame.f_back:  # Python code called by a C function
        function = in_c[-1][1]
        if f"{getattr(function, '__module__', None)}.{getattr(function, '__qualname__', '')}" == WHERE:
            sys.setprofile(None)
            SENT.write_text(f"{frame.f_code.co_filename}:{frame.f_code.co_name}\n")
            os.kill(os.getpid(), signal.SIGINT)  # handled in `frame`, the Python code the C function called


def at_import(event, args) -> None:
    if event == "import" and args[0] == WHERE.removeprefix("import:") and not SENT.exists():
        SENT.write_text(f"import {args[0]}\n")
        os.kill(os.getpid(), signal.SIGINT)


if __name__ == "__main__":
    script = str(ROOT / sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` lays out its sys.path
    if WHERE.startswith("import:"):
        sys.addaudithook(at_import)
    else:
        sys.setprofile(profile)
    runpy.run_path(script, run_name="__main__")
