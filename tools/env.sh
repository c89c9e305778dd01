# Sourced by tools/gyre and tools/test: makes (once) and activates the Python
# environment this checkout needs, cached by a hash of its requirements so that a
# fresh clone on the same machine (CI) reuses it. Nothing is installed by hand.
#
#   GYRE_CACHE_DIR   where environments are kept (default ~/.cache/gyre_slurm)
#   GYRE_PYTHON      the interpreter to build from (default python3, >= 3.11)
set -euo pipefail
GYRE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GYRE_CACHE_DIR="${GYRE_CACHE_DIR:-$HOME/.cache/gyre_slurm}"
GYRE_PYTHON="${GYRE_PYTHON:-python3}"

_gyre_requirements() {
  # install_requires + the test extra, read from setup.cfg (the one source of truth).
  "$GYRE_PYTHON" - "$GYRE_ROOT/setup.cfg" <<'PY'
import configparser, sys
cfg = configparser.ConfigParser()
cfg.read(sys.argv[1])
lines = cfg["options"]["install_requires"].split("\n")
lines += cfg["options.extras_require"]["test"].split("\n")
print("\n".join(sorted(l.strip() for l in lines if l.strip())))
PY
}

_gyre_reqs="$(_gyre_requirements)"
# Pins for this machine kind (the CPU build of torch that pip finds locally): part of the key.
_gyre_constraints="$GYRE_ROOT/tools/constraints-cpu.txt"
_gyre_key="$( { "$GYRE_PYTHON" -c 'import sys; print(sys.version)'; echo "$_gyre_reqs";
               cat "$_gyre_constraints"; } | sha256sum | cut -c1-16)"
GYRE_VENV="$GYRE_CACHE_DIR/venv-core-$_gyre_key"

_gyre_build() {
  echo "gyre: building the Python environment $GYRE_VENV (once per requirements hash)" >&2
  rm -rf "$GYRE_VENV"
  "$GYRE_PYTHON" -m venv "$GYRE_VENV"
  echo "$_gyre_reqs" > "$GYRE_VENV/requirements.txt"
  "$GYRE_VENV/bin/python" -m pip install -q --disable-pip-version-check \
    -c "$_gyre_constraints" -r "$GYRE_VENV/requirements.txt" >&2
  touch "$GYRE_VENV/.complete"
}
mkdir -p "$GYRE_CACHE_DIR"
if [ ! -f "$GYRE_VENV/.complete" ]; then
  # One builder at a time; a half-built environment (no .complete) is rebuilt.
  exec 9>"$GYRE_VENV.lock"
  flock 9
  [ -f "$GYRE_VENV/.complete" ] || _gyre_build
  flock -u 9
  exec 9>&-
fi

export PYTHONPATH="$GYRE_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export GYRE_ROOT GYRE_VENV
PATH="$GYRE_VENV/bin:$PATH"
export PATH
