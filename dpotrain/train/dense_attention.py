"""The trained model on a dense attention for a forward that is not a training micro-batch.

Samples generate with the trained model, and the unused-parameter probe runs one 2-token forward through it. The
attention chosen for training may not run there: a kernel that wants packed inputs (a varlen FlashAttention, the
project's own kernels in dpotrain/forwards/) takes no padded batch or KV cache, and FlexAttention would compile again
for each new shape (the cache's one-token queries, the probe's 2 positions). sdpa (eager where the class has none)
runs any of them, at the cost of a generation that is not block-sparse.
"""

import contextlib

from transformers import PreTrainedModel

from dpotrain.recipe import upstream

DENSE = ("sdpa", "eager")


def _configs(base: PreTrainedModel) -> list:
    """Every config of `base` whose attention a forward reads, each parent before its sub-configs (a multimodal
    model's text config is one): setting a config's attention sets its sub-configs' too, so restoring in this order
    leaves each as it was."""
    found, queue = {}, [base.config]
    while queue:
        config = queue.pop(0)
        if id(config) in found:
            continue
        found[id(config)] = config
        queue.extend(c for key in getattr(config, "sub_configs", {}) if (c := getattr(config, key, None)) is not None)
    # Submodels built from a config of their own (not one of the sub-configs) read theirs
    for module in base.modules():
        if isinstance(module, PreTrainedModel) and id(module.config) not in found:
            found[id(module.config)] = module.config
    return list(found.values())


@contextlib.contextmanager
def dense_attention(model):
    """`model` (a PreTrainedModel, or a PEFT model holding one) on sdpa, or eager where its class has no sdpa, inside;
    each config back on its own attention after, an error inside included. A model on sdpa or eager is left as it is."""
    # The Trainer hands callbacks its unwrapped model (not a DeepSpeed engine); a PEFT model holds the base model
    base = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None) if model is not None else None
    if base is None:
        yield
        return
    configs = _configs(base)
    before = [upstream.attn_implementation(config) for config in configs]
    if all(name is None or name in DENSE for name in before):
        yield
        return
    dense = "sdpa" if upstream.supports_sdpa(base) else "eager"
    try:
        for config, name in zip(configs, before, strict=True):
            upstream.set_attn_implementation(config, name if name is None or name in DENSE else dense)
        yield
    finally:
        for config, name in zip(configs, before, strict=True):
            upstream.set_attn_implementation(config, name)
