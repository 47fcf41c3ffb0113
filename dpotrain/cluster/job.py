"""What scripts/launch.sh asks the package, so that the script reads neither the recipe nor the record itself.

    python -m dpotrain.cluster.job engine configs/think.yaml   # the accelerate config the job launches with
    python -m dpotrain.cluster.job plan < dry-run.json         # the job's plan, and what the run would refuse

`engine`: the recipe's own accelerate_config (configs/think-32b.yaml names ZeRO-3), read as training reads the file;
a recipe that plans plain `python train_dpo.py` (`none`) or names none is launched under the default,
accelerate_config.yaml. launch.sh's ACCELERATE_CONFIG wins over both.
`plan`: the dry run's record (`train_dpo.py --dry-run --json`, recipe/run_record.py): the batch per step, the output
folder and the memory plan per GPU on stdout; what the run would refuse (a login missing, the output folder) as the
run's own `error:` lines on stderr, with exit code 2: the job ends there, in seconds, before any process starts.
"""

import os
import sys

from dpotrain.recipe import recipe_file, run_record
from dpotrain.recipe.config import ProjectArguments
from dpotrain.recipe.errors import ConfigError, run_cli


def engine(recipe: str) -> str:
    named = recipe_file.load(recipe).get("accelerate_config")
    return str(named) if named and str(named).lower() != "none" else ProjectArguments.accelerate_config


def plan(text: str) -> int:
    """The lines a job's log shows of its dry run; 2 where the run would refuse."""
    r = run_record.parse(text[text.find("{\n") :] if "{\n" in text else text, "the dry run's output")  # a library's
    b, world, memory = r.batching, r.launch.world_size, r.memory  # line may come first
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
    if verb == "plan" and not args:
        return plan(sys.stdin.read())
    raise ConfigError("usage: python -m dpotrain.cluster.job engine <recipe> | plan < <the dry run's JSON>")


if __name__ == "__main__":
    run_cli(main)
