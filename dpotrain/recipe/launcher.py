"""What the launch tells each process in its environment, read here alone: the launcher's RANK, LOCAL_RANK, WORLD_SIZE
and LOCAL_WORLD_SIZE (`accelerate launch` and torchrun set them for every process they start), and the job's
GPUS_PER_NODE (scripts/launch.sh's, or a person's, for a dry run that plans a job of several nodes).

They hold before any process group exists: the model's load, the first writes and the recipe's own parsing ask them.
Once the group is up, torch.distributed's rank and size say the same (`collectives.rank_and_world`)."""

import os

from dpotrain.recipe.errors import ConfigError


def under_launcher() -> bool:
    """Whether a launcher started this process (it sets LOCAL_RANK for each process it starts)."""
    return "LOCAL_RANK" in os.environ


def rank() -> int:
    """This process's rank in the launch (RANK; 0 without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def launched_main() -> bool:
    """Whether this is the launch's first process (RANK 0, or no launcher)."""
    return rank() == 0


def first_on_node() -> bool:
    """Whether this is the first process the launch started on this node (LOCAL_RANK 0, or no launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def world(default: int | None = None) -> int | None:
    """The launch's processes (WORLD_SIZE), `default` where no launcher says."""
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else default


def several_processes() -> bool:
    """Whether the launch runs more than one process (WORLD_SIZE over 1)."""
    return world(1) > 1


def processes_per_node() -> int:
    """The launch's processes on this node (LOCAL_WORLD_SIZE; 1 without a launcher)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def planned_gpus_per_node() -> int:
    """The job's GPUs per node (GPUS_PER_NODE: scripts/launch.sh's --gpus-per-node); 0 where none is given."""
    return int(os.environ.get("GPUS_PER_NODE") or 0)


def check_process_counts() -> None:
    """WORLD_SIZE and GPUS_PER_NODE, which a dry run plans for (`WORLD_SIZE=16 GPUS_PER_NODE=8`), as whole numbers: a
    typo ended the command in a ValueError traceback from the first line that read one."""
    for name in ("WORLD_SIZE", "GPUS_PER_NODE"):
        value = os.environ.get(name)
        if value and not (value.strip().isdigit() and int(value) > 0):
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
