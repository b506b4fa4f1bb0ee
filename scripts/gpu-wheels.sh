#!/usr/bin/env bash
# Build the wheel folder gpu-check.sh installs missing dependencies from (everything but torch):
#   scripts/gpu-wheels.sh DIR [PYTHON_VERSION]   e.g. scripts/gpu-wheels.sh wheels 3.12
# Binary wheels for manylinux x86_64 only, so the folder installs on a machine without network or compiler.
set -euo pipefail
dir=${1:?usage: scripts/gpu-wheels.sh DIR [PYTHON_VERSION]}
version=${2:-3.11}
cd "$(dirname "$0")/.."
"${PYTHON:-python3}" -m pip download --dest "$dir" --only-binary=:all: \
    --python-version "$version" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --implementation cp \
    -r scripts/gpu-requirements.txt
du -sh "$dir"
