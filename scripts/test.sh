#!/usr/bin/env bash
# The whole test suite, from a fresh machine: venv + requirements + test tools, then pytest.
#   bash scripts/test.sh                 # everything CI runs (Slurm, DeepSpeed and accelerate launches included)
#   bash scripts/test.sh -m "not slow"   # the fast tier: 124-173 s of tests on the 2-core VM in session 39
#                                        # (BENCHMARKS.md, docs/testing.md); any pytest arguments go to pytest
# Debian packages for the integration tests (Slurm, munge and iproute2 by tests/slurm/cluster.sh install; shellcheck;
# dosfstools and fusefat) are installed when missing and when this runs as root; otherwise those tests skip and say why.
set -euo pipefail
cd "$(dirname "$0")/.."

# The packages install in the background while setup_env.sh installs the venv, so that apt (~35 s for Slurm on a
# fresh machine) and pip overlap. A failure here is a warning: the Slurm cluster's start inside pytest tries the
# install again and its tests skip with cluster.sh's error; shellcheck's test skips.
packages() {
  DPOTRAIN_SLURM_NODES=2 bash tests/slurm/cluster.sh install "${DPOTRAIN_SLURM_STATE_DIR:-/tmp/dpotrain-slurm}" \
    || echo "warning: could not install Slurm (error above); the Slurm tests will try again and skip if it fails" >&2
  if ! command -v shellcheck >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends shellcheck) \
      >/dev/null || echo "warning: could not install shellcheck; its test will skip" >&2
  fi
  # A FAT image for the run lock on a file system without hard links; fusefat mounts it where the kernel has no vfat.
  if ! command -v mkfs.vfat >/dev/null || ! command -v fusefat >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends dosfstools \
      fusefat) >/dev/null || echo "warning: could not install dosfstools and fusefat; the FAT test will skip" >&2
  fi
}
apt_pid=""
if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
  packages &
  apt_pid=$!
fi
bash scripts/setup_env.sh --dev
[[ -z $apt_pid ]] || wait "$apt_pid" || true

.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Two workers (pytest-xdist): on 2 cores half the CPU sat idle while a test waited on its launch, its ranks or its
# Slurm job. Each worker takes one module at a time, and every test that submits to the session's Slurm cluster runs
# on the same worker (tests/conftest.py). The groups go out in the order the workers collected them, the most `slow`
# tests first (`_longest_groups_first` there): `--no-loadscope-reorder` keeps xdist from sorting them by number of
# tests, which sent groups of a few long tests last and left one worker running alone at the end. `-n 0` after it runs
# everything in this one process.
exec .venv/bin/python -m pytest -n 2 --dist loadgroup --no-loadscope-reorder "$@"
