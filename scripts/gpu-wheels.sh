#!/usr/bin/env bash
# Build the wheel folder gpu-check.sh installs missing dependencies from (never torch: the machine's own is used):
#   scripts/gpu-wheels.sh DIR PYTHON_VERSION [PACKAGE...]   e.g. scripts/gpu-wheels.sh .whl 3.12 pydantic
# PYTHON_VERSION is the GPU machine's (`python3 --version` there), not this one's: compiled wheels fit one version.
# With no PACKAGE, all of ganscale's dependencies but torch (about 85 MiB for cp312, over a 64 MiB carry); name
# only what the machine lacks to keep it small. Binary manylinux x86_64 wheels only: no compiler needed there.
set -euo pipefail
usage="usage: scripts/gpu-wheels.sh DIR PYTHON_VERSION [PACKAGE...] (the GPU machine's Python, e.g. 3.12)"
dir=${1:?$usage}
version=${2:?$usage}
cd "$(dirname "$0")/.."
if [ $# -gt 2 ]; then wanted=("${@:3}"); else mapfile -t wanted < <("${PYTHON:-python3}" scripts/gpu_check.py --requirements); fi
"${PYTHON:-python3}" -m pip download --dest "$dir" --only-binary=:all: \
    --python-version "$version" --implementation cp --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
    "${wanted[@]}"
du -sh "$dir"
