#!/usr/bin/env bash
# Create the venv (once) and install ganscale into it. Sourced by scripts/train.sh and scripts/test.sh.
#
#   GANSCALE_VENV   the venv folder (default .venv), e.g. .venv-torch2.14 for a second environment
#   GANSCALE_TORCH  the torch version to install when the venv's torch does not fit (default 2.13.0)
#   GANSCALE_EXTRAS ganscale's extras to install (default test), e.g. test,tensorflow
#
# A torch already in the venv is kept when it is inside ganscale's supported range (src/ganscale/versions.py)
# and, if GANSCALE_TORCH is set, of that version. Otherwise torch is installed as pip's index offers it
# (2.13.0 is the CPU build pip finds here: no CUDA packages on a machine without a GPU; see README).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
venv="${GANSCALE_VENV:-.venv}"
wanted="${GANSCALE_TORCH:-}"
extras="${GANSCALE_EXTRAS:-test}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
stamp="$venv/.ganscale-installed"
# 0 when the venv's torch is in the supported range (and is GANSCALE_TORCH, when set); versions.py is read
# without importing ganscale, which may not be installed yet.
torch_fits() {
  GANSCALE_TORCH="$wanted" "$venv/bin/python" - "$root/src/ganscale/versions.py" <<'PY' 2>/dev/null
import importlib.util, os, sys, torch
spec = importlib.util.spec_from_file_location("versions", sys.argv[1])
versions = sys.modules["versions"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(versions)
in_range, parse, wanted = versions.in_range, versions.parse, os.environ["GANSCALE_TORCH"]
ok = in_range(torch.__version__) and (not wanted or parse(torch.__version__) == parse(wanted))
sys.exit(0 if ok else 1)
PY
}
# The stamp holds the extras installed: other extras install again.
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(cat "$stamp")" != "$extras" ] || ! torch_fits; then
  if ! torch_fits; then
    "$venv/bin/pip" install --quiet "torch==${wanted:-2.13.0}"
  fi
  "$venv/bin/pip" install --quiet -e ".[$extras]"
  echo "$extras" > "$stamp"
fi
