#!/usr/bin/env bash
# Train the default recipe (DCGAN on the bundled digits). Extra arguments go to `ganscale train`,
# e.g. scripts/train.sh --nproc 2, or scripts/train.sh ring8 --set train.steps=1000.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
exec "$venv"/bin/ganscale train "$@"
