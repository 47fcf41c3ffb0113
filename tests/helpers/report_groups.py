"""`python tests/helpers/report_groups.py train_dpo.py ARGS`: runs train_dpo.py as `accelerate launch` would, and as
the run ends its processes (`engine.end_processes`) prints every process group it made and the collective timeout
torch holds for each, once the engines have made theirs (DeepSpeed makes groups inside `deepspeed.initialize`, after
the start-up line)."""

import os
import runpy
import sys

sys.path.insert(0, os.getcwd())

import torch.distributed as dist  # noqa: E402

from dpotrain.cluster import engine  # noqa: E402  (the project, from the folder the launch runs in)
from dpotrain.recipe import upstream  # noqa: E402

end_processes = engine.end_processes


def report_then_end() -> None:
    # One write of the whole line: print's two writes (text, then newline) from the two ranks can interleave.
    groups = upstream.group_timeouts() if dist.is_initialized() else {}  # torch's name of each group: its timeout
    sys.stdout.write(f"process groups of rank {os.environ.get('RANK', '0')}: {groups}\n")
    sys.stdout.flush()
    end_processes()


engine.end_processes = report_then_end
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
