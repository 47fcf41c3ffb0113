#!/usr/bin/env bash
# The packages a lent GPU machine lacks, downloaded on a machine that reaches the package index, as carry folders under
# DEST: each folder travels with one call of the device tool (`run(carry=[...])`), beside the project's tree, within
# that call's 64 MiB. The GPU machine's Python: 3.12, x86-64 Linux, torch 2.11 (docs/gpu-benchmarks.md says what it
# has). benchmarks/gpu_lease.sh installs what was carried there.
#   bash benchmarks/gpu_wheels.sh .whl core        # .whl/core: transformers, trl, datasets, dill, multiprocess,
#                                                  #   python-dotenv, peft (~15 MiB: one call with the project)
#   bash benchmarks/gpu_wheels.sh .whl ds          # .whl/ds: DeepSpeed's source distribution and what it imports
#                                                  #   that the image lacks (~5 MiB)
#   bash benchmarks/gpu_wheels.sh .whl fa4         # .whl/fa4-1 and .whl/fa4-2: FlashAttention 4 and its CUTLASS DSL
#                                                  #   (~97 MiB; ~71 with its one large wheel packed with xz by
#                                                  #   benchmarks/wheel_xz.py, minutes), that one split between the two
#   bash benchmarks/gpu_wheels.sh .whl core ds fa4 # several sets at once
# DEST must be ignored by git under the repository's root (.whl/ is): the device tool carries only paths named in
# `carry`, and a folder git tracks would travel with the tree in every call. Each folder gets a SHA256SUMS that
# gpu_lease.sh checks on the machine. Versions: requirements.txt and requirements-gpu.txt where they pin the package,
# else this file. The sizes of the folders, and of each call's carry with the tree, are printed and checked.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash benchmarks/gpu_wheels.sh DEST core|ds|fa4 [...]"
DEST=${1:?$usage}
shift
(($#)) || { echo "error: name a set to download (core, ds or fa4); $usage" >&2; exit 2; }
for set in "$@"; do
  [[ $set == core || $set == ds || $set == fa4 ]] || { echo "error: unknown set $set; $usage" >&2; exit 2; }
done
mkdir -p "$DEST"
git check-ignore -q "$DEST" || {
  echo "error: $DEST is not ignored by git: add it to .gitignore (or use .whl), or it travels in every call" >&2
  exit 2
}
PYTHON=${PYTHON:-python3}
MIB=$((1024 * 1024))
CARRY_MIB=64  # the device tool's limit per call: the tree and every carried folder together
# FlashAttention 4's CUDA-13 libraries wheel (88 MiB; 59 MiB packed with xz) in parts of this size: aa in fa4-1 (with
# the other wheels, ~10 MiB, and core's 15 beside it in that call), the rest in fa4-2: the two calls carry about as much
PART=17M

# A package's version as requirements*.txt pins it, else the one given.
pin() {
  local found
  found=$(grep -hiE "^$1==" requirements.txt requirements-gpu.txt | head -1 | cut -d= -f3)
  echo "$1==${found:-$2}"
}
# Wheels for the GPU machine's Python, not this one's; pydantic-core is tagged manylinux_2_17 only.
download() {
  local into=$1
  shift
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$into" "$@"
}
checksums() { (cd "$1" && sha256sum -- * | grep -v ' SHA256SUMS$' > SHA256SUMS); }
bytes() { du -cb "$@" | tail -1 | cut -f1; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }

fresh() { rm -rf "${DEST:?}/$1" && mkdir -p "$DEST/$1"; }

core() {
  fresh core
  # huggingface_hub stays the image's 1.33 (2.4 requires httpx2, which the image lacks; transformers 5.23 and
  # datasets 5.2 take >= 1.31). peft is carried for an image whose own is older: gpu_lease.sh installs a carried wheel
  # only where the image has no version as new.
  download "$DEST/core" "$(pin transformers 5.23.0)" "$(pin trl 1.16.0)" "$(pin datasets 5.2.0)" dill==0.4.1 \
    multiprocess==0.70.19 "$(pin python-dotenv 1.2.4)" "$(pin peft 0.21.2)"
  checksums "$DEST/core"
}

ds() {
  fresh ds
  # DeepSpeed ships no wheel: its source distribution, built on the GPU machine against that machine's torch with no
  # ops (DS_BUILD_OPS=0; they JIT-compile with nvcc at first use). Of what it imports (einops, hjson, msgpack, ninja,
  # numpy, packaging, psutil, py-cpuinfo, pydantic, torch, tqdm; nvidia-ml-py on CUDA) the image lacks hjson and
  # pydantic; pydantic needs typing-extensions >= 4.16.
  "$PYTHON" -m pip download -q --no-deps --no-binary=:all: -d "$DEST/ds" "$(pin deepspeed 0.19.8)"
  download "$DEST/ds" hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing-extensions==4.16.0
  checksums "$DEST/ds"
}

fa4() {
  fresh fa4-1
  fresh fa4-2
  local all="$DEST/fa4-1/all"
  mkdir -p "$all"
  # nvidia-cutlass-dsl-libs-core is the `cutlass` package itself (libs-base needs it); einops is the image's.
  download "$all" "$(pin flash-attn-4 4.0.0b36)" "$(pin nvidia-cutlass-dsl 4.8.1)" nvidia-cutlass-dsl-libs-base==4.8.1 \
    nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 "$(pin quack-kernels 0.6.5)" \
    "$(pin apache-tvm-ffi 0.1.15.post2)" "$(pin torch-c-dlpack-ext 0.1.5)"
  # The large wheel as an xz-compressed tar of its files (benchmarks/wheel_xz.py; made a wheel again, each file
  # checked against the wheel's RECORD, on the machine), split into parts.
  local big
  big=$(basename "$(ls "$all"/nvidia_cutlass_dsl_libs_cu13-*.whl)")
  "$PYTHON" benchmarks/wheel_xz.py pack "$all/$big" "$all/$big.tar.xz"
  rm "$all/$big"
  big=$big.tar.xz
  # One manifest for both folders: every file whole (the packed one too), checked after the join on the machine.
  (cd "$all" && sha256sum -- *.whl "$big") > "$DEST/fa4-1/SHA256SUMS"
  cp "$DEST/fa4-1/SHA256SUMS" "$DEST/fa4-2/SHA256SUMS"
  (cd "$all" && split -b "$PART" "$big" "$big.part-")
  mv "$all/$big.part-aa" "$DEST/fa4-1/"
  mv "$all/$big".part-* "$DEST/fa4-2/"
  rm "$all/$big"
  mv "$all"/*.whl "$DEST/fa4-1/"
  rmdir "$all"
}

for set in "$@"; do
  "$set"
done

# What each call carries, with the tree (tracked and untracked files git does not ignore), against the 64 MiB.
tree=$( (git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null || true) | awk '
  $2 == "total" { s += $1 } END { print s + 0 }')
echo "tree: $(mib "$tree") MiB"
status=0
check() {  # name, folders...
  local name=$1 total=$tree
  shift
  for folder in "$@"; do
    [[ -d $DEST/$folder ]] || return 0
    total=$((total + $(bytes "$DEST/$folder")))
  done
  local verdict=ok
  ((total <= CARRY_MIB * MIB)) || { verdict="OVER the ${CARRY_MIB} MiB a call carries"; status=1; }
  printf '%-34s %6s MiB  %s\n' "$name" "$(mib "$total")" "$verdict"
}
for folder in core ds fa4-1 fa4-2; do
  [[ -d $DEST/$folder ]] && printf '%-34s %6s MiB  (%s files)\n' "$DEST/$folder" "$(mib "$(bytes "$DEST/$folder")")" \
    "$(find "$DEST/$folder" -type f | wc -l)"
done
check "lease 1 call: tree + core" core
check "lease 2 call 1: tree + core + fa4-1" core fa4-1
check "lease 2 call 2: tree + fa4-2" fa4-2
check "lease 3 call: tree + core + ds" core ds
exit $status
