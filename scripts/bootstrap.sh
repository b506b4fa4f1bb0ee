#!/usr/bin/env bash
# Create .venv (once) and install ganscale into it. Sourced by scripts/train.sh and scripts/test.sh.
#
# Installs torch 2.13.0 first, as pip's index offers it (PIP_INDEX_URL picks the CPU or a CUDA build;
# see README), unless torch 2.13 is already in .venv: a build installed there beforehand is kept.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
stamp=".venv/.ganscale-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  if ! .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13') else 1)" 2>/dev/null; then
    .venv/bin/pip install --quiet "torch==2.13.0"
  fi
  .venv/bin/pip install --quiet -e ".[test]"
  touch "$stamp"
fi
