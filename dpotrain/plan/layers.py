"""The decoder layers as the run trains them: activation checkpointing held to the memory plan's choice, and an optional
regional `torch.compile` of each layer (docs/memory.md, "Activation checkpointing, chosen per run").

TRL 1.16 turns checkpointing off and on again around its own no-grad forwards
(`trl.models.utils.disable_gradient_checkpointing`), back on with `model.gradient_checkpointing_enable(...)`: every
layer. `hold_checkpointing` makes that call restore the plan's layers instead. `compile_layers` compiles each decoder
layer on its own: one graph serves every layer of a kind. Off by default until a GPU measurement shows it pays.
"""

from dpotrain.recipe import upstream


def decoder_layers(model) -> list:
    """The repeated blocks transformers checkpoints, in order (`GradientCheckpointingLayer`)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def checkpointed(model) -> list[int]:
    """Indices of the decoder layers that recompute their forward in backward (in training mode)."""
    return [i for i, layer in enumerate(decoder_layers(model)) if layer.gradient_checkpointing]


def checkpointed_every(training_args) -> int | None:
    """The decoder layers the training arguments checkpoint: every k-th (1: all), or None (none)."""
    if not training_args.activation_checkpointing:
        return None
    return int((training_args.activation_checkpointing_kwargs or {}).get("every_n_layers", 1))


def checkpointing_fields(training, chosen: dict | None) -> dict:
    """The memory plan's choice (its `checkpointing`: every k-th layer, or none) as training arguments (transformers
    pops `every_n_layers` from the kwargs); none where the plan was skipped. The memory advice's lever gives the same
    fields for every layer."""
    if not chosen:
        return {}
    every, on = chosen["every_n_layers"], chosen["every_n_layers"] is not None
    kwargs = {k: v for k, v in (training.activation_checkpointing_kwargs or {}).items() if k != "every_n_layers"}
    kwargs = (kwargs | {"every_n_layers": every} if on else kwargs) or None
    fields = {"activation_checkpointing": on, "gradient_checkpointing": on}
    return fields | {"activation_checkpointing_kwargs": kwargs, "gradient_checkpointing_kwargs": kwargs}


def hold_checkpointing(model, training_args) -> None:
    """Checkpoint the plan's layers now, and whenever anyone re-enables checkpointing on `model`, not every layer."""
    every = checkpointed_every(training_args)
    if every is None:
        return  # nothing is enabled, so TRL's helpers have nothing to turn back on
    kwargs = dict(training_args.activation_checkpointing_kwargs or {})
    kwargs.pop("every_n_layers", None)
    offload = kwargs.pop("offload", False)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT wraps the model

    def enable(*_, **__):
        upstream.enable_checkpointing(base, kwargs or None, every, offload)

    for target in {id(model): model, id(base): base}.values():
        target.gradient_checkpointing_enable = target.activation_checkpointing_enable = enable  # an instance attribute
    enable()  # now, as the Trainer will when training starts: what the run records is what it trains with


def compile_layers(model) -> int:
    """Compile each decoder layer in place; the number compiled."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    return len(layers)
