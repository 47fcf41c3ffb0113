"""Which sequence-parallel group carries a max_length: what the analyzer (scripts/analyze_dataset.py) says of each
length, for the recipe's GPUs. Each answer is the memory plan itself on a copy of the recipe at that max_length, with
micro-batches of one whole pair of it (so it does not depend on the recipe's budget), for the groups a refusal offers,
smallest first. A length past the model's positions is not planned: training refuses it."""

from dpotrain.cluster import sequence_parallel
from dpotrain.cluster.engine import NAMES, Engine
from dpotrain.data import positions
from dpotrain.forwards import choice
from dpotrain.plan import memory
from dpotrain.plan.memory_advice import node_size
from dpotrain.recipe.config import replaced
from dpotrain.recipe.errors import plural
from dpotrain.recipe.run_record import MemoryPlan


def carrying_groups(
    recipe, world: int, engine: Engine, max_lengths: list[int], longest: int | None = None, model: tuple | None = None
) -> dict:
    """For each max_length, the smallest `sequence_parallel_size` whose plan fits the GPU (None: no group within a node
    does) and its GiB per GPU, or the model's positions where sequences would reach past them (`longest`: the data's
    longest sequence); or why nothing was planned (`skipped`). `model`: the model's (config, why not) where the caller
    has read it (`memory.model_config_or_reason`), else read here from local files."""
    config, why = model or memory.model_config_or_reason(recipe)
    if config is None:
        return {"skipped": why}
    if engine.name == "unplanned":
        return {"skipped": engine.source}
    one = replaced(recipe, project={"memory_check": False, "sequence_parallel_size": 1})
    attention = choice.lightest_attention(config, one)
    found = {"engine": NAMES[engine.name], "world_size": world, "attention": attention, "lengths": {}}
    limit, _ = positions.model_limit(config)
    groups = [1]  # then the groups a refusal would offer, under DeepSpeed's engine, for a model a group splits
    if engine.name in sequence_parallel.ENGINES and (heads := memory.splittable_heads(config, recipe)):
        groups = sequence_parallel.groups_within(node_size(engine), world, heads)
    for length in sorted(set(max_lengths)):
        if limit and min(length, longest or length) > limit:
            found["lengths"][length] = {"past_positions": limit}
            continue
        found["lengths"][length] = {"sequence_parallel_size": None}
        for n in groups:
            project = {"memory_check": False, "max_tokens_per_microbatch": 2 * length, "sequence_parallel_size": n}
            trial = replaced(recipe, training={"max_length": length}, project=project)
            # The config read once above; the plan read by its fields (`MemoryPlan`), as the run reads its own
            planned = MemoryPlan.of(memory.plan(trial, world, engine, attention=attention, model=(config, None)))
            if planned.skipped is not None or planned.fits is None:
                return {"skipped": planned.skipped or "the GPU memory is unknown: pass --gpu_memory_gib"}
            found["gpu_memory_gib"] = planned.gpu_memory_gib
            found["lengths"][length] = {"sequence_parallel_size": n if planned.fits else None, "gib": planned.total_gib}
            if planned.fits:
                break
    return found


def line(found: dict) -> str:
    """'Memory per GPU (DeepSpeed ZeRO-2 on 8 GPUs of 79.6 GiB, flex_attention): max_length 16384 fits (~41.2 GiB);
    65536 fits with --sequence_parallel_size 4 (~62.1 GiB)'."""
    if "skipped" in found:
        return f"Memory per GPU: not planned ({found['skipped']})"
    parts = []
    for length, it in found["lengths"].items():
        n = it.get("sequence_parallel_size")
        if "past_positions" in it:
            said = f"reaches past the model's {it['past_positions']:,} positions (training refuses it)"
        elif n:
            said = f"fits{f' with --sequence_parallel_size {n}' * (n > 1)} (~{it['gib']} GiB)"
        else:
            said = f"does not fit with any sequence_parallel_size within a node (~{it['gib']} GiB at the largest)"
        parts.append(f"max_length {length} {said}")
    where = (
        f"{found['engine']} on {plural(found['world_size'], 'GPU')} of {found['gpu_memory_gib']} GiB, "
        f"{found['attention']}, one whole pair per micro-batch"
    )
    return f"Memory per GPU ({where}): {'; '.join(parts)}"
