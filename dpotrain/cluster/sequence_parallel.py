"""Sequence parallelism (DeepSpeed Ulysses): how the launch's processes split into groups, and what each decision
that counts processes for data must count instead (docs/sequence_parallel.md).

The processes form groups of N consecutive ranks (DeepSpeed's `parallel_state_sp.initialize_sequence_parallel`), each
reading one micro-batch split along its positions. So everything that counts processes for data (pairs per step,
accumulation, the step plan, the sampler, evaluation, the reference stage) counts data-parallel ranks
(`data_parallel_size`), and a process reads its group's share (`data_parallel_rank`). ZeRO still shards over the world.
"""

from dpotrain.cluster.engine import NAMES
from dpotrain.recipe.errors import ConfigError, plural

ENGINES = ("zero2", "zero3")  # DeepSpeed's Ulysses runs under its own engine only
ENGINE_NAMES = "DeepSpeed ZeRO-2 (accelerate_config.yaml) or ZeRO-3 (ACCELERATE_CONFIG=configs/accelerate/zero3.yaml)"


def data_parallel_size(world: int, n: int) -> int:
    """Data-parallel ranks: the groups of `n` processes that each read their own micro-batches (`check_launch`)."""
    return world // n


def data_parallel_rank(process_index: int, n: int) -> int:
    """The data-parallel rank of a process, its group: which share of the data it reads, with the rest of its group."""
    return process_index // n


def sequence_parallel_rank(process_index: int, n: int) -> int:
    """The position of a process in its group: which 1/n of each micro-batch's sequence it holds."""
    return process_index % n


def divisors(count: int) -> list[int]:
    return [d for d in range(1, count + 1) if count % d == 0]


def check_launch(n: int, world: int, engine) -> None:
    """What the launch alone decides: `n` divides the processes, and the engine runs Ulysses (the forward's checks:
    `forwards/choice.py`; the heads: `check_heads`, once the model's config is read)."""
    if n < 1:
        raise ConfigError(f"sequence_parallel_size must be >= 1 (got {n}); 1 turns sequence parallelism off")
    if n == 1:
        return
    if world % n:
        works = ", ".join(str(d) for d in divisors(world))
        raise ConfigError(
            f"sequence_parallel_size {n} does not divide the {plural(world, 'process')}: use "
            f"one of {works}, or launch a multiple of {n} processes"
        )
    if engine.name not in ENGINES:
        what = NAMES.get(engine.name, f"an engine plans do not cover ({engine.source})")
        raise ConfigError(
            f"sequence_parallel_size {n} needs DeepSpeed's engine (Ulysses), not {what}: launch "
            f"with {ENGINE_NAMES}, or use --sequence_parallel_size 1"
        )


def head_counts(config) -> tuple[int, int]:
    """(attention heads, key/value heads) of a model's text config. Gemma 4 may give its full-attention layers their
    own key/value heads (`num_global_key_value_heads`) and then refuses a global count: the most a layer has, the
    memory plan's upper bound (the split rule judged on it holds for every layer where the counts are powers of 2).
    A model without attention (Mamba, RWKV) has none: (0, 0)."""
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None) or 0
    if "num_key_value_heads" in (getattr(text, "per_layer_attributes", None) or ()):
        return heads, max(layer.num_key_value_heads or heads for layer in text.per_layer_config)
    return heads, getattr(text, "num_key_value_heads", None) or heads


def splits_heads(n: int, heads: int, kv_heads: int) -> bool:
    """DeepSpeed's rule (`UlyssesSPAttentionHF`): `n` divides the attention heads, and divides the key/value heads or
    is a multiple of them (each rank then gets a replicated key/value head)."""
    return heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)


def groups_within(per_node: int, world: int, heads: tuple[int, int]) -> list[int]:
    """The group sizes a refusal or the analyzer weighs: within a node (the all-to-all of every layer on the node's own
    links), dividing the processes, splitting the model's (attention heads, key/value heads); 1 first."""
    return [n for n in divisors(per_node) if world % n == 0 and splits_heads(n, *heads)]


def check_heads(n: int, config, world: int) -> None:
    """Refused at the forward stage, where the model's config is first read: an `n` the heads do not split."""
    if n == 1:
        return
    heads, kv = head_counts(config)
    if not splits_heads(n, heads, kv):
        works = ", ".join(str(d) for d in divisors(world) if splits_heads(d, heads, kv))
        raise ConfigError(
            f"sequence_parallel_size {n} does not split the model's {heads} attention heads and {kv} key/value heads "
            f"over a group: use one of {works} (dividing the heads and the {world} processes)"
        )
