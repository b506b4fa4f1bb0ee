#!/usr/bin/env bash
# Check ganscale on a CUDA GPU machine from this checkout, no install with network:
#   scripts/gpu-check.sh [--part 1|2|3|all] [--wheels DIR] [--out DIR]
# Results: benchmarks/results/gpu-check-<date>-<gpu>/ (summary.md, results.json, logs).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
