#!/usr/bin/env bash
# Create .venv (if needed) and install dpml with every dependency pinned (requirements.lock).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade "pip==26.3"
.venv/bin/python -m pip install --quiet -r requirements.lock
.venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
