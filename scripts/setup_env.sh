#!/usr/bin/env bash
# Create .venv and install the pinned requirements (idempotent: a second run only checks).
#   bash scripts/setup_env.sh            # training requirements
#   bash scripts/setup_env.sh --dev      # + test tools (pytest, ruff)
set -euo pipefail
cd "$(dirname "$0")/.."

reqs=requirements.txt
# One word or none: a mistyped `--devv` (or `--help`) installed the training requirements alone and said "venv ready"
for word in "$@"; do
  if [[ $word != --dev ]]; then
    echo "error: setup_env.sh takes no '$word': run it bare for the training requirements, or with --dev for the test tools too" >&2
    exit 2
  fi
done
[[ "${1:-}" == "--dev" ]] && reqs=requirements-dev.txt
python=${PYTHON:-python3}

if [[ ! -x .venv/bin/python ]]; then
  "$python" -m venv .venv || { echo "error: could not create .venv: install python3-venv (Debian: apt-get install python3-venv)" >&2; exit 1; }
fi
stamp() { echo ".venv/.installed-$(cat "$1" requirements.txt | sha256sum | cut -c1-16)"; }
# The test tools' install (requirements-dev.txt: -r requirements.txt) holds the training requirements too.
if [[ ! -f $(stamp "$reqs") && ! ( $reqs == requirements.txt && -f $(stamp requirements-dev.txt) ) ]]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  # --no-cache-dir: pip would keep a second copy of every downloaded wheel (~4 GB with torch's CUDA libraries) in
  # ~/.cache/pip, and a full disk once ended a CI run in the middle of this install.
  .venv/bin/python -m pip install --quiet --no-compile --no-cache-dir -r "$reqs"
  # pip byte-compiles the ~15,000 installed modules one at a time (~60 s on 2 cores); compileall uses every core
  # (~35 s on 2). A module this Python cannot compile (torch ships a 3.12-only test file) is skipped, as pip skips it.
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  .venv/bin/python -m compileall -q -j0 "$site" >/dev/null 2>&1 || true
  touch "$(stamp "$reqs")"
fi
echo "venv ready: .venv ($(.venv/bin/python --version), $reqs); in a shell: source .venv/bin/activate"
