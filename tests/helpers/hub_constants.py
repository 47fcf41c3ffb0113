"""Print, as one JSON line, the constants the training stack's modules hold after their imports (their functions'
default arguments and their classes' attributes too), and whether this interpreter had imported torch before this
script ran (a warm child of tests/helpers/warm.py had)."""

import importlib
import inspect
import io
import json
import sys
from pathlib import Path, PurePath

started_warm = "torch" in sys.modules
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import transformers.models.olmo3.modeling_olmo3  # noqa: E402, F401
from huggingface_hub import hf_api  # noqa: E402
from tqdm import std as tqdm_std  # noqa: E402
from transformers.utils import logging as transformers_logging  # noqa: E402

import train_dpo  # noqa: E402, F401  (the modules the warm server imports)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import warm  # noqa: E402

for name in warm.MORE_MODULES:  # and what it imports after train_dpo (datasets, dynamo with Muon)
    importlib.import_module(name)

SIMPLE = (str, bytes, int, float, bool, type(None), PurePath)
PACKAGES = {
    "huggingface_hub",
    "datasets",
    "transformers",
    "accelerate",
    "trl",
    "peft",
    "deepspeed",
    "dpotrain",
    "wandb",
}


def simple(value) -> bool:
    if isinstance(value, tuple | list | set | frozenset):
        return all(isinstance(v, SIMPLE) for v in value)
    return isinstance(value, SIMPLE)


constants = {"hf_api.api.endpoint": hf_api.api.endpoint}
# tqdm's defaults, read from TQDM_* while tqdm is imported (scripts/launch.sh exports TQDM_ASCII): a bar's, as drawn by
# tqdm and by transformers' subclass
bars = (tqdm_std.tqdm, transformers_logging.tqdm)
constants |= {f"{bar.__module__}.tqdm().ascii": repr(bar(total=1, file=io.StringIO()).ascii) for bar in bars}
for name, module in sorted(sys.modules.items()):
    if module is not None and name.split(".")[0] in PACKAGES:
        for key, value in list(vars(module).items()):
            if key.startswith("__"):
                continue
            # a module's constants, a function's default arguments, a class's attributes
            if inspect.isfunction(value) and value.__module__ == name:
                found = dict(enumerate(value.__defaults__ or ())) | (value.__kwdefaults__ or {})
            elif inspect.isclass(value) and value.__module__ == name:
                found = {k: v for k, v in vars(value).items() if not k.startswith("__")}
            else:
                found = {"": value}
            for inner, v in found.items():
                if simple(v):
                    shown = sorted(map(repr, v)) if isinstance(v, set | frozenset) else v
                    constants[f"{name}.{key}{'.' if inner != '' else ''}{inner}"] = repr(shown)
print(json.dumps({"started_warm": started_warm, "constants": constants}))
