"""The seam between TRL and this project: one `DPOTrainer`, configured from a recipe, with our callbacks.

Everything DPO-specific (tokenization, reference model, loss) is TRL's. What this project adds enters here as
callbacks, so TRL can be upgraded without touching the rest.
"""

from . import builtin
from .checkpoints import CompleteMarker
from .config import Recipe
from .health import HealthGuard
from .metrics import MetricsRecorder
from .preemption import GracefulStop
from .samples import SampleGenerator


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


def build_trainer(recipe: Recipe, train_dataset, callbacks=()):
    """The DPOTrainer, with: COMPLETE marks on checkpoints, metrics.jsonl, a clean stop on Slurm's signals, health
    guards and sample generations.

    `trainer.graceful_stop.stopped` tells after `train()` whether it ended early to be requeued.
    """
    from trl import DPOTrainer

    recipe.training.model_init_kwargs = model_init_kwargs(recipe)
    graceful_stop = GracefulStop.from_env()
    health = HealthGuard(recipe.project) if recipe.project.health_checks else None
    # Order matters: GracefulStop.on_save reports a checkpoint only after CompleteMarker has marked it.
    trainer = DPOTrainer(
        model=resolve_model_path(recipe),
        args=recipe.training,
        train_dataset=train_dataset,
        callbacks=[CompleteMarker(), MetricsRecorder(), graceful_stop, *([health] if health else []), *callbacks],
    )
    trainer.graceful_stop = graceful_stop
    trainer.health = health  # .stop tells after `train()` whether a guard stopped it (dpotrain/health.py)
    if recipe.project.samples_every > 0:
        trainer.add_callback(SampleGenerator.from_recipe(recipe, trainer.train_dataset, trainer.processing_class))
    return trainer
