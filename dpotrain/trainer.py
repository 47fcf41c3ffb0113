"""The seam between TRL and this project: one `DPOTrainer`, configured from a recipe, with our callbacks.

Everything DPO-specific (tokenization, reference model, loss) is TRL's. What this project adds enters here as
callbacks, so TRL can be upgraded without touching the rest.
"""

from . import builtin
from .checkpoints import CompleteMarker
from .config import Recipe
from .metrics import MetricsRecorder


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
    from trl import DPOTrainer

    recipe.training.model_init_kwargs = model_init_kwargs(recipe)
    return DPOTrainer(
        model=resolve_model_path(recipe),
        args=recipe.training,
        train_dataset=train_dataset,
        callbacks=[CompleteMarker(), MetricsRecorder(), *callbacks],
    )
