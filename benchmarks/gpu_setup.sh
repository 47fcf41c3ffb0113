#!/usr/bin/env bash
# Installs what the GPU benchmarks and `pytest -m gpu` need on a GPU machine without network, from a folder of wheels
# (and DeepSpeed's source distribution) carried there (docs/gpu-benchmarks.md says how to download them on a machine
# with network), into a folder of its own (`pip install --no-deps --target`): the machine's own torch stays as it is.
# Fails (exit 1) when a package the kit needs does not import, naming it.
#   bash benchmarks/gpu_setup.sh WHEELS_DIR [TARGET_DIR]     # TARGET_DIR defaults to .gpu-packages
#   export PYTHONPATH=...                                     # the line it prints at the end
# Wheels split to be carried (`split -b 45M x.whl x.whl.part-`) are joined first (`cat x.whl.part-* > x.whl`).
# A `pip install --target` puts no console script on PATH: launch with `python -m accelerate.commands.launch`.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:?usage: bash benchmarks/gpu_setup.sh WHEELS_DIR [TARGET_DIR]}
TARGET=$(realpath -m "${2:-.gpu-packages}")
PYTHON=${PYTHON:-python}
[[ -d $WHEELS ]] || { echo "error: $WHEELS is not a folder of wheels (docs/gpu-benchmarks.md lists them)" >&2; exit 2; }

shopt -s nullglob
for first in "$WHEELS"/*.whl.part-aa; do
  whole=${first%.part-aa}
  [[ -f $whole ]] || { cat "$whole".part-* > "$whole"; echo "joined $(basename "$whole")"; }
done
wheels=("$WHEELS"/*.whl)
sdists=("$WHEELS"/*.tar.gz)
(( ${#wheels[@]} + ${#sdists[@]} )) || { echo "error: no .whl or .tar.gz files in $WHEELS" >&2; exit 2; }

mkdir -p "$TARGET"
if (( ${#wheels[@]} )); then
  "$PYTHON" -m pip install --no-deps --no-index --upgrade --target "$TARGET" "${wheels[@]}"
fi
# DeepSpeed ships no wheel: its source distribution, built here with no ops (DS_BUILD_OPS=0: they JIT-compile with nvcc
# when first used) against this machine's torch (--no-build-isolation: its setup.py imports torch).
for sdist in "${sdists[@]}"; do
  DS_BUILD_OPS=0 "$PYTHON" -m pip install --no-deps --no-index --no-build-isolation --upgrade --target "$TARGET" \
    "$sdist"
done

# A --target folder's .pth files are not read: the CUTLASS DSL's own packages go on PYTHONPATH by hand.
export PYTHONPATH="$TARGET:$TARGET/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
echo "export PYTHONPATH=\"$PYTHONPATH\""
# transformers' is_flash_attn_4_available() is True as soon as the package is there, even when its kernels cannot
# import (then the run would take FlashAttention 4 and crash): import each for real; any missing one fails the set-up.
"$PYTHON" - <<'PY'
import importlib
import sys

missing = []
for name in ("trl", "transformers", "datasets", "accelerate", "deepspeed", "dotenv", "flash_attn.cute"):
    try:
        importlib.import_module(name)
        print(f"ok: {name}")
    except Exception as e:  # noqa: BLE001 - say which one and why, then go on to the others
        missing.append(name)
        print(f"MISSING: {name} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
if missing:
    sys.exit(f"error: {', '.join(missing)} do(es) not import: add the wheels named above to the wheels folder "
             "(docs/gpu-benchmarks.md lists them) and run this again")
PY
