"""Weights that lack some of the model's tensors, which transformers starts at random and goes on: refused as the model
loads (`trainer.whole_weights_only`) and, from the names in the weights' files alone, by the dry run (`check`)."""

import copy
import json
import os
from pathlib import Path

import torch
import transformers
from huggingface_hub import try_to_load_from_cache
from safetensors import SafetensorError, safe_open
from transformers.utils import logging as hf_logging

from dpotrain.cluster.offline import is_hub_model, shards_of
from dpotrain.recipe import init_kwargs, upstream
from dpotrain.recipe.errors import ConfigError
from dpotrain.recipe.writes import quiet_progress_bars

# The weights from_pretrained reads from a local folder, in its order (transformers.modeling_utils)
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# The safetensors ones: `.bin` weights are not read here (their names are in the pickle: reading them is loading them)
SAFETENSORS = WEIGHT_FILES[:2]


def refusal(
    model_id: str, model, info: dict, zero3: bool = False, revision: str | None = None, overrides: dict | None = None
) -> ConfigError | None:
    """The refusal of weights that lack some of `model`'s tensors, as transformers' loading `info` names them (its
    unexpected keys: theirs the model has no place for); None where they lack none. `zero3`: the load was
    transformers' ZeRO-3 one, whose own conversion of a checkpoint's names may lose tensors the files hold.
    `overrides`: the config fields model_init_kwargs set (`config_fields`), named where they made the tensors."""
    missing, unused = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    if not missing:
        return None
    if (overrides or {}).get("tie_word_embeddings") is False and set(missing) <= _output_head(model):
        return ConfigError(
            f"model_init_kwargs tie_word_embeddings false unties the output layer of {model_id} from its input "
            f"embeddings, but its weights hold no {missing[0]} (a tied model's weights hold the input embeddings "
            "alone): transformers would start it at random. Leave tie_word_embeddings out of model_init_kwargs (a "
            f"model saved tied trains tied), or save an untied copy first ({missing[0]} a copy of its input "
            "embeddings, tie_word_embeddings false in its config.json)"
        )
    total = len(model.state_dict())  # only for the refusal: every load passes here
    lacking = f"{len(missing):,} of the model's {total:,} tensors ({missing[0]}{', ...' if len(missing) > 1 else ''})"
    # transformers' ZeRO-3 path (integrations/deepspeed.py) renames every name a model's checkpoint conversion matches,
    # even one already the model's own: DeepSeek V4's `model.norm.weight` became `model.kv_norm.weight`
    if zero3 and set(missing) <= set(_shapes(model_id, revision) or ()):
        return ConfigError(
            f"under DeepSpeed ZeRO-3, transformers' load of {model_id} leaves out {lacking}, which its files hold "
            "under these names (its ZeRO-3 load renames them) and which it would start at random: train under "
            "ZeRO-2 (accelerate_config.yaml), whose load reads them"
        )
    held = f"; they hold {len(unused):,} the model has no place for ({unused[0]}, ...)" if unused else ""
    keys = ", ".join(sorted(overrides or ()))
    changed = f"model_init_kwargs sets {keys} of its config: leave out a key that adds tensors, " if keys else ""
    return ConfigError(
        f"the weights of {model_id} lack {lacking}, which transformers would start at random{held}: {changed}"
        "save the model with save_pretrained (a state dict saved from a wrapped model, DDP's or PEFT's, names "
        "its tensors with a prefix such as 'module.'), or copy in the missing weights"
    )


def _output_head(model) -> set[str]:
    """The names of the model's output layer's parameters (lm_head.weight), none where it has no such layer."""
    head = model.get_output_embeddings()
    if head is None:
        return set()
    own = {id(p) for p in head.parameters()}
    return {name for name, p in model.named_parameters(remove_duplicate=False) if id(p) in own}


def config_fields(kwargs: dict | None) -> dict:
    """The model_init_kwargs that set fields of the model's config (`tie_word_embeddings`, `num_hidden_layers`): the
    config overrides that are no argument of from_pretrained (`quantization_config`, `key_mapping`)."""
    named = init_kwargs.from_pretrained_arguments() | {"architecture"}  # TRL's create_model_from_path's own
    return {k: v for k, v in init_kwargs.config_overrides(kwargs).items() if k not in named}


def check(recipe, model_path: str, config) -> None:
    """The dry run's `refusal`, without loading a weight: transformers' own `from_pretrained` of the class TRL loads
    (`config.architectures[0]`), given the weights' names and shapes from their safetensors headers as meta tensors,
    so that its renames (a checkpoint's older layout, the base model's prefix), tied weights and keys it ignores apply
    as when the run loads the files. Skipped where the names are not read cheaply or the load is not the run's:
    `.bin` weights, a Hub model not in the cache (nothing is downloaded), no config here, a class outside
    transformers (remote code), a pre-quantized checkpoint, a config naming its own weight files, model_init_kwargs
    that are no field of the config (a quantization, a key_mapping: another load), a load that fails (a tensor of
    another shape: the run's load says it). Those that are (tie_word_embeddings) are set on the config, as the run's
    from_pretrained sets them."""
    architecture = getattr(transformers, (getattr(config, "architectures", None) or [""])[0] or "", None)  # TRL's
    own_files = getattr(config, "transformers_weights", None) or getattr(type(config), "extra_files", ())
    overrides = config_fields(recipe.training.model_init_kwargs)
    other_load = init_kwargs.config_overrides(recipe.training.model_init_kwargs).keys() - overrides.keys()
    if architecture is None or own_files or other_load or hasattr(config, "quantization_config"):
        return
    if overrides:
        config = copy.deepcopy(config)
        for key, value in overrides.items():
            setattr(config, key, value)
    shapes = _shapes(model_path, recipe.model.model_revision)
    if shapes is None:
        return
    state_dict = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its table of the keys missing: the refusal names them
    try:
        # a given state_dict is loaded as the files' tensors are (upstream.STATE_DICT_AS_FILES)
        with upstream.without_zero3_init(), quiet_progress_bars():
            model, info = architecture.from_pretrained(
                None, config=config, state_dict=state_dict, device_map="meta", output_loading_info=True
            )
    except Exception:  # noqa: BLE001 - a load the names alone do not mirror is left to the run's, which says why
        return
    finally:
        hf_logging.set_verbosity(verbosity)
    refused = refusal(model_path, model, info, overrides=overrides)
    if refused is not None:
        raise refused


def _shapes(model: str, revision: str | None) -> dict | None:
    """Each tensor's name and shape in the safetensors weights from_pretrained reads (a local folder's, or a Hub
    model's where its files are all cached), from the files' headers; None where they cannot be read so."""

    def found(filename: str) -> str | None:
        if os.path.isdir(model):
            path = os.path.join(model, filename)
            return path if os.path.isfile(path) else None
        try:
            path = try_to_load_from_cache(model, filename, revision=revision) if is_hub_model(model) else None
        except ValueError:  # not a repo id the Hub takes: the run's load says so
            return None
        return path if isinstance(path, str) else None

    files = [found(SAFETENSORS[0])]
    if files[0] is None and (index := found(SAFETENSORS[1])) is not None:
        if (shards := shards_of(Path(index))) is None:
            return None  # an index transformers cannot read either: its load says what is wrong
        files = [found(shard) for shard in shards]
    if not files or None in files:
        return None
    shapes = {}
    try:
        for path in files:
            with safe_open(path, framework="pt") as weights:
                shapes |= {name: weights.get_slice(name).get_shape() for name in weights.keys()}
    except (OSError, SafetensorError):
        return None
    return shapes


def check_whole(model_path: str) -> None:
    """Refuses a local model's safetensors file shorter than its header says (a copy or a download stopped midway):
    transformers' load failed on it in a traceback, `SafetensorError: ... incomplete metadata`, after the data stages,
    and the dry run said nothing. Only the headers are read (8 bytes of length, then JSON of each tensor's bytes)."""
    folder = Path(model_path)
    if not folder.is_dir():
        return  # a Hub model: its download checks what it fetched
    files = [folder / name for name in (SAFETENSORS[0], "adapter_model.safetensors") if (folder / name).is_file()]
    if not files and (folder / SAFETENSORS[1]).is_file():  # sharded: every shard its index names
        files = [folder / shard for shard in shards_of(folder / SAFETENSORS[1]) or () if (folder / shard).is_file()]
    for path in files:
        if why := not_whole(path):
            raise ConfigError(f"the model's weights file {path} {why}")


# The largest header safetensors reads (its MAX_HEADER_SIZE): a longer one is no safetensors file
MAX_HEADER = 100_000_000


# How `not_whole` begins its words for a file whose header says it is longer than it is (a copy stopped midway)
CUT_SHORT = "is cut short:"


def not_whole(path: Path, again: str = "copy it again from where the model came from") -> str | None:
    """What is wrong with a safetensors file from its header and what to do (`again`: how to get it whole), or None:
    cut short (CUT_SHORT), or not safetensors."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        start = f.read(8)
        length = int.from_bytes(start, "little")
        if start.startswith(b"version "):  # a Git LFS pointer ("version https://git-lfs...") cloned without LFS
            return "is a Git LFS pointer, not the weights (cloned without git-lfs): run `git lfs pull` in its folder"
        if len(start) < 8 or length > MAX_HEADER:
            return f"is cut short or not safetensors ({size:,} bytes, without a safetensors header): {again}"
        if 8 + length > size:
            return f"{CUT_SHORT} it has {size:,} bytes, fewer than its header alone ({8 + length:,}): {again}"
        try:
            header = json.loads(f.read(length))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return f"is not a safetensors file (its header is not the JSON safetensors writes): {again}"
    if size < 8 + length + end:
        return f"{CUT_SHORT} it has {size:,} bytes, and its header says {8 + length + end:,} (a copy stopped): {again}"
    return None
