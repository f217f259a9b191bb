#!/usr/bin/env bash
# The main job: install everything, then run the full pipeline once on the default data set.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
dpml run "$@"
