"""Options TRL or transformers accept at parse time but fail on (or ignore) only after the model loaded: refused here.

README "Refused before anything loads" lists them.
"""

import dataclasses
import importlib.util
import json
import math
import os
import re
import shlex
import urllib.error
import urllib.request
from pathlib import Path

from dpotrain.cluster import offline
from dpotrain.data import builtin, data, data_identity, hub_revision, mixture, model_identity, shapes
from dpotrain.forwards import choice, packing
from dpotrain.recipe import config, errors, init_kwargs, launcher, upstream, venv, writes
from dpotrain.recipe.config import Recipe, uses_live_reference
from dpotrain.recipe.errors import ConfigError
from dpotrain.recipe.init_kwargs import DECIDED_INIT_KWARGS, SECRET_INIT_KWARGS
from dpotrain.recipe.refused import (
    ACCELERATOR_UNREAD,
    ENGINE_SWITCHES,
    EVAL_ONLY,
    EVAL_ONLY_WORDS,
    FSDP_CONFIG,
    INSTEAD,
    LOAD_BEST_REFUSED,
    NOT_DEFAULT,
    SAMPLER,
    SWITCHED_OFF,
    SWITCHED_SETTINGS,
    TRACKIO_FIELDS,
    UNREAD,
    said,
)
from dpotrain.train import losses, pair_metrics, resume
from dpotrain.train.weight_names import WEIGHT_FILES

ROOM_INSIDE = 256  # bytes the run's own names take below its output folder and the project's cache
WANDB_OFFLINE_MODES = ("offline", "disabled", "dryrun")  # W&B modes that never reach its server
WANDB_RESUME_VALUES = ("allow", "must", "never", "auto")  # wandb.Settings.resume's
# Checked by lines of their own: the run id (check_wandb_run_id), the login's key (a blank one is no login) and server
WANDB_CHECKED_APART = ("WANDB_RUN_ID", "WANDB_API_KEY", "WANDB_BASE_URL")


def valid_loss_types() -> list[str]:
    """The loss types DPOTrainer implements, read from DPOConfig's own help text (TRL keeps no list of them)."""
    from trl import DPOConfig

    field = next(f for f in dataclasses.fields(DPOConfig) if f.name == "loss_type")
    return re.findall(r"`'(\w+)'`", field.metadata["help"])


# --json's fix under --preflight (check_options)
PREFLIGHT_JSON = (
    "the preflight is no dry run: drop --json, or write its report as JSON: scripts/preflight.py --json FILE"
)


def check_options(recipe: Recipe) -> None:
    t, s = recipe.training, recipe.script
    check_model(recipe.model.model_name_or_path or "")
    if recipe.project.json and not recipe.project.dry_run:  # else a real run starts where JSON on stdout was asked for
        # with the preflight, "add --dry-run" led on to its refusal of --dry-run: its JSON is its script's
        fix = PREFLIGHT_JSON if recipe.project.preflight else "add --dry-run"
        raise ConfigError(
            f"--json prints the dry run's resolved configuration: {fix} (a run records it in "
            "<output_dir>/resolved_config.json)"
        )
    check_cuda_settings(recipe)
    check_init_kwargs(recipe)
    check_init_kwargs_apply(recipe)  # after the keys the run decides or refuses: their own refusals first
    check_optimizer(t)
    check_adam_settings(recipe)
    check_ranges(recipe)
    check_switched_off(recipe)
    if recipe.model.attn_implementation is not None:
        choice.check_attention_name(recipe.model.attn_implementation)
    valid = valid_loss_types()
    for loss in losses.loss_types(t):
        if loss not in valid:
            spaced = " (several separated by spaces, not commas)" if "," in loss else ""
            raise ConfigError(
                f"unknown loss_type {loss!r}: choose from {', '.join(valid)}{spaced} (OLMo 3: sigmoid_norm)"
            )
    losses.check_options(recipe)  # losses this project cannot train as TRL defines them (aot on a token budget...)
    check_max_length(t)
    if t.max_steps == 0 or t.max_steps < -1:
        raise ConfigError(
            f"max_steps={t.max_steps} trains nothing: give a positive number of optimizer steps, or "
            "leave max_steps unset (-1) to train num_train_epochs"
        )
    for name in ("seed", "data_seed"):  # numpy's range: transformers' set_seed and the step plan's order seed it
        value = getattr(t, name)
        if value is not None and not 0 <= value < 2**32:
            raise ConfigError(f"{name} {value} is out of range: give one from 0 to 2**32 - 1 (the recipes use 42)")
    if t.max_steps < 0 and t.num_train_epochs <= 0:
        raise ConfigError(f"num_train_epochs={t.num_train_epochs:g} trains nothing: the recipes use 1 (or --max_steps)")
    check_epochs_read(recipe)
    check_logging(recipe)
    check_trackio_fields(recipe)
    check_saving(recipe)
    check_streaming(recipe)
    check_engine_switches(t)
    check_compile(t)
    check_unread(recipe)
    if t.save_on_each_node:
        raise ConfigError(f"save_on_each_node {NOT_DEFAULT['save_on_each_node']}")
    if s.ignore_bias_buffers:
        raise ConfigError(f"ignore_bias_buffers {NOT_DEFAULT['ignore_bias_buffers']}")
    if recipe.project.hh_format not in shapes.HH_FORMATS:
        raise ConfigError(
            f"hh_format {recipe.project.hh_format!r}: choose `messages` (HH-RLHF strings through the "
            "chat template, the default) or `text` (the raw strings)"
        )
    if t.train_sampling_strategy == "group_by_length":
        raise ConfigError(
            "train_sampling_strategy group_by_length does not work on preference data (it needs an "
            "input_ids column): remove it (the default, random, is what the recipes use)"
        )
    if t.train_sampling_strategy != "random":  # the step plan draws its own seeded order: another was recorded, unused
        raise ConfigError(f"train_sampling_strategy {t.train_sampling_strategy}: {SAMPLER}")
    if t.use_liger_kernel and importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError(f"use_liger_kernel {said('liger')}")
    check_reference(recipe)
    check_evaluation(recipe)
    check_revisions(recipe)


def check_epochs_read(recipe: Recipe) -> None:
    """`--num_train_epochs 2` typed under a recipe's `max_steps: 100`: max_steps wins (as in transformers), and the run
    trained 100 steps while the command line said 2 epochs. Both in the recipe, or both typed, is max_steps' rule."""
    t, typed = recipe.training, config.fields_set(recipe.command_line)
    if t.max_steps > 0 and "num_train_epochs" in typed and "max_steps" not in typed:
        epochs = f"{t.num_train_epochs:g}"
        ignored = said("epochs_under_max_steps", steps=t.max_steps, epochs=epochs)
        raise ConfigError(f"--num_train_epochs {epochs} {ignored}")


def check_switched_off(recipe: Recipe) -> None:
    """A setting of a feature that is off would be recorded and never read: refused, but not a recipe file's where the
    command line turns the feature off for one run; nor `health_action` after a guard stopped the run in output_dir
    (the rerun reads it: `resume.after_health_stop`)."""
    p, on_command_line = recipe.project, config.fields_set(recipe.command_line)
    stopped = (Path(recipe.training.output_dir) / resume.HEALTH_STOP).is_file()
    for switch, off, fix, settings in SWITCHED_SETTINGS:
        given = config.settings_given(recipe, switch)
        named = [s for s in settings if s in given and not (s == "health_action" and stopped)]
        if not getattr(p, switch) and named:
            raise ConfigError(f"{named[0]} {SWITCHED_OFF.format(switch=switch, off=off, fix=fix, name=named[0])}")
    # transformers' switch, either spelling (config.ALIASES): off, its kwargs are read by nothing
    switched = config.settings_given(recipe, "activation_checkpointing", "gradient_checkpointing")
    given = {config.ALIASES.get(f, f) for f in switched}
    if not recipe.training.activation_checkpointing and "activation_checkpointing_kwargs" in given:
        raise ConfigError(f"activation_checkpointing_kwargs {said('checkpointing_kwargs')}")
    check_checkpointing_kwargs(recipe.training.activation_checkpointing_kwargs)
    # What max_length: auto aims at: typed for a run with a max_length of its own, read by nothing (a recipe file's is
    # left alone: the analyzer's recommendation for that recipe reads it)
    if "auto_coverage" in on_command_line and not recipe.max_length_auto:
        unread = said("auto_coverage", length=recipe.training.max_length)
        raise ConfigError(f"auto_coverage {p.auto_coverage:g} {unread}")


def check_checkpointing_kwargs(kwargs: dict | None) -> None:
    """activation_checkpointing_kwargs go to torch's checkpoint() as keywords at the first training forward, after the
    model loaded and the reference stage scored every pair: a key it does not take (`use_reentrnt`) ended the run
    there in torch's "Unexpected keyword arguments" traceback. every_n_layers and offload are transformers' own."""
    import inspect

    from torch.utils.checkpoint import checkpoint

    taken = {p.name for p in inspect.signature(checkpoint).parameters.values() if p.kind == p.KEYWORD_ONLY}
    taken |= {"every_n_layers", "offload"}
    for key in sorted(set(kwargs or {}) - taken):
        raise ConfigError(
            f"activation_checkpointing_kwargs {key!r} is no argument of torch's checkpoint(), which would stop on it "
            f"at the first training step: {errors.unknown_key_fix(key, taken)}"
        )


def check_reference(recipe: Recipe) -> None:
    """The reference's options that cannot work together (`reference_only` with a live reference scored nothing)."""
    t = recipe.training
    if t.sync_ref_model and recipe.model.use_peft:
        raise ConfigError(f"sync_ref_model {said('sync_with_peft')}")
    if t.sync_ref_model and t.precompute_ref_log_probs:
        raise ConfigError(f"sync_ref_model {said('sync_with_precomputed')}")
    if recipe.project.reference_only and uses_live_reference(recipe):
        raise ConfigError(f"reference_only {said('reference_only_live')}")


def check_revisions(recipe: Recipe) -> None:
    """A model_revision or dataset_revision names a Hub commit: for a local model or data set, never read."""
    s = recipe.script
    model, revision = recipe.model.model_name_or_path, recipe.model.model_revision
    if revision not in (None, "main") and model and not offline.is_hub_model(model):
        raise ConfigError(
            f"model_revision {revision!r} names a commit of a Hub model, and {model!r} is "
            f"{'built in' if builtin.is_builtin(model) else 'a local folder'}: remove model_revision (a recipe "
            "file's, for a model given on the command line: --model_revision main)"
        )
    check_dataset_config(s.dataset_name, s.dataset_config)
    if recipe.project.dataset_revision is not None and not hub_revision.applies(s.dataset_name):
        reads = "this run reads a mixture" if s.dataset_name is None else f"{s.dataset_name!r} is local"
        raise ConfigError(
            f"dataset_revision {recipe.project.dataset_revision!r} names a commit of a Hub data set, and "
            f"{reads}: remove dataset_revision"
        )


def check_dataset_config(name: str | None, config: str | None) -> None:
    """A dataset_config for a file or a save_to_disk data set (which have none) would be read by nothing."""
    local = Path(name).expanduser() if name else None
    if config is None or local is None or not (local.is_file() or data_identity.saved(local)):
        return
    what = "a file" if local.is_file() else "a data set saved by save_to_disk"
    raise ConfigError(
        f"dataset_config {config!r} names a configuration of a Hub data set, and {name!r} is {what}, which has none: "
        "remove dataset_config"
    )


def check_streaming(recipe, where: str = "") -> None:
    """The run refuses a streamed data set, and so does the analyzer for the recipe it reads (`where`: its path)."""
    # TRL's two names for it (streaming is its mixture field: a mixture refuses it first, in mixture.parse)
    given = (("dataset_streaming", recipe.script.dataset_streaming), ("streaming", recipe.project.streaming))
    for name, value in given:
        if value:
            raise ConfigError(
                f"{name}{where}: the step plan and the reference stage need every pair's length up front; "
                "remove it (datasets memory-maps a loaded data set, so it need not fit in RAM)"
            )


def check_engine_switches(t) -> None:
    """TrainingArguments' own switches to DeepSpeed and FSDP, which the engine (cluster/engine.py) never sees: the run
    would run another engine than planned and recorded, without its checks; and FSDP's settings, read only with them."""
    switched = [name for name in ("deepspeed", "fsdp") if getattr(t, name)]
    if switched:
        raise ConfigError(f"{switched[0]} {ENGINE_SWITCHES}")
    if t.fsdp_config:  # transformers reads it only under `fsdp` (above): the run trained, its settings unread
        raise ConfigError(f"fsdp_config {FSDP_CONFIG}")


def check_compile(t) -> None:
    """A torch_compile_backend accelerate does not know ended the run in a traceback as the trainer was built, after the
    model loaded; a torch_compile_mode torch.compile does not take, at the first compiled forward, after the reference
    stage. (transformers turns torch_compile on where either is given.)"""
    from accelerate.utils import DynamoBackend

    backends = [b.value.lower() for b in DynamoBackend]
    backend = t.torch_compile_backend
    if backend is not None and backend.lower() not in backends:
        raise ConfigError(
            f"torch_compile_backend {backend!r} is not one accelerate compiles with: choose from {', '.join(backends)} "
            "(or remove it for inductor)"
        )
    mode = t.torch_compile_mode
    if mode is not None and mode not in (modes := upstream.compile_modes()):  # imports torch's compiler: asked only
        raise ConfigError(
            f"torch_compile_mode {mode!r} is not one torch.compile takes: choose from "
            f"{', '.join(modes)} (or remove it for default)"
        )


def check_unread(recipe: Recipe) -> None:
    """UNREAD fields off their defaults, optim_target_modules for an optim that never reads it, do_train false."""
    from trl import DPOConfig

    t = recipe.training
    defaults = {f.name: f.default for f in dataclasses.fields(DPOConfig) if f.name in UNREAD}
    defaults["include_for_metrics"] = []  # a default_factory's
    for name, why in UNREAD.items():
        value = getattr(t, name)
        if value != defaults[name]:
            spelt = str(value).lower() if isinstance(value, bool) else value
            instead = f"; {INSTEAD[name].format(value=value)}" if name in INSTEAD else ""
            raise ConfigError(f"{name} {spelt} would be ignored: {why}: remove {name}{instead}")
    if t.optim_target_modules is not None and not _named(t.optim).startswith(("galore", "apollo")):
        raise ConfigError(f"optim_target_modules {said('optim_target_modules', optim=_named(t.optim))}")
    accelerator = t.accelerator_config  # transformers' AcceleratorConfig, its defaults where the recipe sets none
    for key, (default, why) in ACCELERATOR_UNREAD.items():
        if (value := getattr(accelerator, key, default)) != default:
            spelt = str(value).lower() if isinstance(value, bool) else value
            raise ConfigError(
                f"accelerator_config {key} {spelt} cannot be honoured: {why}: remove {key} from accelerator_config"
            )
    if t.dataloader_persistent_workers and t.dataloader_num_workers == 0:  # transformers refuses prefetch_factor so
        raise ConfigError(f"dataloader_persistent_workers {said('persistent_workers')}")
    if "do_train" in recipe.given and not t.do_train:
        raise ConfigError(f"do_train false {said('do_train')}")


def check_evaluation(recipe: Recipe) -> None:
    """Evaluation needs held-out pairs: a held-out mixture, or the data set's test split (a local file has none).
    Without eval_strategy, what only evaluation reads is refused: it would be ignored."""
    t, s = recipe.training, recipe.script
    if t.load_best_model_at_end:  # the Trainer loads the best checkpoint into the final model at the end
        raise ConfigError(LOAD_BEST_REFUSED)
    # Not a recipe file's settings where the command line turns evaluation off for one run (as check_switched_off): a
    # recipe that evaluates, run with --eval_strategy no, was refused naming its own eval_datasets, which no flag unsets
    # (the held-out pairs are then not read: stages.load_data)
    given = config.settings_given(recipe, "eval_strategy") if t.eval_strategy == "no" else recipe.given
    if t.eval_strategy == "no":
        values = mixture.fields_of(recipe)
        # eval_on_start is read all the same (the Trainer evaluates at start, a traceback without held-out pairs)
        named = [f for f in mixture.EVAL_FIELDS if values.get(f) and f in given]
        named += [f for f in ("eval_on_start",) if f in recipe.given and t.eval_on_start]
        named += [f for f in ("eval_steps", "do_eval") if f in given and getattr(t, f)]
        named += [f for f in EVAL_ONLY if f in given]
        if named:
            raise ConfigError(f"{named[0]} {EVAL_ONLY_WORDS.format(name=named[0])}")
    check_best_metric(recipe)
    if t.eval_strategy == "epoch" and "eval_steps" in recipe.given and t.eval_steps:  # transformers reads it no more
        raise ConfigError(f"eval_steps {t.eval_steps:g} {said('eval_steps')}")
    if t.eval_strategy != "no" and not mixture.given(mixture.fields_of(recipe), evaluation=True):
        if s.dataset_name is None:  # a training mixture: the held-out pairs are a mixture too
            raise ConfigError(
                "eval_strategy with a training mixture needs its held-out pairs named the same way: "
                "`eval_datasets:` or --dataset_mixer_eval_list SOURCE AMOUNT ..., or remove eval_strategy"
            )
        # a local file is read as one split, dataset_train_split's: a test split of the same name is that split
        one_file = data.is_local(s.dataset_name) and not Path(s.dataset_name).expanduser().is_dir()
        if one_file and s.dataset_test_split != s.dataset_train_split:
            suffix = "".join(Path(s.dataset_name).suffixes)
            raise ConfigError(
                f"eval_strategy needs a held-out split, and the local file {s.dataset_name!r} has one split only: "
                f"put it and the held-out pairs in one folder as {s.dataset_train_split + suffix!r} and "
                f"{s.dataset_test_split + suffix!r} and pass the folder (datasets reads a file named for a split as "
                "that split), name a file of held-out pairs with "
                "--dataset_mixer_eval_list FILE 1.0 (`eval_datasets:` in a recipe), "
                f"save a DatasetDict with a {s.dataset_test_split!r} split (save_to_disk), or remove eval_strategy"
            )
    elif "dataset_test_split" in given:
        raise ConfigError(f"dataset_test_split {s.dataset_test_split!r} {said('dataset_test_split')}")


# metric_for_best_model's choices, with or without transformers' eval_ prefix (its evaluation loop adds the last three)
EVAL_METRICS = (*pair_metrics.EVAL_LOGGED, "runtime", "samples_per_second", "steps_per_second")


def check_best_metric(recipe: Recipe) -> None:
    """metric_for_best_model (and greater_is_better) without a checkpoint to pick or a metric logged: refused."""
    t = recipe.training
    if "greater_is_better" in recipe.given and not t.metric_for_best_model:
        raise ConfigError(f"greater_is_better {str(t.greater_is_better).lower()} {said('greater_is_better')}")
    metric = t.metric_for_best_model
    if metric and metric.removeprefix("eval_") not in EVAL_METRICS:
        # transformers looks it up in each evaluation's metrics: a KeyError at the first one
        raise ConfigError(
            f"metric_for_best_model {metric!r} is not a metric the evaluation logs: choose one of "
            f"{', '.join('eval_' + m for m in EVAL_METRICS)} (the recipes' choice would be eval_loss)"
        )
    if "metric_for_best_model" in recipe.given and _named(t.save_strategy) == "no":
        raise ConfigError(
            f"metric_for_best_model {t.metric_for_best_model} picks the best of the run's checkpoints (kept from "
            "save_total_limit's rotation, named in trainer_state.json), and save_strategy is no: add --save_strategy "
            "steps --save_steps N, or remove metric_for_best_model"
        )


def check_saving(recipe: Recipe) -> None:
    """Checkpoints a resume can use; `save_strategy no` is a choice, said once at start where a job may be preempted."""
    t = recipe.training
    strategy = _named(t.save_strategy)
    if strategy == "steps" and t.save_steps <= 0:
        raise ConfigError(
            f"save_steps={t.save_steps:g} saves no checkpoint until the end, and a requeued job would "
            "restart from step 0: give a number of steps (the recipes save every 100) or a fraction of "
            "the run (0.1), or --save_strategy no to save none on purpose"
        )
    # save_steps is read under `steps` only; a recipe file's is allowed where the command line changes the strategy
    if strategy in ("epoch", "best") and "save_steps" in given_beside(recipe, "save_strategy"):
        raise ConfigError(f"save_steps {t.save_steps:g} {said('save_steps', strategy=strategy)}")
    if strategy == "best" and (not t.metric_for_best_model or t.eval_strategy == "no"):
        missing = "metric_for_best_model" if not t.metric_for_best_model else "evaluation (eval_strategy no)"
        raise ConfigError(
            f"save_strategy best saves a checkpoint when an evaluation's metric_for_best_model improves, and this run "
            f"has no {missing}: add --metric_for_best_model eval_loss --eval_strategy steps --eval_steps N (held-out "
            "pairs: --dataset_mixer_eval_list FILE 1.0), or --save_strategy steps (the recipes save every 100 steps)"
        )
    if t.save_only_model:  # also under save_strategy no: a stop request still saves a checkpoint, then promises it
        raise ConfigError(f"save_only_model {NOT_DEFAULT['save_only_model']}")
    if t.ignore_data_skip:
        raise ConfigError(f"ignore_data_skip {NOT_DEFAULT['ignore_data_skip']}")
    preemptible = os.environ.get("SLURM_JOB_ID") or os.environ.get("DPOTRAIN_STOP_FILE")
    if strategy == "no" and preemptible and launcher.launched_main():
        print(
            "Note: save_strategy no: no checkpoint on the way; a stop request (preemption, time limit) still saves "
            "one, but a job killed without one (a node lost, out of memory) restarts from step 0",
            flush=True,
        )


def check_path_limits(recipe: Recipe) -> None:
    """Paths past their file system's limits; the folders the run writes in need ROOM_INSIDE bytes more."""
    from dpotrain.data.lengths import cache_root

    t, p, values = recipe.training, recipe.project, mixture.fields_of(recipe)
    given = [
        ("output_dir", t.output_dir, ROOM_INSIDE),
        ("DPOTRAIN_CACHE", str(cache_root()), ROOM_INSIDE),
        ("resume_from_checkpoint", t.resume_from_checkpoint, 0),
        ("model_name_or_path", recipe.model.model_name_or_path, 0),
        ("chat_template_path", p.chat_template_path, 0),
        ("sample_prompts_file", p.sample_prompts_file, 0),
        ("dataset_name", recipe.script.dataset_name, 0),
        *(("dataset source", name, 0) for name in mixture.local_files(values)),
    ]
    for flag, path, room in given:
        if path and not builtin.is_builtin(path):
            writes.check_path_limit(flag, path, room)


def check_model_path(model: str) -> None:
    """A model (or the analyzer's tokenizer) written as a local path is a folder there; a Hub name is `org/name`."""
    if data.looks_like_path(model) and not Path(model).expanduser().is_dir():
        if Path(model).expanduser().exists():  # a recipe or a tokenizer.json given for the folder: there, not one
            raise ConfigError(
                f"model path {model!r} is a file, not a folder: give the folder that holds the model's files "
                "(config.json, tokenizer.json), or a Hub name like org/model"
            )
        raise ConfigError(f"model folder {model!r} does not exist: check the path, or give a Hub name like org/model")


def check_model(model: str) -> None:
    """A `builtin:` name that exists, a local folder that holds a model: refused now, not when the model loads."""
    if builtin.is_builtin(model):
        builtin.check_name(model)
        return
    check_model_path(model)
    path = Path(model).expanduser()
    if not path.is_dir():
        return  # a Hub name
    adapter = path / "adapter_config.json"
    if adapter.is_file() and any((path / n).is_file() for n in WEIGHT_FILES):
        # A model with an adapter saved beside it (a repo that ships both): transformers' from_pretrained finds the
        # adapter_config.json and loads the adapter onto the model, which the run would then train with it
        raise ConfigError(
            f"model folder {model!r} holds a model and, beside it, a LoRA adapter (adapter_config.json), which "
            "transformers would load onto the model: move the adapter's files (adapter_config.json, adapter_model.*) "
            "to a folder of their own, or merge the adapter into the weights first (PEFT's merge_and_unload, then "
            "save_pretrained)"
        )
    if adapter.is_file():
        # TRL builds the model from the folder's config.json (create_model_from_path), which a LoRA run's folder lacks
        merged = path / "merged"  # a LoRA run's folder, saved with merge_lora: true (dpotrain/train/lora.py)
        raise model_identity.adapter_refusal(
            f"model folder {model!r}", adapter, merged if (merged / "config.json").is_file() else None
        )
    if not (path / "config.json").is_file():
        what = "is empty" if not any(path.iterdir()) else "holds no config.json"
        raise ConfigError(
            f"model folder {model!r} {what}: point model_name_or_path at the folder that "
            "save_pretrained wrote (config.json, weights, tokenizer), or give a Hub name like org/model"
        )
    check_shards(model)


def _weights_config(path: Path) -> dict | None:
    """The folder's config.json where this project checks the weights beside it; None where transformers says what is
    wrong itself: a config it cannot read, or one naming its own weights file (`transformers_weights`)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return None if not isinstance(config, dict) or config.get("transformers_weights") else config


def check_modules_cache(recipe: Recipe) -> None:
    """transformers imports a model's own code (`trust_remote_code`) from a copy it writes under HF_MODULES_CACHE
    (HF_HOME/modules): one it cannot write in ended the run in a traceback from transformers as the config loaded."""
    model = recipe.model
    if not recipe.training.trust_remote_code or not model_identity.own_code(
        model.model_name_or_path or "", model.model_revision
    ):
        return
    from transformers import dynamic_module_utils

    folder = Path(dynamic_module_utils.HF_MODULES_CACHE)
    if problem := writes.unwritable(folder):
        raise ConfigError(
            f"transformers' modules cache {folder} is not writable ({problem[1]} in {problem[0]}), and a model with "
            "its own code (trust_remote_code) is imported from a copy of that code written there: set "
            "HF_MODULES_CACHE (or HF_HOME) to a writable folder"
        )


def check_weights(model: str) -> None:
    """A model folder without its weights, or whose config names no class: refused before the model loads (after the
    first half, so that its refusals come first, as in a dry run; shards its index lists and lacks: `check_shards`)."""
    from dpotrain.data.lengths import check_tokenizer_folder

    path = Path(model).expanduser()
    if builtin.is_builtin(model) or not (path / "config.json").is_file():
        return
    check_tokenizer_folder(model)  # config.json alone (configs/models/*): a model's shape, said as such first
    if (config := _weights_config(path)) is None:
        return
    if not config.get("architectures"):
        # TRL loads the model by the class its config names (create_model_from_path: `config.architectures[0]`, a
        # TypeError without one); a config written by `config.save_pretrained` alone names none.
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        named = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"), "<ModelClass>ForCausalLM")
        raise ConfigError(
            f"model folder {model!r} has a config.json that names no architectures, which TRL loads the model by: "
            f'add "architectures": ["{named}"] to it (model.save_pretrained writes it)'
        )
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise ConfigError(
            f"model folder {model!r} holds a config.json but no weights (model.safetensors, pytorch_model.bin or a "
            "sharded index): copy the weights save_pretrained wrote beside it, or give a Hub name like org/model"
        )


def check_shards(model: str) -> None:
    """A model folder whose sharded index lists shards it lacks: refused among the first checks (`check_model`), the
    dry run's too, where the run would fail only as the weights load. A folder without weights is not refused here:
    a dry run plans from a config alone (configs/models/*), the run refuses it (`check_weights`)."""
    path = Path(model).expanduser()
    if _weights_config(path) is None:
        return
    found = next((name for name in WEIGHT_FILES if (path / name).is_file()), None)
    if found is None or not found.endswith(".index.json") or (shards := offline.shards_of(path / found)) is None:
        return  # transformers says what is wrong with an index it cannot read
    if absent := [shard for shard in shards if not (path / shard).is_file()]:
        raise ConfigError(
            f"model folder {model!r} lacks {len(absent)} of the {len(shards)} weight shards its {found} lists "
            f"({absent[0]}{', ...' if len(absent) > 1 else ''}): copy the missing shards into it"
        )


def check_generates(config, model: str) -> None:
    """TRL loads the class a config names (`architectures[0]`): a reward or base model failed once loaded."""
    from transformers.models.auto import modeling_auto as auto

    def classes(*mappings) -> set[str]:  # a mapping's value: a class name, or a tuple of them
        return {n for names in mappings for v in names.values() for n in ([v] if isinstance(v, str) else v)}

    named = (getattr(config, "architectures", None) or [None])[0]
    causal = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    other = classes(
        auto.MODEL_MAPPING_NAMES,
        auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
        auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
        auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
    )
    lm = causal.get(getattr(config, "model_type", None))
    causal_lm = f"a causal language model{f' ({lm})' if isinstance(lm, str) else ''}"
    if named in other - classes(causal):
        raise ConfigError(
            f"{model} is a {named} (architectures in its config.json), a model that does not generate text: DPO "
            f"trains {causal_lm}: give the model to train, e.g. your SFT model, not a reward or base model"
        )
    # An encoder-decoder (T5, BART) or a masked LM (BERT) loaded, then failed in the reference stage with a traceback
    # (`You must specify exactly one of input_ids or inputs_embeds`, no `generation_config`): TRL's DPOTrainer scores
    # each token from the tokens before it alone, in one decoder-only sequence.
    kind = None if named in classes(causal) else "an encoder-decoder" if config.is_encoder_decoder else None
    if named in classes(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES) - classes(causal):
        kind = "a masked language model"
    if kind:
        what = f"a {named} (architectures in its config.json)" if named else f"a {config.model_type} model"
        raise ConfigError(
            f"{model} is {what}, {kind}: DPO here trains {causal_lm}, which reads each token after the ones before it, "
            "as TRL's DPOTrainer scores them: give a decoder-only model (...ForCausalLM)"
        )


def check_backbone(config, model: str) -> None:
    """TRL's fused LM head (every log-prob the run takes) runs the model's `base_model` as its backbone: a causal LM
    whose base_model_prefix names none of its modules is its own base_model, and the reference stage failed on its
    output once the model had loaded (`AttributeError: ... no attribute 'last_hidden_state'`). Refused from the
    config: a class whose `__init__` does not show the module is built on the meta device to be sure."""
    import trl

    from dpotrain.plan import memory

    model_class = upstream.causal_lm_class(config)
    if model_class is None or upstream.sets_its_backbone(model_class):
        return
    built = memory.meta_model(config)
    if built.base_model is not built:
        return
    raise ConfigError(
        f"{model}: TRL {trl.__version__}'s DPOTrainer cannot train {model_class.__name__} (model_type "
        f"{config.model_type!r}): its fused LM head, which computes every log-prob, runs the model's base_model as "
        f"the backbone, and this class has none (no module named {model_class.base_model_prefix!r}, its "
        "base_model_prefix): train a model of another type, or install a TRL release that finds its backbone"
    )


def check_checkpointing(config, model: str, checkpointing: bool) -> None:
    """A causal-LM class that says it cannot checkpoint its activations (`supports_gradient_checkpointing`, JetMoE's)
    under activation_checkpointing, the recipes' setting: transformers refused it as the trainer was built, once the
    model had loaded. Refused before it loads: the switch off is the user's word, and the memory plan then plans it."""
    model_class = upstream.causal_lm_class(config)
    if not checkpointing or model_class is None or model_class.supports_gradient_checkpointing:
        return
    raise ConfigError(
        f"{model}: activation_checkpointing is on, and transformers cannot checkpoint {model_class.__name__} "
        f"(model_type {config.model_type!r}; the class says so): pass --activation_checkpointing false (a --dry-run's "
        "memory plan then says whether the activations fit)"
    )


def _dbrx_attention_unset(config, init_kwargs: dict | None, key: str) -> bool:
    """Whether `config` is DBRX's and its `attn_config` leaves `key` null (or out), with no value for it in
    model_init_kwargs' attn_config (transformers updates the keys given there, keeping the others)."""
    attention = getattr(config.get_text_config(), "attn_config", None)
    if config.model_type != "dbrx" or attention is None or getattr(attention, key, None) is not None:
        return False
    return ((init_kwargs or {}).get("attn_config") or {}).get(key) is None


def check_dbrx_rope(config, model: str, init_kwargs: dict | None) -> None:
    """DBRX whose `attn_config` has no `rope_theta` (a default DbrxConfig's has none): transformers 5.23 builds its
    rotary embedding from it, and the run stopped as the model loaded, in an AttributeError traceback
    ('DbrxAttentionConfig' object has no attribute 'rope_theta'). Refused from the config, before it loads, unless
    model_init_kwargs' attn_config gives one."""
    import transformers

    if not _dbrx_attention_unset(config, init_kwargs, "rope_theta"):
        return
    raise ConfigError(
        f"{model}: attn_config has no rope_theta in its config.json, and transformers {transformers.__version__} "
        "builds DBRX's rotary embedding from it (the load stops: 'DbrxAttentionConfig' object has no attribute "
        "'rope_theta'): set rope_theta in attn_config of its config.json to the base the model was trained with "
        "(DBRX's own: 500000)"
    )


def check_unbounded_clip(config, model: str, init_kwargs: dict | None) -> None:
    """DBRX with `attn_config.clip_qkv` null (DbrxConfig's default): transformers 5.23's DbrxAttention clamps its q/k/v
    between -clip_qkv and clip_qkv even where it is None, and torch refuses a clamp with neither bound: the run loaded
    the model and stopped at its first forward, in the reference stage. Refused from the config, before it loads,
    unless model_init_kwargs' attn_config gives a bound."""
    import transformers

    if not _dbrx_attention_unset(config, init_kwargs, "clip_qkv"):
        return
    raise ConfigError(
        f"{model}: attn_config.clip_qkv is null in its config.json, and transformers {transformers.__version__}'s "
        "DBRX attention clamps q, k and v by it even so, which stops the first forward (torch.clamp: At least one of "
        "'min' or 'max' must not be None): set clip_qkv in attn_config of its config.json to the bound the model was "
        "trained with (DBRX's own: 8), or to one no activation reaches (1e9) if it was trained unclipped"
    )


def check_router_loss(config, model: str, coefficient: float | None) -> None:
    """TRL adds the MoE router's load-balancing loss where the config has `output_router_logits` and the coefficient
    (the recipe's router_aux_loss_coef, else the config's) is not 0, from the router logits the model records: a model
    with no router in any layer (Doge's dense layers, `is_moe: false`; DeepSeek V4's hash-routed ones alone) records
    none, and the run loaded it and failed at its first step ('tuple index out of range'). Refused before it loads;
    so is a coefficient given for a model with no router loss at all (no `output_router_logits`: a dense model), which
    TRL refused in a traceback once the model had loaded."""
    from dpotrain.plan import memory

    if coefficient and not hasattr(config.get_text_config(), "output_router_logits"):
        raise ConfigError(
            f"{model}: router_aux_loss_coef {coefficient:g} weights a mixture of experts' router loss, and this "
            f"{config.model_type} model has none (its config has no output_router_logits): remove router_aux_loss_coef"
        )
    coefficient = packing.router_loss_coefficient(config, coefficient)
    if not coefficient:
        return
    built = memory.meta_model(config)
    router = upstream.router_class(built.base_model)
    if router is None or any(isinstance(module, router) for module in built.modules()):
        return
    raise ConfigError(
        f"{model}: TRL adds the router's load-balancing loss (router_aux_loss_coef {coefficient:g}; its config has "
        f"output_router_logits), and this {config.model_type} model has no router ({router.__name__}) in any layer, "
        "so the run would fail at its first step: pass --router_aux_loss_coef 0"
    )


def check_logging(recipe: Recipe) -> None:
    """The health guards judge logged steps: with logging_strategy no they would see step 1 alone, with epoch step 1
    and each epoch's end."""
    t = recipe.training
    if t.logging_strategy == "no" and recipe.project.health_checks:
        raise ConfigError(
            "logging_strategy no leaves the health guards (a NaN loss included), metrics.jsonl and W&B nothing past "
            "step 1: remove it (log less often with --logging_steps N), or turn the guards off with "
            "--health_checks false"
        )
    # transformers logs under `epoch` at each epoch's end alone (and step 1, the guards' own): a 1-epoch run, as the
    # recipes train, was judged only once every step had trained, a doomed run's hours spent
    if _named(t.logging_strategy) == "epoch" and recipe.project.health_checks:
        raise ConfigError(
            "logging_strategy epoch leaves the health guards (a NaN loss included) nothing to judge between step 1 and "
            "each epoch's end, after every step of it has trained: remove it (log less often with --logging_steps N), "
            "or turn the guards off with --health_checks false"
        )
    if "logging_first_step" in recipe.given and not t.logging_first_step and recipe.project.health_checks:
        raise ConfigError(
            "logging_first_step false: the health guards log step 1 on its own (its loss, before any update, shows "
            "whether the reference is the policy's): remove logging_first_step, or pass --health_checks false"
        )
    # logging_steps is read under `steps` only (transformers' DefaultFlowCallback): under `epoch` it was recorded and
    # metrics.jsonl, W&B and the curves had one point per epoch; a recipe file's is allowed where the command line
    # changes the strategy for one run (as save_steps in check_saving)
    if _named(t.logging_strategy) == "epoch" and "logging_steps" in given_beside(recipe, "logging_strategy"):
        raise ConfigError(f"logging_steps {t.logging_steps:g} {said('logging_steps')}")
    # transformers reads a value below 1 as a fraction of the run: a negative one misfired or divided by zero
    for name, strategy in (("logging_steps", t.logging_strategy), ("eval_steps", t.eval_strategy)):
        value = getattr(t, name)
        if strategy == "steps" and value is not None and value < 0:
            raise ConfigError(
                f"{name}={value:g} is below 0: give a number of steps (the recipes log every step) or a fraction of "
                "the run (0.1)"
            )
    if t.include_num_input_tokens_seen not in ("no", False, None):
        # transformers counts the micro-batch's `input_ids`, which this project's micro-batches (pairs) do not hold
        raise ConfigError(f"include_num_input_tokens_seen {NOT_DEFAULT['include_num_input_tokens_seen']}")
    # transformers builds the loggers after the model has loaded
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    for name in t.report_to or []:
        if "," in name and all(n.strip() in (*INTEGRATION_TO_CALLBACK, "none") for n in name.split(",")):
            raise ConfigError(  # transformers does not split it: "unknown report_to" listed names it already held
                f"report_to {name!r} names several in one word, and a run logs to one: give one of them "
                f"(--report_to {name.split(',')[0].strip()}; none turns logging off)"
            )
        if name not in INTEGRATION_TO_CALLBACK:
            raise ConfigError(
                f"unknown report_to {name!r}: choose from {', '.join(sorted(INTEGRATION_TO_CALLBACK))}, or none "
                "(the recipes log to wandb)"
            )
        if not reporting_available(name):
            raise ConfigError(
                f"report_to {name} needs its Python package, which is not installed here: install it, or remove {name} "
                "from report_to"
            )


def check_trackio_fields(recipe: Recipe) -> None:
    """transformers reads `project` and `trackio_*` for Trackio alone: beside another report_to, `--project my-dpo` was
    recorded while W&B logged to WANDB_PROJECT (else 'huggingface')."""
    from trl import DPOConfig

    t = recipe.training
    if "trackio" in (t.report_to or []):
        return
    defaults = {f.name: f.default for f in dataclasses.fields(DPOConfig) if f.name in TRACKIO_FIELDS}
    for name in TRACKIO_FIELDS:
        if (value := getattr(t, name)) == defaults[name]:
            continue
        reports = ", ".join(r for r in t.report_to or [] if r != "none") or "none"
        fix = f"remove {name}"
        if name == "project" and "wandb" in (t.report_to or []):
            reports += ", whose project is WANDB_PROJECT"
            fix = f"set WANDB_PROJECT={value} in .env (or the recipe's env:) and remove project"
        raise ConfigError(f"{name} {value!r} {said(name, reports=reports, fix=fix)}")


def reporting_available(name: str) -> bool:
    """Whether the logger `name` starts, as its callback checks: transformers' list of available integrations misses
    flyte, azure_ml beside mlflow and comet_ml without an API key, though their callbacks start."""
    from transformers.integrations import integration_utils as loggers

    checked_alone = {
        "azure_ml": loggers.is_azureml_available,
        "flyte": loggers.is_flytekit_available,
        "comet_ml": lambda: importlib.util.find_spec("comet_ml") is not None,
    }
    return checked_alone[name]() if name in checked_alone else name in loggers.get_available_reporting_integrations()


def check_optimizer(t) -> None:
    """The optimizer and scheduler the trainer builds once the model has loaded, built here on one parameter by
    transformers' own calls. weight_decay too: torch checks it in the constructor, not in a parameter group."""
    if t.weight_decay < 0:
        raise ConfigError(
            f"weight_decay must be >= 0 (got {t.weight_decay:g}): a negative one grows the weights at every step "
            "instead of decaying them; 0 turns it off (the recipes use 0.0)"
        )
    _check_optim_args_form(t.optim_args)
    import torch
    from transformers import Trainer, get_scheduler

    try:
        optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(t)
    except Exception as e:  # noqa: BLE001 - else one transformers builds only with the model (GaLore's target modules)
        if isinstance(e, ImportError) or (isinstance(e, ValueError) and re.search(r"install|import", str(e), re.I)):
            raise ConfigError(
                f"optim {_named(t.optim)} needs a package that is not installed here ({errors.cause(e)}): "
                "install it, or choose another optim (the recipes use adamw_torch_fused)"
            ) from None
        return  # the trainer decides
    ignored = _ignored_optim_args(t) if t.optim_args else []
    if ignored:
        # transformers passes optim_args to some optimizers only (not AdamW)
        adam = (
            " (adam_beta1, adam_beta2, adam_epsilon and weight_decay set AdamW's)" if "adam" in _named(t.optim) else ""
        )
        if len(ignored) < len(_optim_arg_keys(t.optim_args)):
            them = "it" if len(ignored) == 1 else "them"
            keys = ", ".join(ignored)
            named = {"value": repr(t.optim_args), "keys": keys, "optim": _named(t.optim), "them": them}
            raise ConfigError(f"optim_args {said('optim_args_keys', **named)}")
        raise ConfigError(f"optim_args {t.optim_args!r} {said('optim_args', optim=_named(t.optim), adam=adam)}")
    # How it runs (fused, foreach kernels) is the device's: this one parameter is on the CPU
    kwargs = {k: v for k, v in kwargs.items() if k not in ("fused", "foreach", "capturable")}
    if kwargs.get("eps") == 0 == t.adam_epsilon:  # torch takes 0: NaN weights after step 1, after the reference stage
        raise ConfigError(
            f"adam_epsilon must be > 0 (got 0): optim {_named(t.optim)} divides each update by sqrt(its running "
            "squared gradient) + adam_epsilon, so a parameter whose gradient is 0 at a step (an embedding row of a "
            "token no pair of the step holds; a LoRA adapter's A matrix at step 1) would be updated by 0 / 0 = NaN: "
            "give a positive one (the recipes keep 1e-8)"
        )
    try:
        optimizer = optimizer_cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
    except ValueError as e:
        raise ConfigError(
            f"optim {_named(t.optim)} refuses the recipe's settings ({e}): give adam_beta1 and adam_beta2 in [0, 1), "
            "adam_epsilon > 0 (the recipes keep the defaults 0.9, 0.999, 1e-8), and optim_args it takes"
        ) from None
    except Exception:  # noqa: BLE001 - one that needs a GPU or the model to be built: the trainer decides
        return
    try:
        # One build for both checks, on the run `_check_schedule` walks; it refuses bad kwargs as it is built
        scheduler = get_scheduler(
            t.lr_scheduler_type,
            optimizer,
            num_warmup_steps=WALKED_WARMUP,
            num_training_steps=WALKED_STEPS,
            scheduler_specific_kwargs=t.lr_scheduler_kwargs or {},
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"lr_scheduler_type {_named(t.lr_scheduler_type)} cannot be built with lr_scheduler_kwargs "
            f"{t.lr_scheduler_kwargs or {}} ({e}): give the arguments it takes (transformers' get_scheduler)"
        ) from None
    multiplier = (getattr(scheduler, "lr_lambdas", None) or [None])[0]  # LambdaLR's; reduce_lr_on_plateau has none
    _check_schedule(t, multiplier)
    _check_warmup(t, multiplier)


# The Adam settings, each with a probe value and another for a recipe already at it
ADAM_SETTINGS = {"adam_beta1": (0.5, 0.6), "adam_beta2": (0.5, 0.6), "adam_epsilon": (1e-3, 1e-4)}


def check_adam_settings(recipe: Recipe) -> None:
    """transformers passes adam_beta1/adam_beta2/adam_epsilon to the Adam family alone (Lion: the betas): `--optim sgd
    --adam_beta1 0.5` was recorded and read by nothing. A setting whose change leaves the optimizer transformers builds
    as it was is refused; not a recipe file's where the command line changes the optim for one run."""
    t, given = recipe.training, given_beside(recipe, "optim")
    built = _built_with(t, t.optim_args)
    if built is None:  # one built only with the model (GaLore's target modules): the trainer decides
        return
    for name, probes in ADAM_SETTINGS.items():
        if name not in given:
            continue
        probe = probes[0] if getattr(t, name) != probes[0] else probes[1]
        with config.keep_end_unwarned():
            probed = dataclasses.replace(t, **{name: probe})
        if _built_with(probed, t.optim_args) == built:
            raise ConfigError(f"{name} {getattr(t, name):g} {said(name, optim=_named(t.optim), name=name)}")


def _check_warmup(t, multiplier) -> None:
    """transformers builds `constant` and `reduce_lr_on_plateau` without warm-up, while the record counts warmup_steps.
    A schedule that warms up starts below learning_rate (the walk's step 0)."""
    if not t.warmup_steps:
        return
    try:
        if multiplier is not None and float(multiplier(0)) < 1:
            return
    except Exception:  # noqa: BLE001 - kwargs the walk skips (they count steps): the trainer's own schedule decides
        return
    raise ConfigError(
        f"lr_scheduler_type {_named(t.lr_scheduler_type)} has no warm-up (transformers ignores warmup_steps for it), "
        f"but warmup_steps is {t.warmup_steps:g}: the run would start at the full learning rate while the dry run and "
        "the record counted warm-up steps: add --warmup_steps 0, or choose constant_with_warmup (a warm-up, then "
        "a constant rate)"
    )


# The run the schedule is walked over: 10% warm-up, read at each 1,000th; kwargs that count steps are not walked
WALKED_STEPS, WALKED_WARMUP, WALKED_POINTS = 1_000_000, 100_000, 1_000
COUNTS_STEPS = ("num_decay_steps", "num_stable_steps", "timescale")


def _check_schedule(t, multiplier) -> None:
    """The schedule's multiplier of learning_rate over a whole run: `lr_scheduler_kwargs` of the wrong type or value
    build, then fail or mislead after warm-up. It must stay in [0, 1], and not at 0 for a stretch before the end."""
    kwargs = t.lr_scheduler_kwargs or {}
    if multiplier is None or not isinstance(kwargs, dict) or set(kwargs) & set(COUNTS_STEPS):
        return
    values, problem = [], None
    for point in range(WALKED_POINTS + 1):
        try:
            values.append(float(multiplier(WALKED_STEPS * point // WALKED_POINTS)))
        except Exception as e:  # noqa: BLE001 - what the trainer's scheduler.step() would raise at that step
            problem = f"fails at {point / WALKED_POINTS:.0%} of the run ({type(e).__name__}: {e})"
            break
    past_warmup = WALKED_POINTS * WALKED_WARMUP // WALKED_STEPS + 1
    after = values[past_warmup:-1]  # past warm-up, before the last step
    if problem is None and not all(math.isfinite(v) and -1e-9 <= v <= 1 + 1e-9 for v in values):
        worst = max(values, key=lambda v: abs(v - 0.5) if math.isfinite(v) else math.inf)
        at = values.index(worst) / WALKED_POINTS
        problem = f"takes the learning rate to {worst:g} x learning_rate at {at:.0%} of the run"
    elif problem is None and any(a == b == 0 for a, b in zip(after, after[1:], strict=False)):
        first = past_warmup + after.index(0)
        problem = (
            f"keeps the learning rate at 0 from {first / WALKED_POINTS:.0%} of the run on (it trains nothing more)"
        )
    if problem:
        raise ConfigError(
            f"lr_scheduler_type {_named(t.lr_scheduler_type)} with lr_scheduler_kwargs {kwargs} {problem}: a "
            "schedule keeps it between 0 and learning_rate (its peak) until the end: give its arguments numbers in "
            "their range (transformers' get_scheduler), or remove lr_scheduler_kwargs"
        )


# Numbers the run fails on or misreads once the model has loaded: each field, its smallest value, what a smaller did
AT_LEAST = {
    "dataloader_num_workers": (
        0,
        "torch's DataLoader refuses it once the model has loaded; 0 reads in the main process",
    ),
    "dataloader_prefetch_factor": (
        1,
        "the batches each loader worker reads ahead (0: torch's AssertionError as training's loader starts, once the "
        "model had loaded; below 0, its ValueError there); unset, 2",
    ),
    "dataset_num_proc": (0, "datasets refuses it as the trainer tokenizes, once the model has loaded; 0: one process"),
    "pad_to_multiple_of": (1, "TRL's padding divides by it once the model has loaded (0: ZeroDivisionError)"),
    "save_total_limit": (1, "transformers takes 0 or below for no limit: remove it to keep every checkpoint"),
    "eval_accumulation_steps": (
        1,
        "transformers' evaluation moves its outputs to the CPU at the batches divisible by it (0: ZeroDivisionError "
        "at the first evaluation, after the model loaded and training began); unset, at the end",
    ),
    "per_device_eval_batch_size": (
        1,
        "the pairs of each process's evaluation batches (0: ZeroDivisionError at the first evaluation, after the model "
        "loaded and training began); the default is 8",
    ),
    "ref_model_sync_steps": (
        1,
        "TRL syncs the reference at the steps divisible by it (0: ZeroDivisionError at step 1)",
    ),
    "ddp_timeout": (
        1,
        "the seconds each process waits for the others at the start and in every collective (0: a launch of several "
        "failed as its processes met, 'The client socket has timed out after 0ms'); the default is 1800",
    ),
}


def check_ranges(recipe: Recipe) -> None:
    """Values a run accepted and could not honour (module doc); others are checked where their option is."""
    t, p = recipe.training, recipe.project
    for name, (least, why) in AT_LEAST.items():
        value = getattr(t, name)
        if value is not None and value < least:
            raise ConfigError(f"{name} must be >= {least} (got {value}): {why}")
    if p.gpu_peak_tflops is not None and p.gpu_peak_tflops <= 0:
        raise ConfigError(
            f"gpu_peak_tflops must be > 0 (got {p.gpu_peak_tflops:g}): the GPU's dense bf16 peak in TFLOP/s (an H100: "
            "989), or remove it for the peak of the GPU the run finds"
        )
    if "discopop" in losses.loss_types(t) and t.discopop_tau <= 0:  # TRL divides the logits by it: NaN at step 1
        raise ConfigError(f"discopop_tau must be > 0 (got {t.discopop_tau:g}): the DiscoPOP paper's is 0.05")
    # the reference moves alpha of the way to the policy at each sync: at 0 it never moved (plain DPO, as TR-DPO)
    if t.sync_ref_model and not 0 < t.ref_model_mixup_alpha <= 1:
        raise ConfigError(
            f"ref_model_mixup_alpha must be in (0, 1] (got {t.ref_model_mixup_alpha:g}): the share of the policy mixed "
            "into the reference at each sync (TR-DPO's is 0.6)"
        )


def _check_optim_args_form(optim_args: str | None) -> None:
    """transformers reads optim_args as `key=value,key=value` (spaces removed, split at each comma, then at `=`) when it
    builds the optimizer: another shape (`scale_parameter`, `betas=(0.9,0.99)`) ended the run in "ValueError: not enough
    values to unpack" there, after the reference stage."""
    parts = optim_args.replace(" ", "").split(",") if optim_args else []
    bad = next((part for part in parts if part.count("=") != 1 or part.startswith("=")), None)
    if bad is None:
        return
    if not bad:
        said = "an empty part (a comma too many)"
    elif "=" not in bad:
        said = f"{bad!r} has no '='"
    else:
        said = f"{bad!r} has {'more than one' if bad.count('=') > 1 else 'no name before its'} '='"
    raise ConfigError(
        f"optim_args {optim_args!r} is not transformers' key=value,key=value: {said} (a value cannot hold a comma or "
        'an =): write it as --optim_args "name=value,name2=value2"'
    )


def _ignored_optim_args(t) -> list[str]:
    """The keys of the recipe's optim_args that the optimizer does not read: at probe values (not the recipe's, which
    may be the default), transformers builds what it builds without the key."""
    without = _built_with(t, None)
    if without is None:  # built only with them: every key may be read
        return []
    probes = ("0.5", "True")  # a number, then a word: a key read by int(), float() or as a flag changes or fails
    return [
        key
        for key in _optim_arg_keys(t.optim_args)
        if all(_built_with(t, f"{key}={probe}") == without for probe in probes)
    ]


def _optim_arg_keys(optim_args: str) -> list[str]:
    """The names of `key=value,key=value` (transformers' spelling of optim_args; a malformed one it refuses itself)."""
    return [pair.split("=")[0] for pair in optim_args.replace(" ", "").split(",")]


def _built_with(t, optim_args: str | None) -> tuple | None:
    """The optimizer and its arguments transformers would build with these optim_args; None where it refuses them."""
    from transformers import Trainer

    try:
        with upstream.gpu_precision_checks_skipped(), config.keep_end_unwarned():  # checked as the recipe was parsed
            return Trainer.get_optimizer_cls_and_kwargs(dataclasses.replace(t, optim_args=optim_args))
    except Exception:  # noqa: BLE001 - a value it parses and refuses: the key is read
        return None


def given_beside(recipe: Recipe, switch: str) -> set[str]:
    """The fields given, as a check of a field that `switch` makes ignored reads them: the command line's alone where
    it changes `switch` for one run (a recipe file's value, written for the recipe's own switch, is then allowed)."""
    on_command_line = config.fields_set(recipe.command_line)
    return on_command_line if switch in on_command_line else recipe.given


def _named(choice) -> str:
    """A choice as the recipe spells it: transformers keeps optim and lr_scheduler_type as enums."""
    return getattr(choice, "value", choice)


# Far past any model's positions: a longer max_length is a typo's extra digits, and past 2**63 the analyzer's numpy
# counts failed in a traceback (OverflowError) once every pair had been tokenized.
LONGEST_MAX_LENGTH = 2**40


def check_max_length(t) -> None:
    """Training's and the analyzer's (its --max_length, or the recipe's) refusal of a length that holds no token, or
    one no model takes."""
    if t.max_length is not None and t.max_length < 1:
        raise ConfigError(f"max_length must be >= 1 (got {t.max_length}), or `auto` to let the analyzer choose")
    if t.max_length is not None and t.max_length > LONGEST_MAX_LENGTH:
        raise ConfigError(too_long("max_length", t.max_length))


def too_long(what: str, value: int) -> str:
    return f"{what} {value} is longer than any model takes: give a length in tokens (e.g. 16384), or `auto`"


def check_cuda_settings(recipe: Recipe) -> None:
    """Settings that need a CUDA GPU, refused for a run without one (not a dry run, which plans a GPU job from a login
    node): fp16 would train in fp32 while the record says fp16; TRL's activation offloading moves activations on CUDA
    streams, and the trainer stopped in a traceback ("CUDA driver version is insufficient") after the model loaded."""
    import torch

    t = recipe.training
    if not t.use_cpu and (recipe.project.dry_run or torch.cuda.is_available()):
        return
    if t.fp16:
        raise ConfigError(
            "fp16 needs a CUDA GPU and this run has none (fp16 would not be applied: it would train in "
            "fp32): pass --fp16 false, or run on a GPU"
        )
    if t.activation_offloading:
        raise ConfigError(
            "activation_offloading needs a CUDA GPU (TRL moves the activations to CPU memory on CUDA streams) and "
            "this run has none: pass --activation_offloading false, or run on a GPU"
        )


def check_init_kwargs(recipe: Recipe) -> None:
    """The run would load other than it planned and recorded, or record a token (whose value is never printed)."""
    kwargs = recipe.training.model_init_kwargs or {}
    for key in [k for k in SECRET_INIT_KWARGS if k in kwargs]:
        raise ConfigError(f"model_init_kwargs {said('init_secret', key=key)}")
    for key, field in DECIDED_INIT_KWARGS.items():
        if key in kwargs:
            raise ConfigError(f"model_init_kwargs {said('init_decided', key=key, field=field, value=kwargs[key])}")


def check_init_kwargs_apply(recipe: Recipe, config=None) -> None:
    """A model_init_kwargs key that from_pretrained neither takes nor finds on the model's config is passed on to the
    model's __init__: transformers 5 moved `rope_theta` into `rope_parameters`, and `{"rope_theta": 100.0}` ended in a
    TypeError at the model's load, after the data was prepared. Refused from the config alone (`config`, else read
    from this machine's files: a Hub model not cached is checked once the run reads its config, `stages.first_half`)."""
    kwargs = recipe.training.model_init_kwargs or {}
    unknown = [key for key in kwargs if key not in init_kwargs.from_pretrained_arguments()]
    if unknown and config is None:
        from dpotrain.plan import memory

        config = memory.model_config_or_reason(recipe)[0]  # None where not readable here: the load decides
    takes = _model_takes(config) if unknown and config is not None else None
    for key in [k for k in unknown if takes is not None and not hasattr(config, k) and not takes(k)]:
        raise ConfigError(init_kwargs.not_taken(key, kwargs[key], config))


def _model_takes(config):
    """Whether the model's class (the one TRL loads: its config's architecture; a built-in model's config, not yet
    saved, names none: its causal LM's) takes a keyword in its __init__; None where that class is not transformers'
    own (remote code) or takes any (**kwargs): nothing is refused then."""
    import inspect

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    named = getattr(config, "architectures", None) or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, "")]
    model_class = getattr(transformers, named[0], None)
    if model_class is None:
        return None
    parameters = inspect.signature(model_class.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return None
    return lambda key: key in parameters


def _wandb_online(recipe: Recipe) -> bool:
    """The run logs to W&B's server: report_to wandb, and WANDB_MODE not one that stays off it."""
    offline = os.environ.get("WANDB_MODE", "").lower() in WANDB_OFFLINE_MODES
    return "wandb" in (recipe.training.report_to or []) and not offline


def _wandb_host() -> str:
    """The W&B server a run logs to, as wandb resolves it: WANDB_BASE_URL, else `wandb login --host`'s, else wandb's
    default (api.forge.coreweave.com in the wandb of requirements.txt, where `wandb login` writes ~/.netrc's key)."""
    if url := os.environ.get("WANDB_BASE_URL"):
        return url
    try:
        from wandb.sdk.lib import settings_file, urls

        stored = Path(os.environ.get("WANDB_CONFIG_DIR") or "~/.config/wandb").expanduser() / "settings"
        kept = settings_file.SettingsFiles(global_settings=stored, local_settings=stored).all().get("base_url")
        return kept or str(urls.DEFAULT_BASE_URL)
    except (ImportError, AttributeError):  # wandb's internals moved (a bad settings file: wandb warns, reads none)
        return "https://api.wandb.ai"


def check_wandb_variables(recipe: Recipe) -> None:
    """The W&B variables that recipe and environment alone settle: a run checks them in train_dpo.py before its ranks
    meet, so that a refusal is written once, not by every rank."""
    if "wandb" not in (recipe.training.report_to or []):
        return
    # WANDB_NAME: transformers' WandbCallback passes run_name to wandb.init as the run's name, which wins over the
    # variable, so the W&B run was named otherwise than asked, and nothing said so
    run_name, name = recipe.training.run_name, os.environ.get("WANDB_NAME", "")
    if name.strip() and name != run_name:
        raise ConfigError(
            f"WANDB_NAME {name!r} is not used: the W&B run is named after run_name ({run_name!r}): pass --run_name "
            f"{shlex.quote(name)} (which also names the default output_dir and hub_model_id) and unset WANDB_NAME"
        )
    # A WANDB_RESUME wandb does not take (`true`, which older guides give) ended the run with wandb's two-line pydantic
    # error once W&B started, after the model loaded and the reference was scored
    if (value := os.environ.get("WANDB_RESUME")) is not None and value not in WANDB_RESUME_VALUES:
        raise ConfigError(
            f"WANDB_RESUME {value!r} is not one wandb takes ({', '.join(WANDB_RESUME_VALUES)}): unset WANDB_RESUME "
            "(the run logs on to its output folder's W&B run by itself)"
        )
    check_wandb_run_id(run_id := os.environ.get("WANDB_RUN_ID", "").strip())  # stripped, as setup_wandb takes it
    from dpotrain.train.tracking import RUN_ID_FILE  # (no W&B import: the dry run's modules stay few)

    # Else the folder's id, which setup_wandb takes (not where --overwrite_output_dir removes it): one edited or damaged
    # between attempts (a W&B path `team/project/id` pasted in) ended the resume in wandb's traceback once W&B started
    id_file = Path(recipe.training.output_dir) / RUN_ID_FILE
    if not run_id and not recipe.project.overwrite_output_dir and writes.is_file(id_file):
        check_wandb_run_id(id_file.read_text(errors="replace").strip(), id_file)
    check_wandb_dir(os.environ.get("WANDB_DIR", ""))
    check_wandb_settings()


def check_wandb_run_replaced(recipe: Recipe) -> None:
    """A run that replaces the one in its folder (--overwrite_output_dir) under a WANDB_RUN_ID naming that run's W&B run
    (the folder's record of it): it logged into that run again (WANDB_RESUME allow) from step 1, and W&B keeps a run's
    steps in order, dropping every row at or below its last one, so the new run's curves were lost without a word
    (online at once; offline once synced). Without the variable the new run gets a W&B run of its own."""
    from dpotrain.train.tracking import RUN_ID_FILE  # (no W&B import: the dry run's modules stay few)

    run_id = os.environ.get("WANDB_RUN_ID", "").strip()
    logged = "wandb" in (recipe.training.report_to or []) and os.environ.get("WANDB_MODE", "").lower() != "disabled"
    if not logged or not run_id:
        return
    id_file = Path(recipe.training.output_dir) / RUN_ID_FILE
    if writes.is_file(id_file) and id_file.read_text(errors="replace").strip() == run_id:
        raise ConfigError(
            f"WANDB_RUN_ID {run_id!r} is the W&B run of the run --overwrite_output_dir replaces ({id_file}), whose "
            "steps W&B keeps over this run's from step 1 on, dropping them: unset WANDB_RUN_ID (a new W&B run) or "
            "set a new one"
        )


def check_wandb_settings() -> None:
    """Every WANDB_* variable wandb reads into its settings, asked of wandb's own check as wandb.init reads them: a
    value it refuses (WANDB_MODE=Offline, WANDB_CONSOLE=bogus, WANDB_HTTP_TIMEOUT=30s) ended the run in a pydantic
    traceback once W&B started, after the model loaded and the reference was scored (or, beside WANDB_MODE=offline,
    in "No API key configured": the mode was never read). A secret's value is never quoted."""
    import wandb

    for name, value in sorted(os.environ.items()):
        if not name.startswith("WANDB_") or name in WANDB_CHECKED_APART:
            continue
        try:
            wandb.Settings().update_from_env_vars({name: value})
        except (wandb.errors.UsageError, ValueError) as e:
            if venv.is_secret_name(name):
                said = "(its value not shown: a secret) is not a value W&B takes"
            else:
                field = str(e).splitlines()
                why = f"{field[1].strip()}: {field[2].split(' [type=')[0].strip()}" if len(field) > 2 else field[0]
                said = f"{value!r} is not a value W&B takes ({why})"
            raise ConfigError(f"{name} {said}: set it as wandb's documentation gives it, or unset {name}") from None


def check_wandb_run_id(run_id: str, recorded_in: Path | None = None) -> None:
    """A WANDB_RUN_ID wandb refuses (`exp/1`: characters it reserves) ended the run in wandb's UsageError traceback
    once W&B started, after the model loaded and the reference was scored; and the folder kept it, so the rerun without
    the variable failed the same way. Asked of wandb's own check (wandb.Settings), not a copy of its rule."""
    if not run_id:
        return
    import wandb

    try:
        wandb.Settings(run_id=run_id)
    except (wandb.errors.UsageError, ValueError) as e:
        if recorded_in:  # the output folder's record of its W&B run
            raise ConfigError(
                f"{recorded_in} holds {run_id!r}, not an id W&B takes ({e}): write the W&B run's id alone there (the "
                "last part of its URL), or delete the file to log to a new W&B run"
            ) from None
        raise ConfigError(
            f"WANDB_RUN_ID {run_id!r} is not an id W&B takes ({e}): set another, or unset WANDB_RUN_ID (the run logs "
            "on to its output folder's W&B run by itself)"
        ) from None


def check_wandb_dir(folder: str) -> None:
    """A WANDB_DIR W&B cannot write in: wandb warned once W&B started (after the model loaded and the reference was
    scored) and wrote the run's files to the system's temporary folder instead, a node's local /tmp on a cluster,
    gone with the job: offline runs never synced were lost. None set: the output folder (tracking.setup_wandb)."""
    if not folder.strip() or os.environ.get("WANDB_MODE", "").lower() == "disabled":  # disabled: W&B writes nothing
        return
    if problem := writes.unwritable(folder):
        import tempfile

        raise ConfigError(
            f"WANDB_DIR {folder} is not writable ({problem[1]} in {problem[0]}), and W&B would write this run's files "
            f"to {tempfile.gettempdir()} instead: set WANDB_DIR to a writable folder, or unset it (W&B's files then "
            "go in the output folder)"
        )


def check_wandb_folder(recipe: Recipe) -> None:
    """report_to wandb: the folder wandb writes in (`tracking.files_folder`), where there is one, writable by this job.
    One made another user's (a restore, `chown -R`) failed as wandb started, after the model loaded and the reference
    stage scored every pair. Every rank alike (`check_wandb`): the folder is the one the main process logs in."""
    from dpotrain.train import tracking

    if "wandb" not in (recipe.training.report_to or []) or os.environ.get("WANDB_MODE", "").lower() == "disabled":
        return
    folder = tracking.files_folder(recipe.training.output_dir)
    if writes.is_dir(folder) and (problem := writes.unwritable(folder)):
        raise ConfigError(
            f"report_to wandb: wandb writes its files in {folder}, and this job cannot write there ({problem[1]} in "
            f"{problem[0]}): make it writable (chmod -R u+w {shlex.quote(str(folder))}, or ask its owner), or pass "
            "--report_to none"
        )


def check_wandb(recipe: Recipe) -> None:
    """report_to wandb without a way to log in fails after the model loaded (wandb.errors.UsageError): say so now."""
    check_wandb_variables(recipe)  # again for a dry run, which lists them with its other refusals
    check_wandb_folder(recipe)
    # Older guides' switch, read by neither transformers 5 nor wandb
    disabled = os.environ.get("WANDB_DISABLED", "").lower() in ("true", "1", "yes", "on")
    if disabled and _wandb_online(recipe):
        raise ConfigError(
            f"WANDB_DISABLED={os.environ['WANDB_DISABLED']} is read by neither transformers nor wandb any more: set "
            "WANDB_MODE=disabled, or pass --report_to none"
        )
    # WANDB_IDENTITY_TOKEN_FILE: a login by workload identity, which wandb reads instead of a key
    # A blank key (`WANDB_API_KEY=" "`) is no login: wandb.init asks for one after the model loaded
    key = os.environ.get("WANDB_API_KEY", "").strip()
    if _wandb_online(recipe) and key:
        check_wandb_key(os.environ["WANDB_API_KEY"])  # as wandb reads it, unstripped
    if not _wandb_online(recipe) or key or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    try:
        from wandb.errors import AuthenticationError
        from wandb.sdk.lib.wbauth.wbnetrc import read_netrc_auth
    except ImportError:  # wandb's internals moved: let wandb itself decide
        return
    host = _wandb_host()
    try:
        if read_netrc_auth(host=host):
            return  # `wandb login` wrote ~/.netrc
    except AuthenticationError as e:  # a key wandb.init refuses the same way, after the model loaded
        raise ConfigError(
            f"report_to wandb, but wandb refuses the W&B key in ~/.netrc (or $NETRC's file) for {host} ({e}): run "
            "`wandb login --relogin`, add WANDB_API_KEY=... to .env, or pass --report_to none"
        ) from None
    except ValueError as e:  # wandb.init refuses the server address too (wbauth.HostUrl)
        raise _host_refused(e) from None
    raise ConfigError(
        "report_to wandb but no W&B login: add WANDB_API_KEY=... to .env, run `wandb login`, set "
        f"WANDB_MODE=offline (sync later with `wandb sync`), or pass --report_to none{venv.hidden('WANDB_API_KEY')}"
    )


def _host_refused(e: ValueError) -> ConfigError:
    return ConfigError(
        f"report_to wandb, but wandb refuses its server address ({e}): fix WANDB_BASE_URL (or `wandb login --host`'s), "
        "or pass --report_to none"
    )


def check_wandb_key(key: str) -> None:
    """A WANDB_API_KEY that wandb refuses by its form (a key pasted short, a quote of the .env line left in it), or one
    set beside WANDB_IDENTITY_TOKEN_FILE: any value passed as a login, and wandb.init raised AuthenticationError in a
    traceback once W&B started, after the model loaded and the reference was scored. Asked of wandb's own check of a
    key's form (no request); the key is never quoted."""
    where = f"in {env_file}" if (env_file := venv.env_file_gave("WANDB_API_KEY")) else "in the environment"
    if os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        raise ConfigError(
            f"report_to wandb, but both WANDB_API_KEY ({where}) and WANDB_IDENTITY_TOKEN_FILE are set, which wandb "
            "refuses: unset one of them, or pass --report_to none"
        )
    try:
        from wandb.errors import AuthenticationError
        from wandb.sdk.lib.wbauth import AuthApiKey
    except ImportError:  # wandb's internals moved: let wandb itself decide
        return
    try:
        AuthApiKey(host=_wandb_host(), api_key=key)
    except AuthenticationError as e:  # its text names the form, never the key
        raise ConfigError(
            f"report_to wandb, but wandb refuses the W&B key in WANDB_API_KEY ({where}: {e}): set it to the key "
            "alone, as https://wandb.ai/authorize shows it, or pass --report_to none"
        ) from None
    except ValueError as e:  # wandb.init refuses the server address too (wbauth.HostUrl)
        raise _host_refused(e) from None


def check_wandb_reachable(recipe: Recipe) -> None:
    """report_to wandb, online: W&B's server must answer now, within seconds (wandb.init retries for minutes). One HEAD
    request through wandb's proxy settings; any HTTP status is an answer."""
    if not _wandb_online(recipe):
        return
    url = _wandb_host().rstrip("/")
    try:
        head = urllib.request.Request(url, method="HEAD")  # a bad WANDB_BASE_URL: refused here, named below
        offline.within(
            offline.PROBE_SECONDS, lambda: urllib.request.urlopen(head, timeout=offline.SOCKET_SECONDS).close()
        )
    except urllib.error.HTTPError:
        return  # the server answered
    except Exception as e:  # noqa: BLE001 - no route, DNS, TLS, a bad WANDB_BASE_URL: named in the one line
        reason = getattr(e, "reason", None) or e
        raise ConfigError(
            f"report_to wandb, and W&B does not answer here ({url}: {reason}): set WANDB_MODE=offline to log to files "
            "(sync them later with `wandb sync`), fix WANDB_BASE_URL / HTTPS_PROXY, or pass --report_to none"
        ) from None
