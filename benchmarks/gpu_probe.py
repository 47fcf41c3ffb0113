"""The GPU machine in a minute: package versions, which kernels import for real, and FlexAttention's compilations as a
run compiles it (the project's compiled function, forwards/flex.py, on inductor, the GPU's compiler): how many, and
milliseconds per call, over ~30 row widths with gradients, without (no_grad) and in inference mode.

    python3 benchmarks/gpu_probe.py --out /tmp/lease/probe.json       # on the GPU (gpu_lease.sh's `probe` piece)
    python3 benchmarks/gpu_probe.py --out /tmp/lease/env.json --env   # versions, imports, upstream seams only
    python benchmarks/gpu_probe.py --out /tmp/probe.json --tiny       # CPU: 3 widths, no_grad and inference only

A run compiles flex once per autograd mode (docs/attention.md): more compilations than modes here means the guards
see something else (TORCH_LOGS=recompiles says what), and the run's first step pays for each.
"""

import argparse
import importlib
import importlib.metadata
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PACKAGES = (
    "torch",
    "transformers",
    "trl",
    "accelerate",
    "datasets",
    "huggingface_hub",
    "tokenizers",
    "peft",
    "python-dotenv",
    "dill",
    "multiprocess",
    "pyarrow",
    "deepspeed",
    "pydantic",
    "typing_extensions",
    "flash-attn-4",
    "nvidia-cutlass-dsl",
    "quack-kernels",
    "triton",
)
# Imported for real: transformers finds a package without importing it (FlashAttention 4 counts as available when
# `import flash_attn.cute` fails); where each came from tells a carried package from the image's.
MODULES = ("transformers", "trl", "datasets", "peft", "dotenv", "deepspeed", "flash_attn.cute", "triton")


def versions() -> dict:
    import torch

    found = {"python": platform.python_version(), "cuda": torch.version.cuda}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
        found["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return found


def import_problem(module: str) -> str | None:
    """Why `module` does not import, in a few words, or None."""
    from dpotrain.recipe.errors import cause

    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - a kernel package fails in many ways (missing libraries, CUDA versions)
        return f"import {module}: {cause(e, 160)}"
    return None


def kernels() -> dict:
    """Each module imported for real (transformers' availability checks only find packages), and the varlen
    FlashAttention a run would take here."""
    import torch

    from dpotrain.forwards import choice

    imports = {name: import_problem(name) or "ok" for name in MODULES}
    origins = {name: where(name) for name, found in imports.items() if found == "ok"}
    return {"imports": imports, "from": origins, "varlen": choice.installed_varlen(torch.cuda.is_available())}


def where(module: str) -> str:
    """The folder an imported module came from; a namespace package (FlashAttention 4's `flash_attn`) by its first
    folder, as it has no file."""
    import sys

    top = sys.modules[module.split(".")[0]]
    if getattr(top, "__file__", None):
        return str(Path(top.__file__).parent.parent)
    return next((str(Path(folder).parent) for folder in getattr(top, "__path__", [])), "")


def upstream() -> str:
    """dpotrain/recipe/upstream.py's check of the private names this project relies on, against what is installed."""
    from dpotrain.recipe import upstream as seams

    try:
        seams.check()
    except SystemExit as moved:
        return str(moved)
    return "ok"


def widths(count: int, largest: int = 16384) -> list[int]:
    """`count` distinct row widths, multiples of 128 from 256 to `largest`, in a scattered order (as micro-batches
    come)."""
    top = largest // 128
    steps = sorted({2 + round(i * (top - 2) / max(count - 1, 1)) for i in range(count)})
    return [128 * s for s in sorted(steps, key=lambda s: (s * 7919) % 127)]


def flex_probe(count: int, tiny: bool) -> dict:
    """The project's compiled flex on causal rows at `count` widths per autograd mode: compilations after each mode
    and ms per call (the second call at each width: the first may compile)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    from dpotrain.forwards import flex

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    heads, dim = (2, 16) if tiny else (32, 128)
    modes = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}
    if not cuda:  # FlexAttention has no backward on the CPU
        modes.pop("grad")

    def causal(b, h, q, k):
        return q >= k

    out = {"backend": flex.BACKEND, "device": device, "heads": heads, "head_dim": dim, "modes": {}}
    for mode, context in modes.items():
        timings = []
        for width in widths(count, 1024 if tiny else 16384):
            q, k, v = (torch.randn(1, heads, width, dim, device=device, dtype=dtype) for _ in range(3))
            if mode == "grad":
                q.requires_grad_(True)
            mask = create_block_mask(causal, 1, None, width, width, device=device)
            for call in range(2):
                start = time.perf_counter()
                with context():
                    result, _ = flex.attention(None, q, k, v, mask, scaling=dim**-0.5)
                    if mode == "grad":
                        result.float().sum().backward()
                if cuda:
                    torch.cuda.synchronize()
                if call:
                    timings.append({"width": width, "ms": round(1000 * (time.perf_counter() - start), 3)})
        out["modes"][mode] = {"compilations_after": flex.compilations(), "calls": timings}
    out["compilations"] = flex.compilations()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--tiny", action="store_true", help="CPU: 3 widths, small heads")
    parser.add_argument("--widths", type=int, default=None, help="row widths per mode (default 30; --tiny 3)")
    parser.add_argument("--env", action="store_true", help="versions, imports and upstream seams only (no flex)")
    args = parser.parse_args()
    count = args.widths or (3 if args.tiny else 30)
    record = {"versions": versions(), "kernels": kernels(), "upstream": upstream()}
    print(json.dumps(record), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    if args.env:
        return
    start = time.perf_counter()
    record["flex"] = flex_probe(count, args.tiny)
    record["flex"]["seconds"] = round(time.perf_counter() - start, 1)
    modes = record["flex"]["modes"]
    print(
        f"FlexAttention on {record['flex']['backend']}: {record['flex']['compilations']} compilations for "
        f"{count} widths x {len(modes)} autograd modes ({', '.join(modes)})",
        flush=True,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
