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
# The pinned torch (requirements.txt) has wheels for Python 3.11 and later only: on 3.10 the install ended in the
# resolver's "No solution found" after the venv was made. Said first, for the Python that makes the venv or made it.
old_python() {
  "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' && return 1
  echo "error: $2 is Python $("$1" -c 'import platform; print(platform.python_version())'), and the pinned torch" \
    "$(sed -n 's/^torch==//p' requirements.txt) needs Python 3.11 or later: $3" >&2
}

if [[ ! -x .venv/bin/python ]]; then
  if old_python "$python" "$python" "install Python 3.11+ and run PYTHON=python3.11 bash scripts/setup_env.sh"; then
    exit 1
  fi
  "$python" -m venv .venv || { echo "error: could not create .venv: install python3-venv (Debian: apt-get install python3-venv)" >&2; exit 1; }
elif old_python .venv/bin/python .venv "remove it (rm -rf .venv) and run PYTHON=python3.11 bash scripts/setup_env.sh"; then
  exit 1
fi
stamp() { echo ".venv/.installed-$(cat "$1" requirements.txt | sha256sum | cut -c1-16)"; }
# The test tools' install (requirements-dev.txt: -r requirements.txt) holds the training requirements too.
# Room for the install, checked before it starts: a CI run once ended 11 s into it on pip's "[Errno 28] No space left on
# device", its disk filled by earlier runs' files. PyPI's Linux torch is a CUDA build: the venv takes 6.1 GB (torch,
# nvidia and triton 5.2 of it), and pip keeps the downloaded wheels in TMPDIR until they are installed. Without torch
# to install (a cluster's own build of the pinned version already in the venv) the rest takes under 1 GB.
room() {
  local pinned torch need_gb=10 free_kb
  pinned=$(sed -n 's/^torch==//p' requirements.txt)
  torch=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
  [[ -n $pinned && $torch == "$pinned"* ]] && need_gb=2
  # The venv's file system and pip's temporary one, each counted once
  free_kb=$(df -Pk .venv "${TMPDIR:-/tmp}" | awk 'NR > 1 && !seen[$6]++ { kb += $4 } END { print kb }')
  if (( free_kb < need_gb * 1048576 )); then
    echo "error: the install needs about $need_gb GB free and $(( free_kb / 1024 )) MB are free in $PWD/.venv and" \
      "${TMPDIR:-/tmp}: free disk space (old venvs, checkpoints, /tmp), or point TMPDIR at a larger disk" >&2
    exit 1
  fi
}
# uv installs the same pinned set as pip, downloading and unpacking in parallel: on the 2-core VM 34 s, against 63 s
# for pip and 21 s for byte-compiling what pip installed (session 74, a fresh venv each). uv reads no pip
# configuration: the indexes and wheel folders that pip.conf or PIP_* name are handed to it, and pip's choice among
# indexes (the best match of all) is asked for. Any other pip setting (a proxy, a trusted host, ...) leaves the
# install to pip, as does a uv that cannot be installed or that fails.
UV_PIN=uv==0.13.9
uv_settings() {
  local line key value v index=""
  UV_ARGS=(--index-strategy unsafe-best-match) UV_ENV=()
  while IFS= read -r line; do  # `global.find-links='/opt/wheels'`, `:env:.cert='...'`
    key=${line%%=*} value=${line#*=}
    key=${key#*.} value=${value#\'} value=${value%\'}
    case $key in
      index-url) index=$value ;;  # the last named: PIP_INDEX_URL (listed after the files) over pip.conf, as in pip
      extra-index-url) for v in $value; do UV_ARGS+=(--extra-index-url "$v"); done ;;
      find-links) for v in $value; do UV_ARGS+=(--find-links "$v"); done ;;
      cert) UV_ENV+=("SSL_CERT_FILE=$value") ;;
      default-timeout) UV_ENV+=("UV_HTTP_TIMEOUT=${value%.*}") ;;
      disable-pip-version-check | no-cache-dir | quiet | progress-bar | no-color | root-user-action) ;;
      *) return 1 ;;
    esac
  done < <(.venv/bin/python -m pip config list 2>/dev/null)
  [[ -z $index ]] || UV_ARGS+=(--index-url "$index")
}
install_with_uv() {
  uv_settings || return 1
  .venv/bin/python -m pip install --quiet --no-cache-dir "$UV_PIN" >/dev/null 2>&1 && [[ -x .venv/bin/uv ]] || return 1
  # Its cache beside the venv, on the same file system: the files are hard-linked into the venv, not copied, and the
  # cache is removed after (a second copy of ~6 GB, as pip's own cache would keep).
  local cache=.venv/.uv-cache rc=0
  env ${UV_ENV[@]+"${UV_ENV[@]}"} .venv/bin/uv pip install --quiet --python .venv/bin/python --cache-dir "$cache" \
    --compile-bytecode "${UV_ARGS[@]}" -r "$reqs" || rc=$?
  rm -rf "$cache"
  ((rc == 0)) || { echo "warning: uv could not install $reqs (its error above): installing with pip" >&2; return 1; }
}
install_with_pip() {
  # --no-cache-dir: pip would keep a second copy of every downloaded wheel (~4 GB with torch's CUDA libraries) in
  # ~/.cache/pip, and a full disk once ended a CI run in the middle of this install.
  .venv/bin/python -m pip install --quiet --no-compile --no-cache-dir -r "$reqs"
  # pip byte-compiles the ~15,000 installed modules one at a time (~60 s on 2 cores); compileall uses every core
  # (~21-35 s on 2). A module this Python cannot compile (torch ships a 3.12-only test file) is skipped, as pip skips it.
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  .venv/bin/python -m compileall -q -j0 "$site" >/dev/null 2>&1 || true
}
if [[ ! -f $(stamp "$reqs") && ! ( $reqs == requirements.txt && -f $(stamp requirements-dev.txt) ) ]]; then
  room
  .venv/bin/python -m pip install --quiet --upgrade pip
  install_with_uv || install_with_pip
  touch "$(stamp "$reqs")"
fi
echo "venv ready: .venv ($(.venv/bin/python --version), $reqs); in a shell: source .venv/bin/activate"
