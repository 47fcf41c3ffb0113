"""The model a run trains, by identity: its weights, config, tokenizer and chat template, as resume compares them.

A model re-exported at the same path, or a folder whose `chat_template.jinja` was edited, would resume with the
reference scored by other weights, or on pairs tokenized another way. So a run records the model's files
(`derived.model_identity`, as data_identity.py records the data), or a Hub model's commit, and a rerun compares them.
"""

import contextlib
import fnmatch
import hashlib
import json
import os
import shlex
from pathlib import Path

from dpotrain.data import builtin, data_identity, hub_revision
from dpotrain.recipe.errors import ConfigError

# What transformers reads from a model folder: weights (safetensors, PyTorch, a LoRA adapter), their index, config,
# generation config, tokenizer and chat template files, and the modeling code of a remote-code model.
MODEL_FILES = tuple(
    "config.json generation_config.json *.safetensors *.safetensors.index.json pytorch_model*.bin "
    "pytorch_model*.bin.index.json adapter_config.json adapter_model.bin tokenizer* special_tokens_map.json "
    "added_tokens.json vocab* merges.txt *.model *.tiktoken chat_template.jinja chat_template.json *.py".split()
)
TEMPLATES_DIR = "additional_chat_templates"  # transformers reads the named templates of a tokenizer from here
KEY = hub_revision.KEY


def folder(name: str | None) -> Path | None:
    """The local folder the model loads from (a built-in one once built); None for a Hub model."""
    if builtin.is_builtin(name):
        found = builtin.existing_model_dir(name)
        return Path(found) if found else None
    path = Path(name or "").expanduser()
    return path if name and path.is_dir() else None


def cache_name(name: str) -> str:
    """A model's (or tokenizer's) name in a cache key, as transformers keeps it (`name_or_path`, the string it was
    loaded by): a local folder by its real path, so that one folder named relative once and absolute once (a Slurm
    job makes a relative command-line path absolute), through a link, with `./` or a trailing slash keys one analysis
    and one reference cache; a Hub name as written."""
    path = Path(name).expanduser()
    return os.path.realpath(path) if name and path.is_dir() else name


def config_file(
    name: str, revision: str | None = None, cache_dir: str | None = None, subfolder: str | None = None
) -> Path | None:
    """The config.json the model is built from: a local folder's, else the one in the Hub cache's snapshot of
    `revision` (where from_pretrained read it, `cache_dir` as given to it); in `subfolder` where model_init_kwargs
    name one (from_pretrained reads the config there: the top folder's is another model's, or none). None where
    neither holds one."""
    from huggingface_hub import try_to_load_from_cache

    path, file = Path(name).expanduser(), f"{subfolder}/config.json" if subfolder else "config.json"
    try:
        found = path / file if path.is_dir() else try_to_load_from_cache(name, file, cache_dir, revision)
    except ValueError:  # not a Hub name either (the load read it otherwise)
        return None
    # try_to_load_from_cache: None, or a marker that the repo has no such file
    return Path(found) if isinstance(found, str | Path) and Path(found).is_file() else None


def config_sha256(
    name: str, revision: str | None = None, cache_dir: str | None = None, subfolder: str | None = None
) -> str | None:
    """sha256 of the config.json the model is built from (`config_file`), as the file is (the run's own changes to the
    loaded config, use_cache, dtype, attention, are not in it: every attempt of a run reads the same). None where
    there is none."""
    try:
        found = config_file(name, revision, cache_dir, subfolder)
        return hashlib.sha256(found.read_bytes()).hexdigest() if found else None
    except OSError:
        return None


def own_code(name: str, revision: str | None = None) -> bool:
    """Whether loading the model may import code of its own (`auto_map` in its config.json or tokenizer_config.json):
    True too where its files are not on this machine (a Hub model not yet fetched), False for a built-in one."""
    if builtin.is_builtin(name):
        return False
    found = config_file(name, revision)
    if found is None:
        return True
    for file in ("config.json", "tokenizer_config.json"):
        try:
            if "auto_map" in json.loads((found.parent / file).read_text()):
                return True
        except (OSError, ValueError, TypeError):  # none, not JSON, not an object: that load says so
            continue
    return False


def code_sha256(
    name: str, revision: str | None = None, cache_dir: str | None = None, subfolder: str | None = None
) -> dict[str, str | None] | None:
    """sha256 of each file of a model's own code, beside its config.json (`config_file`): the modules its `auto_map`
    names and those they import relatively, as transformers loads them (`trust_remote_code`); None for a model without
    `auto_map`. An edited modeling file builds another model from the same weights and config. A module of another
    repo (`repo--module.Class`) is not beside the config: its name, in config.json, is keyed with that file."""
    try:
        found = config_file(name, revision, cache_dir, subfolder)
        auto_map = json.loads(found.read_text()).get("auto_map") if found else None
    except (OSError, ValueError, AttributeError):  # AttributeError: a config.json that is not an object
        return None
    if not isinstance(auto_map, dict):
        return None
    named = [r for v in auto_map.values() for r in (v if isinstance(v, list) else [v]) if isinstance(r, str)]
    modules = {found.parent / f"{r.rpartition('.')[0]}.py" for r in named if "--" not in r and "." in r}
    return module_digests(modules, found.parent)


def module_digests(modules, root: Path) -> dict[str, str | None]:
    """sha256 of each of `modules` and of the files they import relatively (as transformers loads code of a model's or
    a tokenizer's own), keyed by their path under `root`; a file missing: None."""
    from transformers.dynamic_module_utils import get_relative_import_files

    files = {Path(m) for m in modules}
    for module in list(files):
        with contextlib.suppress(OSError):  # missing: keyed as missing (None) below
            files.update(Path(f) for f in get_relative_import_files(module))
    out = {}
    for path in sorted(files):
        try:
            out[path.relative_to(root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            out[path.relative_to(root).as_posix()] = None
    return out


def input_files(recipe) -> dict[str, Path] | None:
    """The local files the run reads its model, tokenizer and chat template from; None for a Hub model."""
    root = folder(recipe.model.model_name_or_path)
    if root is None:
        return None
    # With model_init_kwargs' `subfolder`, the weights and config load from there: its sub/config.json edited between
    # attempts resumed in silence, the checkpoint trained on under another model (the top folder's files alone kept)
    sub = subfolder(recipe)
    found = []
    for where in (root, *([root / sub] if sub and (root / sub).is_dir() else [])):
        found += [
            p for p in where.iterdir() if p.is_file() and any(fnmatch.fnmatchcase(p.name, m) for m in MODEL_FILES)
        ]
    found += (root / TEMPLATES_DIR).glob("*.jinja")
    return {p.relative_to(root).as_posix(): p for p in sorted(found)}


def subfolder(recipe) -> str | None:
    """The folder of the model's repo its weights and config load from (`model_init_kwargs`), else None."""
    return str((recipe.training.model_init_kwargs or {}).get("subfolder") or "") or None


def of(recipe) -> dict | None:
    """{"files": ...} (`data_identity.of_files`) for a local model, {"hub_commit": ...} for a Hub model, None where
    the Hub cannot say."""
    found = input_files(recipe)
    if found is not None:
        return {"files": data_identity.of_files(found, ends=True)}
    commit = hub_revision.commit(recipe.model.model_name_or_path, recipe.model.model_revision, "model")
    return {KEY: commit} if commit else None


def changed(recipe, old: dict | None) -> str | None:
    """How the model differs from the run's record `old` (`of`), naming the file; None: the same, or no record."""
    if not old:
        return None
    name = recipe.model.model_name_or_path
    found = input_files(recipe)
    if found is not None and old.get("files"):
        if (sub := subfolder(recipe)) and not any(n.startswith(f"{sub}/") for n in old["files"]):
            found = {n: p for n, p in found.items() if not n.startswith(f"{sub}/")}  # recorded before they were
        why = data_identity.changed_files(old["files"], found)
        return f"{folder(name)}: {why}" if why else None
    if found is None and old.get(KEY):
        now = hub_revision.commit(name, recipe.model.model_revision, "model")
        if now and now != old[KEY]:
            return (
                f"{name} at {recipe.model.model_revision or 'main'} is commit {now[:12]}, the run started on "
                f"commit {old[KEY][:12]}"
            )
    return None


def adapter_refusal(what: str, adapter: Path, merged: Path | None = None) -> ConfigError:
    """The refusal of a LoRA adapter (`adapter`: its adapter_config.json) given as the model to start from, naming
    its base; `what`: the folder or Hub repo, `merged`: a folder holding the adapter merged into its base."""
    try:
        base = json.loads(adapter.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    start = f"its base model ({base}) with --use_peft true for a new adapter" if base else "its base model"
    merged = (
        f"--model_name_or_path {shlex.quote(str(merged))}, the adapter merged into its base"
        if merged is not None
        else "the adapter merged into its base (a run with merge_lora: true saves that to <output_dir>/merged/)"
    )
    return ConfigError(
        f"{what} holds a LoRA adapter (adapter_config.json), not a model a run can start from: start from {start}, "
        f"or from {merged}"
    )
