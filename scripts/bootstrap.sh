#!/usr/bin/env bash
# Create the venv (once) and install ganscale into it. Sourced by scripts/train.sh and scripts/test.sh; it leaves
# the current directory as it was (train.sh reads a config, data and --run-dir from the caller's folder).
#
#   GANSCALE_VENV   the venv folder (default .venv in the checkout; a relative path is from the current
#                   directory), e.g. .venv-torch2.14 for a second environment
#   GANSCALE_TORCH  the torch version the venv must hold (2.14: any 2.14.x; 2.14.1: that release), installed when
#                   it does not; without it, 2.13.0 is installed when the venv's torch is missing or out of range
#   GANSCALE_EXTRAS ganscale's extras to install (default test), e.g. test,tensorflow
#
# A torch already in the venv is kept when it is inside ganscale's supported range (src/ganscale/versions.py)
# and, if GANSCALE_TORCH is set, of that version; replacing one says so in one line. Otherwise torch is installed
# as pip's index offers it (2.13.0 is the CPU build pip finds here: no CUDA packages on a machine without a GPU;
# see README). A GANSCALE_TORCH outside the range, or a GANSCALE_VENV that is a folder but not a venv, is refused
# (one line, exit 2) before anything is installed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
venv="${GANSCALE_VENV:-$root/.venv}"
case "$venv" in /*) ;; *) venv="$PWD/$venv" ;; esac  # from the caller's directory
wanted="${GANSCALE_TORCH:-}"
extras="${GANSCALE_EXTRAS:-test}"
if [ -e "$venv" ] && [ ! -x "$venv/bin/python" ] && { [ ! -d "$venv" ] || [ -n "$(ls -A "$venv")" ]; }; then
  echo "ganscale: GANSCALE_VENV=$venv is not a venv (no bin/python) and not an empty folder; set GANSCALE_VENV" \
       "to a venv or to a new folder" >&2
  exit 2
fi
# The venv's torch read from its metadata (no import: fast, and a broken torch is replaced, not fatal); before
# the venv exists the system Python answers for GANSCALE_TORCH alone. versions.py is loaded by path: ganscale
# may not be installed yet.
if [ -x "$venv/bin/python" ]; then probe="$venv/bin/python" new=""; else probe="$python" new=new; fi
plan="$("$probe" - "$root/src/ganscale/versions.py" "$venv" "$wanted" "$new" <<'PY'
import importlib.metadata, importlib.util, sys
spec = importlib.util.spec_from_file_location("versions", sys.argv[1])
versions = sys.modules["versions"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(versions)
venv, wanted, new = sys.argv[2:5]
try:
    installed = None if new else importlib.metadata.version("torch")
except importlib.metadata.PackageNotFoundError:
    installed = None
try:
    requirement, line = versions.bootstrap_torch(installed, wanted, venv)
except ValueError as refused:
    print(refused, file=sys.stderr)
    sys.exit(2)
print(f"{requirement or '-'}\t{line}")
PY
)" || exit $?
IFS=$'\t' read -r requirement line <<< "$plan"
if [ -n "$line" ]; then echo "$line" >&2; fi
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
stamp="$venv/.ganscale-installed"
if [ "$requirement" != - ]; then
  "$venv/bin/pip" install --quiet "$requirement"
fi
# The stamp holds the extras installed: other extras install again.
if [ "$requirement" != - ] || [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ] || [ "$(cat "$stamp")" != "$extras" ]; then
  "$venv/bin/pip" install --quiet -e "$root[$extras]"
  echo "$extras" > "$stamp"
fi
