"""What the launch tells each process in its environment, read here alone: the launcher's RANK, LOCAL_RANK, WORLD_SIZE
and LOCAL_WORLD_SIZE (`accelerate launch` and torchrun set them for every process they start), and the job's
GPUS_PER_NODE (scripts/launch.sh's, or a person's, for a dry run that plans a job of several nodes).

They hold before any process group exists: the model's load, the first writes and the recipe's own parsing ask them.
Once the group is up, torch.distributed's rank and size say the same (`collectives.rank_and_world`)."""

import os

from dpotrain.recipe.errors import ConfigError

# What `accelerate launch` and torchrun set together for every process they start.
LAUNCHER_SETS = ("LOCAL_RANK", "RANK", "WORLD_SIZE")
# What `accelerate launch`'s simple launcher (one process, no process group: --num_processes 1, --cpu) sets together
# for the one process it starts, which gets no LOCAL_RANK (accelerate's prepare_simple_launcher_cmd_env)
SIMPLE_LAUNCHER_SETS = ("ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND")


def under_launcher() -> bool:
    """Whether a launcher started this process (it sets LOCAL_RANK for each process it starts)."""
    return "LOCAL_RANK" in os.environ


def simple_launch_environment() -> bool:
    """Whether this process has the environment `accelerate launch`'s simple launcher gives the one process it starts
    (or that process's children): its variables, and no LOCAL_RANK. What says so where the launcher itself is gone."""
    return not under_launcher() and all(name in os.environ for name in SIMPLE_LAUNCHER_SETS)


def _number(name: str, default: int) -> int:
    """A launcher variable as a number; `default` where it is not one (`check_launch_variables` refuses it, and the
    process that reads it first must still write that line, not a ValueError traceback)."""
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() else default


def rank() -> int:
    """This process's rank in the launch (RANK; 0 without a launcher)."""
    return _number("RANK", 0)


def launched_main() -> bool:
    """Whether this is the launch's first process (RANK 0, or no launcher)."""
    return rank() == 0


def first_on_node() -> bool:
    """Whether this is the first process the launch started on this node (LOCAL_RANK 0, or no launcher: a LOCAL_RANK
    without the RANK and WORLD_SIZE a launcher sets beside it is a user's, whose refusal this process must write)."""
    if any(name not in os.environ for name in LAUNCHER_SETS):
        return True
    return _number("LOCAL_RANK", 0) == 0


def world(default: int | None = None) -> int | None:
    """The launch's processes (WORLD_SIZE), `default` where no launcher says."""
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else default


def several_processes() -> bool:
    """Whether the launch runs more than one process (WORLD_SIZE over 1)."""
    return world(1) > 1


def processes_per_node() -> int:
    """The launch's processes on this node (LOCAL_WORLD_SIZE; 1 without a launcher)."""
    return _number("LOCAL_WORLD_SIZE", 1)


def planned_gpus_per_node() -> int:
    """The job's GPUs per node (GPUS_PER_NODE: scripts/launch.sh's --gpus-per-node); 0 where none is given."""
    return int(os.environ.get("GPUS_PER_NODE") or 0)


def check_process_counts() -> None:
    """WORLD_SIZE and GPUS_PER_NODE, which a dry run plans for (`WORLD_SIZE=16 GPUS_PER_NODE=8`), as whole numbers: a
    typo ended the command in a ValueError traceback from the first line that read one."""
    check_launch_variables()
    for name in ("WORLD_SIZE", "GPUS_PER_NODE", "LOCAL_WORLD_SIZE"):
        value = os.environ.get(name)
        # An empty WORLD_SIZE (`export WORLD_SIZE=`) is set all the same: int('') was a traceback (GPUS_PER_NODE: unset)
        if value is None or (name == "GPUS_PER_NODE" and not value):
            continue
        if not (value.strip().isdigit() and int(value) > 0):
            raise ConfigError(
                f"{name}={value!r} is not a number of processes: give a whole number (WORLD_SIZE=16 GPUS_PER_NODE=8 "
                "plans 2 nodes of 8 GPUs), or unset it"
            )
    world, node = int(os.environ.get("WORLD_SIZE") or 0), planned_gpus_per_node()
    if node and world > node and world % node:  # planned as "3 nodes of 3 GPUs" for 8 processes
        raise ConfigError(
            f"WORLD_SIZE={world} processes fill no whole number of nodes of GPUS_PER_NODE={node} (a job starts one "
            f"process per GPU on every node): give a multiple of {node}, e.g. WORLD_SIZE={world // node * node} or "
            f"{(world // node + 1) * node}"
        )


def check_launch_variables() -> None:
    """RANK and LOCAL_RANK as a launcher sets them: a user's own (a shell that exported LOCAL_RANK=1 while debugging)
    ended the command in a ValueError traceback, torch's "environment variable RANK expected, but not set", or, with
    LOCAL_RANK above 0, in exit 2 and no line at all (only a node's first process writes a refusal)."""
    for name in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(name)
        if value is not None and not value.strip().isdigit():
            raise ConfigError(
                f"{name}={value!r} is not a process's rank: accelerate launch and torchrun set it for each process "
                f"they start; unset {name} to run as one process (python train_dpo.py)"
            )
    missing = [name for name in LAUNCHER_SETS if name not in os.environ]
    if "LOCAL_RANK" in os.environ and missing:
        are = "is" if len(missing) == 1 else "are"
        raise ConfigError(
            f"LOCAL_RANK={os.environ['LOCAL_RANK']} is set but {' and '.join(missing)} {are} not, which a launcher "
            "(accelerate launch, torchrun) sets beside it for each process it starts: unset LOCAL_RANK to run as one "
            "process (python train_dpo.py), or start the run with its launcher (scripts/launch.sh)"
        )
