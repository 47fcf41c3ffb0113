#!/usr/bin/env bash
# One call of a GPU lease: installs what was carried, checks the machine, and runs the named pieces against one
# deadline, so that the call ends with its results inside the device tool's limits (docs/gpu-benchmarks.md says which
# pieces each call of each lease runs, and with which carry).
#   bash benchmarks/gpu_lease.sh OUT [BUDGET_S] [PIECES]
#     OUT       at most 8 small files come back from it: environment.json, results.json, table.md, lease.log, logs.txt
#     BUDGET_S  seconds from now to the deadline for everything, install included (default 540: a minute under the
#               10-minute call)
#     PIECES    comma-separated, in order (default tests,think-recipe,e2e-think,e2e-multiturn);
#               `python3 benchmarks/gpu_lease.py --list` lists them with their shares
#   GPU_LEASE_CPU=1 bash benchmarks/gpu_lease.sh /tmp/lease-out    # the same flow on a CPU at tiny sizes (CI runs it)
# Carried folders are read from .whl/ (GPU_LEASE_WHEELS=DIR for another): core, ds, fa4-1, fa4-2, as
# benchmarks/gpu_wheels.sh writes them. Each is installed once per machine into GPU_LEASE_WORK (default
# /tmp/dpotrain-lease), which also holds the model the pieces share and every large file; a later call on the same
# machine (back to back: it is given back 30 s after a call) finds them there. The last line printed is one
# `RESULT ...` line with the key figures.
set -uo pipefail
START=$(date +%s)
cd "$(dirname "$0")/.."
usage="usage: bash benchmarks/gpu_lease.sh OUT [BUDGET_S] [PIECES]"
OUT=$(realpath -m "${1:?$usage}")
BUDGET_S=${2:-540}
PIECES=${3:-tests,think-recipe,e2e-think,e2e-multiturn}
[[ $BUDGET_S =~ ^[0-9]+$ ]] || { echo "error: BUDGET_S must be whole seconds (got $BUDGET_S); $usage" >&2; exit 2; }
WORK=$(realpath -m "${GPU_LEASE_WORK:-/tmp/dpotrain-lease}")
WHEELS=${GPU_LEASE_WHEELS:-.whl}
CPU=${GPU_LEASE_CPU:-0}
mkdir -p "$OUT" "$WORK/installed"
exec > >(tee -a "$OUT/lease.log") 2>&1
echo "lease call: budget ${BUDGET_S}s, pieces $PIECES, work in $WORK, results in $OUT"

if [[ $CPU == 1 ]]; then
  # The CPU trial: this machine's own environment (the project's venv), nothing installed.
  PYTHON=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
  echo "installed: nothing (CPU trial uses the venv)" | tee "$WORK/install.txt"
else
  PYTHON=${PYTHON:-python3}  # the image's interpreter: it has no `python`
  SITE=$WORK/site
  # No index to ask for a newer pip (there is no network), no warning per call about running as root (the lease does).
  export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
  : > "$WORK/install.txt"
  note() { echo "$*" | tee -a "$WORK/install.txt"; }
  # pip into a folder of its own, never byte-compiling on the device, never reaching for an index.
  pip_target() { "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$@"; }
  # A carried wheel whose package the image has at the same or a later version stays out (peft, typing-extensions).
  needed() {
    "$PYTHON" - "$@" <<'PY'
import importlib.metadata as m
import sys

try:
    from packaging.version import Version
except ImportError:  # pip's own copy: pip is there, it installs
    from pip._vendor.packaging.version import Version

for path in sys.argv[1:]:
    name, version = path.rsplit("/", 1)[-1].split("-")[:2]
    try:
        have = m.version(name)
    except m.PackageNotFoundError:
        have = None
    if have is None or Version(have) < Version(version):
        print(path)
    else:
        print(f"image has {name} {have} (carried {version}): kept", file=sys.stderr)
PY
  }
  stamped() { [[ -f $WORK/installed/$1 ]] && cmp -s "$WORK/installed/$1" "$2"; }
  install_set() {  # name: a folder of wheels (and DeepSpeed's source distribution)
    local set=$1 dir=$WHEELS/$1
    if stamped "$set" "$dir/SHA256SUMS"; then note "$set: installed earlier on this machine"; return 0; fi
    (cd "$dir" && sha256sum --quiet -c SHA256SUMS) || { note "$set: FAILED its sha256 check: carry it again"; return 1; }
    local wheels listed
    listed=$(needed "$dir"/*.whl) || { note "$set: FAILED to compare its wheels with the image's packages"; return 1; }
    mapfile -t wheels <<< "$listed"
    [[ -n ${wheels[0]} ]] || wheels=()
    ((${#wheels[@]} == 0)) || pip_target "${wheels[@]}" || { note "$set: pip FAILED"; return 1; }
    local sdist
    for sdist in "$dir"/*.tar.gz; do
      [[ -f $sdist ]] || continue
      # DeepSpeed without its ops (they JIT-compile with nvcc when first used), against this machine's torch. Its
      # setup.py on the `cuda` accelerator, which it detects wherever torch sees a GPU, asks nvcc for the CUDA version
      # and fails without the CUDA toolkit: built on the `cpu` accelerator, as the CPU rehearsal builds it (it builds no
      # op; DeepSpeed detects the GPU when it runs).
      DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
        --no-build-isolation --upgrade --target "$SITE" "$sdist" ||
        { note "$set: building $(basename "$sdist") FAILED"; return 1; }
    done
    cp "$dir/SHA256SUMS" "$WORK/installed/$set"
    note "$set: installed ${wheels[*]##*/} $(ls "$dir"/*.tar.gz 2>/dev/null | xargs -r -n1 basename)"
  }
  # FlashAttention 4 comes in two calls: fa4-1's files wait in WORK/fa4 for fa4-2's; joined, checked, installed.
  install_fa4() {
    if stamped fa4 "$WORK/fa4/SHA256SUMS"; then note "fa4: installed earlier on this machine"; return 0; fi
    mkdir -p "$WORK/fa4"
    local part
    for part in fa4-1 fa4-2; do
      [[ -d $WHEELS/$part ]] && cp "$WHEELS/$part"/* "$WORK/fa4/" && note "$part: kept in $WORK/fa4"
    done
    local first big
    first=$(ls "$WORK/fa4"/*.part-aa 2>/dev/null | head -1)
    [[ -n $first ]] || { note "fa4: fa4-1 is not on this machine: carry .whl/fa4-1 (lease 2, call 1) first"; return 1; }
    big=${first%.part-aa}
    [[ -n $(ls "$WORK/fa4"/*.part-ab 2>/dev/null) ]] || { note "fa4: waiting for fa4-2 (the next call)"; return 0; }
    cat "$big".part-* > "$big"
    (cd "$WORK/fa4" && sha256sum --quiet -c SHA256SUMS) || { note "fa4: FAILED its sha256 check after the join"; return 1; }
    local packed
    for packed in "$WORK/fa4"/*.tar.xz; do  # a wheel carried packed (benchmarks/wheel_xz.py): a wheel again
      [[ -f $packed ]] || continue
      "$PYTHON" benchmarks/wheel_xz.py unpack "$packed" "$WORK/fa4" > /dev/null 2>> "$WORK/install.txt" ||
        { note "fa4: unpacking $(basename "$packed") FAILED"; return 1; }
    done
    pip_target "$WORK/fa4"/*.whl || { note "fa4: pip FAILED"; return 1; }
    cp "$WORK/fa4/SHA256SUMS" "$WORK/installed/fa4"
    note "fa4: joined $(basename "$big"), checked, installed $(ls "$WORK/fa4"/*.whl | wc -l) wheels"
  }
  for set in core ds; do
    if [[ -d $WHEELS/$set ]]; then
      install_set "$set"
    elif [[ -f $WORK/installed/$set ]]; then
      note "$set: installed earlier on this machine (not carried in this call)"
    fi
  done
  [[ -d $WHEELS/fa4-1 || -d $WHEELS/fa4-2 || -f $WORK/installed/fa4 ]] && install_fa4
  [[ -s $WORK/install.txt ]] || note "installed: nothing carried, nothing installed earlier on this machine"
  # A --target folder's .pth files are not read: the CUTLASS DSL's own packages go on PYTHONPATH by hand.
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  [[ -d $SITE/nvidia_cutlass_dsl/dsl_packages ]] && PYTHONPATH="$SITE/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
  echo "PYTHONPATH=$PYTHONPATH"
fi

"$PYTHON" benchmarks/gpu_lease.py --out "$OUT" --work "$WORK" --start "$START" --budget "$BUDGET_S" \
  --pieces "$PIECES" --python "$PYTHON" $([[ $CPU == 1 ]] && echo --cpu)
