"""`python tests/helpers/report_groups.py train_dpo.py ARGS`: runs train_dpo.py as `accelerate launch` would, and as
the process exits prints every process group it made and the collective timeout torch holds for each, once the
engines have made theirs (DeepSpeed makes groups inside `deepspeed.initialize`, after the start-up line)."""

import atexit
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())


def report() -> None:
    from dpotrain import engine

    # One write of the whole line: print's two writes (text, then newline) from the two ranks can interleave.
    sys.stdout.write(f"process groups of rank {os.environ.get('RANK', '0')}: {engine.group_timeouts()}\n")
    sys.stdout.flush()


atexit.register(report)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
