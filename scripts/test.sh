#!/usr/bin/env bash
# Install everything, then run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The model libraries of the `models` extra (tests/test_library_models.py), pinned in their own lock with the
# runtime lock as constraints: test and benchmark extras, never runtime dependencies (docs: Your own model).
echo "[test] installing the model libraries pinned in requirements-models.lock (pip's lines: build/setup.log)"
if ! .venv/bin/python -m pip install --progress-bar off -r requirements-models.lock -c requirements.lock \
    >> build/setup.log 2>&1; then
  echo "[test] failed: installing requirements-models.lock (the last lines of build/setup.log below)" >&2
  tail -n 30 build/setup.log >&2
  exit 1
fi
# The documentation site's tools (tests/test_docs.py builds it with warnings as errors), pinned the same way.
echo "[test] installing the documentation tools pinned in requirements-docs.lock (pip's lines: build/setup.log)"
if ! .venv/bin/python -m pip install --progress-bar off -r requirements-docs.lock -c requirements.lock \
    >> build/setup.log 2>&1; then
  echo "[test] failed: installing requirements-docs.lock (the last lines of build/setup.log below)" >&2
  tail -n 30 build/setup.log >&2
  exit 1
fi
# Headless Chromium for the MLflow UI test (tests/test_review_desk.py): Debian's package, installed only when
# missing and only where we may (root with apt-get); otherwise that test skips and says why.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing chromium (headless browser for the MLflow UI test)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "chromium could not be installed: the MLflow UI browser test will skip"
fi
export PATH="$PWD/.venv/bin:$PATH"
# One pytest worker per CPU, at most 4 (pytest-xdist; `-n 0` after these runs them in this process): most tests
# wait on a subprocess, a server or a single-threaded step, so one at a time leaves a core idle. With a worker
# on each core, torch's intra-op threads (one per core by default, in every worker and every process a test
# starts) would only contend: one each, unless the caller chose (tests of threaded code set their own count).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m pytest -n logical --maxprocesses 4 --dist worksteal "$@"
