#!/usr/bin/env bash
# The GPU checks in one run, for a CUDA machine whose Python has CUDA PyTorch, NumPy and scikit-learn but
# not this project's other dependencies, and no network:
#
#   bash scripts/gpu_check.sh --fetch [PYTHON_VERSION]   # here, with a network: the missing pure and binary
#                                                       # wheels into .gpu-wheels/ (default Python 3.12)
#   bash scripts/gpu_check.sh [--out DIR]                # there: installs them into a temporary directory
#                                                       # (nothing else is touched), runs the CUDA tests,
#                                                       # writes speed_cuda.{md,json} and speed_profile_cuda.md
#                                                       # into DIR (default benchmarks/results)
#
# The CUDA tests are those tests/test_devices.py skips without a GPU (the engine on CUDA, TF32 off in
# the norms and sums, the bounded number of host synchronisations, the CPU step's law on the GPU) and
# the noise tests (the Box–Muller draw on CUDA uniforms), and the chunk tuner on the GPU. Each step says what
# it runs, under a time limit, so that the whole fits one 10-minute call; the exit status is the tests'
# (the speed table and the profile run either way). NCCL needs two GPUs: it is not exercised on one.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
# what the CUDA tests and speed.py import beyond torch, NumPy, SciPy and scikit-learn (pinned as in requirements.lock)
BINARY=(dp-accounting==0.6.0 dm-tree==0.1.10 prv-accountant==0.2.0 pydantic==2.14.3 pydantic_core==2.50.4
        annotated-types==0.8.0 typing-inspection==0.4.5 pytz==2026.6 wcwidth==0.9.4 pydot==4.0.1 opacus==1.6.0
        typing_extensions==4.16.0 PyYAML==6.0.3 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.3
        Pygments==2.21.0)
if [ "${1:-}" = "--fetch" ]; then
  version=${2:-3.12}
  mkdir -p "$WHEELS"
  echo "[gpu-check] wheels for Python $version (manylinux x86_64) into $WHEELS/"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --dest "$WHEELS" "${BINARY[@]}" || exit
  python3 -m pip wheel --quiet --no-deps --wheel-dir "$WHEELS" autodp==0.2.3.1 || exit  # a source release only
  ls "$WHEELS"
  exit 0
fi
RESULTS=benchmarks/results
[ "${1:-}" = "--out" ] && RESULTS=${2:?--out needs a folder}
mkdir -p "$RESULTS"
[ -d "$WHEELS" ] || { echo "[gpu-check] no $WHEELS/: run 'bash scripts/gpu_check.sh --fetch' where there is a network" >&2; exit 2; }
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "[gpu-check] torch sees no CUDA device here" >&2; exit 2; }
site=$(mktemp -d)
echo "[gpu-check] installing $(ls "$WHEELS" | wc -l) wheels into a temporary directory"
python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$WHEELS"/*.whl || exit
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
python3 -c "import torch; print('[gpu-check]', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
echo "[gpu-check] the CUDA tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_devices.py tests/test_noise.py -rs
status=$?
echo "[gpu-check] the GPU speed table ($RESULTS/speed_cuda.md)"
timeout 240 python3 benchmarks/speed.py --device cuda --models mlp cnn wrn --rounds 40 --peer-rounds 5 --out "$RESULTS"
echo "[gpu-check] where the GPU step's time goes ($RESULTS/speed_profile_cuda.md)"
timeout 90 python3 benchmarks/speed_profile.py --device cuda --models mlp cnn wrn --ops 12 --out "$RESULTS" \
  2>&1 | grep -v '^USDT'
exit $status
