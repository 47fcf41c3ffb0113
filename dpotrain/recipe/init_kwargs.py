"""What the keys of `model_init_kwargs` (the arguments given to `from_pretrained`) are to the run: decided by it,
secret, only how the files are read, or an override of the model's config. Read by the checks (options.py), the resume
comparison (resolve.py) and the reference cache's key (reference.py)."""

# model_init_kwargs keys the run decides from its own fields, plans by and records: they would win at load time
DECIDED_INIT_KWARGS = {
    "dtype": "dtype",
    "torch_dtype": "dtype",
    "attn_implementation": "attn_implementation",
    "revision": "model_revision",
}


# model_init_kwargs keys that say how from_pretrained reads the files, not what model it builds: every other key is a
# config override (`rope_theta`, `attention_dropout`) or a quantization, another model than the checkpoint's steps'
LOAD_ONLY_INIT_KWARGS = {"low_cpu_mem_usage", "device_map", "max_memory", "offload_folder", "cache_dir", "token"}


def config_overrides(kwargs: dict | None) -> dict:
    """The model_init_kwargs that build another model from the same files (a config override such as `rms_norm_eps`):
    all but the keys the run decides and records as its own fields, and those that only say how the files are read."""
    skip = DECIDED_INIT_KWARGS.keys() | LOAD_ONLY_INIT_KWARGS
    return {k: v for k, v in (kwargs or {}).items() if k not in skip}


# model_init_kwargs keys that hold a secret: the run records model_init_kwargs as given (resolved_config.json, the
# checkpoints' training_args.bin), where transformers hides only the `*_token` fields of its own arguments
SECRET_INIT_KWARGS = ("token", "use_auth_token")
