"""What the keys of `model_init_kwargs` (the arguments given to `from_pretrained`) are to the run: decided by it,
secret, only how the files are read, an override of the model's config, or none of these (refused). Read by the checks
(options.py), the resume comparison (resolve.py) and the reference cache's key (reference.py)."""

import json

from dpotrain.recipe.errors import closest

# model_init_kwargs keys the run decides from its own fields, plans by and records: they would win at load time
DECIDED_INIT_KWARGS = {
    "dtype": "dtype",
    "torch_dtype": "dtype",
    "attn_implementation": "attn_implementation",
    "revision": "model_revision",
}


# model_init_kwargs keys that say how from_pretrained reads the files, not what model it builds: every other key is a
# config override (`rms_norm_eps`, `attention_dropout`) or a quantization, another model than the checkpoint's steps'
LOAD_ONLY_INIT_KWARGS = {"low_cpu_mem_usage", "device_map", "max_memory", "offload_folder", "cache_dir", "token"}


def config_overrides(kwargs: dict | None) -> dict:
    """The model_init_kwargs that build another model from the same files (a config override such as `rms_norm_eps`):
    all but the keys the run decides and records as its own fields, and those that only say how the files are read."""
    skip = DECIDED_INIT_KWARGS.keys() | LOAD_ONLY_INIT_KWARGS
    return {k: v for k, v in (kwargs or {}).items() if k not in skip}


# model_init_kwargs keys that hold a secret: the run records model_init_kwargs as given (resolved_config.json, the
# checkpoints' training_args.bin), where transformers hides only the `*_token` fields of its own arguments
SECRET_INIT_KWARGS = ("token", "use_auth_token")


# The arguments of from_pretrained itself in transformers 5 (the model's, the Auto classes' and the config's, named or
# taken from its **kwargs): every other key must be a field of the model's config, or from_pretrained passes it on to
# the model's __init__, which takes none (`from_pretrained_arguments` adds the installed release's named ones)
FROM_PRETRAINED_KWARGS = frozenset(
    """config cache_dir ignore_mismatched_sizes force_download local_files_only token revision use_safetensors
    weights_only fusion_config disable_mmap state_dict proxies tqdm_class output_loading_info dtype torch_dtype
    device_map max_memory offload_folder offload_buffers quantization_config subfolder variant adapter_kwargs
    adapter_name generation_config gguf_file distributed_config device_mesh tp_plan tp_size trust_remote_code
    allow_all_kernels use_kernels kernel_config key_mapping mirror low_cpu_mem_usage from_tf from_flax
    offload_state_dict code_revision attn_implementation experts_implementation num_labels output_attentions
    name_or_path""".split()
)


def from_pretrained_arguments() -> set[str]:
    """`FROM_PRETRAINED_KWARGS`, and the named parameters of the installed from_pretrained (a newer release's too)."""
    import inspect

    from transformers import PreTrainedModel

    named = inspect.signature(PreTrainedModel.from_pretrained).parameters.values()
    return FROM_PRETRAINED_KWARGS | {p.name for p in named if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def not_taken(key: str, value, config) -> str:
    """The refusal of a key that neither from_pretrained nor the model's config takes, naming where it goes: inside
    the field that holds it (transformers 5 moved `rope_theta` into `rope_parameters`), the field it is a typo of, or
    nowhere."""
    fields = config.to_dict()
    holder = next((name for name, v in fields.items() if _holds(v, key)), None)
    if holder is not None:
        # A sub-config (text_config) takes the keys given and keeps the others; a dict field is set whole: its value,
        # with this key inside it changed
        from transformers import PretrainedConfig

        sub = isinstance(getattr(config, holder, None), PretrainedConfig)
        inside = {key: value} if sub and key in fields[holder] else _with(fields[holder], key, value)
        given = json.dumps({holder: inside}, sort_keys=True, default=str)
        fix = f"set it inside {holder}: --model_init_kwargs '{given}'"
    elif close := closest(key, fields):
        fix = f"did you mean {close!r}? Else remove {key!r} from model_init_kwargs"
    else:
        fix = f"remove {key!r} from model_init_kwargs"
    return (
        f"model_init_kwargs {key!r} is neither a field of the model's config ({type(config).__name__}) nor an argument "
        f"of from_pretrained, so the model's load would stop on it: {fix}"
    )


def _holds(value, key: str) -> bool:
    return isinstance(value, dict) and (key in value or any(_holds(v, key) for v in value.values()))


def _with(value, key: str, new):
    """`value` (a field's, dicts within dicts) with `key` set to `new` wherever it is."""
    if not isinstance(value, dict):
        return value
    return {k: new if k == key else _with(v, key, new) for k, v in value.items()}
