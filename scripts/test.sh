#!/usr/bin/env bash
# The whole test suite, from a fresh machine: venv + requirements + test tools, then pytest.
#   bash scripts/test.sh                 # everything CI runs (Slurm, DeepSpeed and accelerate launches included)
#   bash scripts/test.sh -m "not slow"   # any pytest arguments
# Debian packages for the integration tests (shellcheck here; Slurm, munge, iproute2 by tests/slurm/cluster.sh) are
# installed when missing and when this runs as root; otherwise those tests skip and say why.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh --dev

if ! command -v shellcheck >/dev/null && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends shellcheck) \
    >/dev/null || echo "warning: could not install shellcheck; its test will skip" >&2
fi

.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
