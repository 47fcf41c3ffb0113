"""What scripts/launch.sh asks the package, so that the script reads neither the recipe nor the record itself:
`engine <recipe>` names the accelerate config the job launches with, `summary` (the dry run's JSON on stdin) prints the
job's batch, memory plan and output folder, and ends the job (exit code 2) where the run would refuse."""

import os
import sys

from dpotrain.recipe import recipe_file, run_record
from dpotrain.recipe.config import ProjectArguments
from dpotrain.recipe.errors import ConfigError, run_cli


def engine(recipe: str) -> str:
    """The recipe's own (think-32b.yaml names ZeRO-3); `none` (plain `python train_dpo.py`) or none given: the default,
    accelerate_config.yaml. launch.sh's ACCELERATE_CONFIG wins over both."""
    named = recipe_file.load(recipe).get("accelerate_config")
    return str(named) if named and str(named).lower() != "none" else ProjectArguments.accelerate_config


def summary(text: str) -> int:
    """The lines a job's log shows of its dry run; what the run would refuse (a login missing, the output folder) as
    its own `error:` lines, and 2: the job ends in seconds, before any process starts."""
    start = max(text.find("{\n"), 0)  # a library may print a line of its own before the JSON
    r = run_record.parse(text[start:], "the dry run's output")
    b, world, memory = r.batching, r.launch.world_size, r.memory
    output = os.path.abspath(r.output.output_dir)  # where the run writes, whatever folder reads the log
    if b.max_tokens_per_microbatch:  # micro-batches cut by tokens: their count per step comes from the data
        print(
            f"batch: {b.pairs_per_step} pairs per step over {world} processes, micro-batches of at most "
            f"{b.max_tokens_per_microbatch} packed tokens per process; output: {output}"
        )
    else:
        print(
            f"batch: {b.pairs_per_step} pairs per step = {b.pairs_per_micro_batch} per process x "
            f"{b.micro_batches_per_step} accumulation x {world} processes; output: {output}"
        )
    if memory.per_gpu_gib:
        gpu = f"of {memory.gpu_memory_gib} GiB" if memory.gpu_memory_gib else f"(GPU memory {memory.gpu_memory_source})"
        print(f"memory plan: ~{memory.per_gpu_gib['total']} GiB per GPU {gpu} under {memory.engine}")
    elif memory.skipped:
        print(f"memory plan skipped: {memory.skipped}")
    for refusal in r.output.would_refuse:
        print(f"error: {refusal}", file=sys.stderr)
    return 2 if r.output.would_refuse else 0


def main(argv: list[str] | None = None) -> int:
    verb, *args = (sys.argv[1:] if argv is None else argv) or [""]
    if verb == "engine" and len(args) == 1:
        print(engine(*args))
        return 0
    if verb == "summary" and not args:
        return summary(sys.stdin.read())
    raise ConfigError("usage: python -m dpotrain.cluster.job engine <recipe> | summary < <the dry run's JSON>")


if __name__ == "__main__":
    run_cli(main)
