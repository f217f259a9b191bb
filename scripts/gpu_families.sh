#!/usr/bin/env bash
# The model-family benchmark (benchmarks/families.py) on a GPU in one run, for a CUDA machine whose Python
# has CUDA PyTorch, NumPy, transformers, peft, timm and torchvision but not Opacus, and no network:
#
#   bash scripts/gpu_families.sh --fetch [PYTHON_VERSION]   # here, with a network: Opacus and what it imports
#                                                          # beyond torch and NumPy (opt_einsum; SciPy, used
#                                                          # only where the GPU machine has none) into
#                                                          # .gpu-wheels/ (default Python 3.12)
#   bash scripts/gpu_families.sh [--out DIR]                # there: installs the missing ones into a temporary
#                                                          # directory (nothing else is touched) and writes
#                                                          # families_cuda.{md,json} into DIR
#                                                          # (default benchmarks/results)
#
# The run: every family at the base size (BERT-base / GPT-2 small shapes, ViT-Tiny, ResNet-18), batch 256,
# sequences of 128 tokens, each family in a process of its own under 150 s and all of them under 470 s
# (a family that runs out of its time, or is not started for want of it, gets a row saying so), so that
# the whole fits one 10-minute call with the machine's start. FAMILIES_SIZE=small or FAMILIES_TIMEOUT=SECONDS
# change the size and the per-family limit. The wheels travel with the working tree: carry .gpu-wheels.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
PURE=(opacus==1.6.0 opt_einsum==3.4.0)  # as benchmarks/requirements.txt
SCIPY=scipy==1.17.1                     # Opacus imports it; installed only where it is missing
if [ "${1:-}" = "--fetch" ]; then
  version=${2:-3.12}
  mkdir -p "$WHEELS"
  echo "[gpu-families] wheels for Python $version (manylinux x86_64) into $WHEELS/"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --dest "$WHEELS" "${PURE[@]}" "$SCIPY" || exit
  ls "$WHEELS"
  exit 0
fi
RESULTS=benchmarks/results
[ "${1:-}" = "--out" ] && RESULTS=${2:?--out needs a folder}
mkdir -p "$RESULTS"
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "[gpu-families] torch sees no CUDA device here" >&2; exit 2; }
site=$(mktemp -d)
wanted=()
python3 -c "import opacus" 2>/dev/null || wanted+=("$WHEELS"/opacus-1.6.0-*.whl)
python3 -c "import opt_einsum" 2>/dev/null || wanted+=("$WHEELS"/opt_einsum-3.4.0-*.whl)
python3 -c "import scipy" 2>/dev/null || wanted+=("$WHEELS"/scipy-1.17.1-*.whl)
if [ ${#wanted[@]} -gt 0 ]; then
  for wheel in "${wanted[@]}"; do
    [ -f "$wheel" ] || { echo "[gpu-families] $wheel is missing: run 'bash scripts/gpu_families.sh --fetch' where there is a network" >&2; exit 2; }
  done
  echo "[gpu-families] installing ${#wanted[@]} wheel(s) into a temporary directory: ${wanted[*]##*/}"
  python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wanted[@]}" || exit
fi
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -c "import torch; print('[gpu-families]', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
python3 -c "import opacus, transformers, peft; print('[gpu-families] opacus', opacus.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" || exit
echo "[gpu-families] the families table ($RESULTS/families_cuda.md)"
# the cheapest plans first (LoRA's few trainable parameters, then the vision models), so that a slow
# base-size plan (its float64 reference runs on the CPU) costs only its own row
timeout 500 python3 benchmarks/families.py --device cuda --size "${FAMILIES_SIZE:-base}" --batch 256 --length 128 \
  --rounds 8 --peer-rounds 2 --family-timeout "${FAMILIES_TIMEOUT:-150}" --total-timeout 470 \
  --families bert-lora vit resnet18-gn bert encoder gpt2 --out "$RESULTS"
