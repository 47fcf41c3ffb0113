#!/usr/bin/env bash
# Installs what the GPU benchmarks and `pytest -m gpu` need on a GPU machine without network, from a folder of wheels
# carried there (docs/gpu-benchmarks.md says how to download them on a machine with network), into a folder of its own
# (`pip install --no-deps --target`): the machine's own torch stays as it is.
#   bash benchmarks/gpu_setup.sh WHEELS_DIR [TARGET_DIR]     # TARGET_DIR defaults to .gpu-packages
#   export PYTHONPATH=...                                     # the line it prints at the end
# Wheels split to be carried (`split -b 45M x.whl x.whl.part-`) are joined first (`cat x.whl.part-* > x.whl`).
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
(( ${#wheels[@]} )) || { echo "error: no .whl files in $WHEELS" >&2; exit 2; }

mkdir -p "$TARGET"
"$PYTHON" -m pip install --no-deps --no-index --upgrade --target "$TARGET" "${wheels[@]}"

# A --target folder's .pth files are not read: the CUTLASS DSL's own packages go on PYTHONPATH by hand.
export PYTHONPATH="$TARGET:$TARGET/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
# transformers' is_flash_attn_4_available() is True as soon as the package is there, even when its kernels cannot
# import (then every FlashAttention 4 path crashes): import them for real.
"$PYTHON" - <<'PY'
import importlib

for name in ("trl", "datasets", "deepspeed", "flash_attn.cute"):
    try:
        importlib.import_module(name)
        print(f"ok: {name}")
    except Exception as e:  # noqa: BLE001 - say which one and why, then go on to the others
        print(f"MISSING: {name} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
PY
echo "export PYTHONPATH=\"$PYTHONPATH\""
