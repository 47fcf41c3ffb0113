r"""What the interpreter's teardown would cost at a command's end, measured alone (BENCHMARKS.md, "The process's end").

    .venv/bin/python benchmarks/process_end.py train_dpo.py --config configs/smoke.yaml --dry-run
    .venv/bin/python benchmarks/process_end.py scripts/analyze_dataset.py data/smoke_prefs.jsonl \
        --config configs/smoke.yaml

Runs the command as `python COMMAND` would, up to its end (`errors.end_process`: its threads joined, its exit handlers
run). There, for each way of ending, a forked child of that same finished process ends that way, and the child's CPU
time (os.wait4) is the cost of the end alone, free of the start-up's noise on a loaded machine: `teardown` (Python's
normal exit: every module freed, the heap collected), `gc.disable()` or `gc.freeze()` before it, and `os._exit`
(what the project does). The sys part includes the copy-on-write faults of the pages a child touches, which a fresh
process would not pay and a warm test child (tests/helpers/warm.py) does. One line on stderr; then the command's own
exit code.
"""

import gc
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpotrain.recipe import errors, upstream  # noqa: E402

ENDS = {
    "teardown": lambda: None,
    "gc.disable": gc.disable,
    "gc.freeze": gc.freeze,  # triton's nanobind then reports its objects as leaked (hidden here: stderr to /dev/null)
}


def measured_end(code: int) -> None:
    costs = []
    for name, before in [*ENDS.items(), ("os._exit", None)]:
        pid = os.fork()
        if pid == 0:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            if before is None:
                os._exit(code)
            before()
            sys.exit(code)
        _, status, usage = os.wait4(pid, 0)
        assert os.waitstatus_to_exitcode(status) == code, (name, status)
        costs.append(f"{name} {usage.ru_utime:.2f}+{usage.ru_stime:.2f}")
    sys.stderr.write(f"end of {os.path.basename(sys.argv[0])}, CPU-s user+sys: {' | '.join(costs)}\n")
    sys.stderr.flush()
    os._exit(code)


def first_steps_then_measured(code: int) -> None:
    """errors.end_process's first steps (threads, exit handlers, streams), then the ends measured."""
    upstream.wait_for_threads()
    upstream.run_exit_handlers()
    sys.stdout.flush()
    sys.stderr.flush()
    measured_end(code)


if __name__ == "__main__":
    errors.end_process = first_steps_then_measured
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
