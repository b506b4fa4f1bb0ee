#!/usr/bin/env bash
# Run the test suite (CPU, gloo, 2-process tests included). Extra arguments go to pytest.
# Two tests at a time (pytest-xdist; GANSCALE_TEST_WORKERS, 0 for one process): most of a test's time is its
# processes starting and waiting on each other, which leaves a core idle. The real-Slurm tests share one worker
# (xdist_group "slurm"): they share one test cluster.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
exec "$venv"/bin/python -m pytest -q -n "${GANSCALE_TEST_WORKERS:-2}" --dist loadgroup "$@"
