"""The seam between TRL and this project: one `DPOTrainer`, configured from a recipe, with our callbacks.

Everything DPO-specific (tokenization, reference model, loss) is TRL's. What this project adds enters here as
callbacks, so TRL can be upgraded without touching the rest.
"""

from . import builtin
from .checkpoints import CompleteMarker
from .config import Recipe
from .metrics import MetricsRecorder
from .preemption import GracefulStop


def model_init_kwargs(recipe: Recipe) -> dict:
    """What TRL's own `trl/scripts/dpo.py` passes to `from_pretrained`, from ModelConfig's fields."""
    kwargs = dict(
        revision=recipe.model.model_revision,
        attn_implementation=recipe.model.attn_implementation,
        dtype=recipe.model.dtype,
    )
    kwargs.update(recipe.training.model_init_kwargs or {})
    return kwargs


def resolve_model_path(recipe: Recipe) -> str:
    name = recipe.model.model_name_or_path
    return builtin.materialize_model(name) if builtin.is_builtin(name) else name


def build_trainer(recipe: Recipe, train_dataset, callbacks=(), eval_dataset=None):
    """The DPOTrainer, with: COMPLETE marks on checkpoints, metrics.jsonl, and a clean stop on Slurm's signals.

    `trainer.graceful_stop.stopped` tells after `train()` whether it ended early to be requeued.
    """
    from trl import DPOTrainer, get_peft_config, get_quantization_config

    recipe.training.model_init_kwargs = model_init_kwargs(recipe)
    graceful_stop = GracefulStop.from_env()
    # Order matters: GracefulStop.on_save reports a checkpoint only after CompleteMarker has marked it.
    trainer = DPOTrainer(
        model=resolve_model_path(recipe),
        args=recipe.training,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,  # dataset_test_split, with eval_strategy
        callbacks=[CompleteMarker(), MetricsRecorder(), graceful_stop, *callbacks],
        # LoRA (--use_peft): TRL wraps the model and scores the reference with the adapter disabled (no second model).
        peft_config=get_peft_config(recipe.model),
        quantization_config=get_quantization_config(recipe.model),  # --load_in_4bit/8bit, as TRL's own dpo.py
    )
    trainer.graceful_stop = graceful_stop
    return trainer
