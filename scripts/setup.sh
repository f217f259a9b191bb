#!/usr/bin/env bash
# Create .venv (if needed) and install dpml with every dependency pinned (requirements.lock).
# Says what it is doing in one line a step; pip's and npm's own lines go to build/setup.log, whose last lines
# are shown if a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
say() { echo "[setup] $*"; }
mkdir -p build
LOG="$PWD/build/setup.log"
: > "$LOG"
quietly() {  # run a step with its output in the log; on failure, say so and show the log's tail
  if ! "$@" >> "$LOG" 2>&1; then
    echo "[setup] failed: $* (the last lines of build/setup.log below)" >&2
    tail -n 30 "$LOG" >&2
    return 1
  fi
}
installed_after() {  # how many packages pip's "Successfully installed" line names, after line $1 of the log
  local line
  line=$(tail -n "+$(( $1 + 1 ))" "$LOG" | grep '^Successfully installed' | tail -n 1 || true)
  if [ -n "$line" ]; then echo $(( $(wc -w <<< "$line") - 2 )); else echo 0; fi
}
if [ ! -x .venv/bin/python ]; then
  say "creating the virtual environment .venv ($("$PY" --version 2>&1))"
  quietly "$PY" -m venv .venv
fi
quietly .venv/bin/python -m pip install --upgrade "pip==26.3"
packages=$(grep -cE '^[A-Za-z0-9]' requirements.lock)
say "installing ${packages} pinned packages from requirements.lock (a few minutes the first time, seconds afterwards)"
before=$(wc -l < "$LOG")
quietly .venv/bin/python -m pip install --progress-bar off -r requirements.lock
say "$(installed_after "$before") installed, the others were there already (pip's own lines: build/setup.log)"
quietly .venv/bin/python -m pip install --no-deps --no-build-isolation -e .
# `dvc plots show` offline: vega, vega-lite and vega-embed from npm, inlined in a page template.
if command -v npm >/dev/null 2>&1; then
  say "fetching vega, vega-lite and vega-embed (npm) for dvc plots show offline"
  mkdir -p build/npm
  (cd build/npm && quietly npm pack --silent vega@5.20.2 vega-lite@5.2.0 vega-embed@6.18.2)
  quietly .venv/bin/python scripts/build_plots_template.py build/npm build/dvc-plots-offline.html
  # and DVC told to use it (this checkout only: .dvc/config.local is not committed), so that a plain
  # `dvc plots show` renders offline; the path is relative to .dvc/
  .venv/bin/dvc config --local plots.html_template ../build/dvc-plots-offline.html
else
  echo "npm not found: dvc plots show needs a network for its charts (docs: Compare runs with DVC)" >&2
fi
say "done: $(.venv/bin/dpml --version)"
