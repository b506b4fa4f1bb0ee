#!/usr/bin/env bash
# Run the test suite (CPU, gloo, 2-process tests included). Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
exec "$venv"/bin/python -m pytest -q "$@"
