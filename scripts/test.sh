#!/usr/bin/env bash
# Run the test suite (CPU, gloo, 2-process tests included). Extra arguments go to pytest.
# Two tests at a time (pytest-xdist; GANSCALE_TEST_WORKERS, 0 for one process): most of a test's time is its
# processes starting and waiting on each other, which leaves a core idle. Tests marked `alone` (the real-Slurm
# ones: one test cluster, and job timing that another test's load upsets) run after, one at a time;
# GANSCALE_TEST_ALONE=0 leaves them out.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$root"  # the suite and its pytest settings are the checkout's
workers="${GANSCALE_TEST_WORKERS:-2}"
if [ "$workers" = 0 ]; then
  exec "$venv"/bin/python -m pytest -q "$@"
fi
# One math thread per process: each test's processes share the two cores with the other's, and OpenMP's threads
# spinning beside them cost a fifth more CPU (tests/test_distributed.py, measured).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
status=0
"$venv"/bin/python -m pytest -q -n "$workers" -m "not alone" "$@" || status=$?
alone=5
if [ "${GANSCALE_TEST_ALONE:-1}" != 0 ]; then
  alone=0
  "$venv"/bin/python -m pytest -q -m alone "$@" || alone=$?
fi
# 5: pytest found no test to run (a selection that leaves out one of the two parts)
if [ "$status" = 5 ]; then status=$alone; elif [ "$alone" != 5 ] && [ "$status" = 0 ]; then status=$alone; fi
exit "$status"
