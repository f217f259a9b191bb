#!/usr/bin/env bash
# Everything a lent GPU session measures, in one call of at most 10 minutes, for a CUDA machine whose Python
# has CUDA PyTorch, NumPy, scikit-learn, transformers, peft, timm and torchvision but not this project's
# other dependencies, and no network:
#
#   bash scripts/gpu_check.sh --fetch && bash scripts/gpu_families.sh --fetch   # here, with a network
#   bash scripts/gpu_session.sh --out DIR                                       # there, .gpu-wheels carried
#
# It installs the wheels once into a temporary directory (SciPy only where the machine has none; nothing
# else is touched) and runs, each step under its own time limit so that a slow or crashing step costs only
# its own output, and each step's log written beside its results in DIR:
#   0. where a captured model's CUDA graph memory goes (benchmarks/graph_pool.py, cnn, mlp, ResNet-18-GN and ViT
#      at 256, graph_pool_cuda.md): 75 s, only when SESSION_STEPS names it (pool);
#   1. the CUDA tests (tests/test_devices.py, tests/test_noise.py, tests/test_captured_passes.py,
#      tests/test_streamed_pieces.py but its CPU memory test, tests/test_per_example_calls.py, the noise sources'
#      test of tests/test_dpsgd.py): 130 s (on an H200 they took over 100 s);
#   2. the model families at base size, batch 256 (benchmarks/families.py, families_cuda.{md,json}): 215 s;
#   3. the speed table, one process per model and batch set (benchmarks/speed.py, speed_cuda_<model><batch>/):
#      mlp and cnn at batches 512 and 4096, wrn-16-4 at 512, then at 4096 (8 rounds, without the chunked
#      non-private and one-chunk rows): 220 s in all (with the eager row, dpml-eager);
#   2b. ViT and ResNet-18-GN as in 2 with --keep-share 0 (families_cuda_keep0.{md,json}): what the kept
#      per-example gradients cost in memory (ViT's eager step peaked at 1.53x) and buy in time; then WRN-16-4 at
#      512 with --keep-share 1 and at 256 with 4 (speed_cuda_wrn*_keep*/): 170 s, only when SESSION_STEPS names
#      it (keep);
#   4. where ResNet-18's and ViT's DP steps spend their time (benchmarks/speed_profile.py, base size, batch 256,
#      families_profile_cuda.md), then the encoder's beside BERT's (batch 64, encoder_profile_cuda.md): 90 s, only
#      when SESSION_STEPS names it;
#   5. grouped and depthwise convolutions' per-example ways and the engine's pick (benchmarks/grouped_conv_ways.py,
#      grouped_conv_ways_cuda.md): 15 s, only when SESSION_STEPS names it;
#   6. peft's adapters on BERT (base size, batch 256, families_peft_cuda.{md,json}; never measured on a GPU, their
#      weights built by computations on parameters crossed as one graph): 150 s, only when SESSION_STEPS names it
#      (peft);
#   7. the mixtures of experts at small size, batch 256 (Mixtral, Qwen2-MoE, Qwen3-MoE with torch._grouped_mm, and
#      Mixtral's eager experts; families_moe_cuda.{md,json}; their ragged rows never measured on a GPU): 120 s, only
#      when SESSION_STEPS names it (moe);
#   8. torch's own layers and parametrizations at small size, batch 256 (benchmarks/layer_zoo.py through
#      families.py, families_layers_cuda.{md,json}; never measured on a GPU): 90 s, only when SESSION_STEPS names it
#      (layers).
# Steps 1-3 take at most 565 s and about 20 s to install: one call, with the machine's start (about 30 s on an
# H200), inside a session's 15 minutes of device time, leaving room for one short second call.
# SESSION_STEPS="pool tests families keep speed profile grouped peft moe layers" picks steps (default: tests families speed);
# SESSION_PACK=1 leaves DIR holding one archive, session.tar.gz, of everything it wrote (for a transfer that counts
# files); SESSION_DRY=FILE runs nothing, on any machine, and writes each step's command to FILE, one a line, quoted
# for the shell (tests/test_gpu_session.py checks that the scripts take them, so that a renamed option does not
# cost a lent session). The exit status is the tests'.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
OUT=benchmarks/results
[ "${1:-}" = "--out" ] && OUT=${2:?--out needs a folder}
mkdir -p "$OUT"
STEPS=${SESSION_STEPS:-tests families speed}
say() { echo "[gpu-session $(date -u +%H:%M:%S)] $*"; }
DRY=${SESSION_DRY:-}
step() {  # a step's command, run (or, dry, written down)
  if [ -n "$DRY" ]; then printf '%q ' "$@" >> "$DRY" && echo >> "$DRY"; else "$@"; fi
}
families_step() {  # a step of benchmarks/families.py on the GPU: its log's name, its seconds, then its options
  local name=$1 limit=$2
  shift 2
  step timeout "$limit" python3 benchmarks/families.py --device cuda "$@" --out "$OUT" > "$OUT/$name.log" 2>&1
  say "$name: exit $?"
}
if [ -n "$DRY" ]; then
  : > "$DRY"
else
  [ -d "$WHEELS" ] || { say "no $WHEELS/: fetch the wheels first where there is a network" >&2; exit 2; }
  python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || { say "torch sees no CUDA device" >&2; exit 2; }
  site=$(mktemp -d)
  wheels=()
  for wheel in "$WHEELS"/*.whl; do
    case "${wheel##*/}" in scipy-*) python3 -c "import scipy" 2>/dev/null && continue ;; esac
    wheels+=("$wheel")
  done
  say "installing ${#wheels[@]} wheels into a temporary directory"
  python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}" || exit
  export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
  python3 -c "import torch; print('[gpu-session]', torch.cuda.get_device_name(0), 'torch', torch.__version__)" | tee "$OUT/device.txt"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$OUT/device.txt" 2>/dev/null
fi
status=0
if [[ " $STEPS " == *" pool "* ]]; then
  say "0. where a captured model's CUDA graph memory goes"
  step timeout 75 python3 benchmarks/graph_pool.py --device cuda --models cnn mlp resnet18-gn vit --batch 256 \
    --size base --out "$OUT" > "$OUT/pool.log" 2>&1
  say "pool: exit $?"; grep -E "^\| [a-z]" "$OUT/graph_pool_cuda.md" 2>/dev/null
fi
if [[ " $STEPS " == *" tests "* ]]; then
  say "1. the CUDA tests"
  step timeout 130 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_devices.py tests/test_noise.py \
    tests/test_captured_passes.py tests/test_streamed_pieces.py tests/test_per_example_calls.py \
    tests/test_stitched_pull_back.py tests/test_dpsgd.py::test_every_noise_source_gives_each_trainable_parameter_its_noise \
    -k "not wide_resnet_peaks" -rs \
    2>&1 | tee "$OUT/tests.log"
  status=${PIPESTATUS[0]}
fi
if [[ " $STEPS " == *" families "* ]]; then
  say "2. the model families"
  families_step families 215 --size base --batch 256 --length 128 --rounds 6 --peer-rounds 1 --family-timeout 55 \
    --total-timeout 200 --families bert-lora vit resnet18-gn bert encoder gpt2
  tail -n 25 "$OUT/families.log"
fi
if [[ " $STEPS " == *" keep "* ]]; then
  say "2b. ViT and ResNet-18-GN with no per-example gradients kept beyond what keeping frees"
  families_step families_keep0 60 --size base --batch 256 --length 128 --rounds 6 --peers --keep-share 0 \
    --family-timeout 28 --total-timeout 56 --families vit resnet18-gn --stem families_cuda_keep0
  tail -n 12 "$OUT/families_keep0.log"
  # WRN-16-4 (GPU-bound: its layers not kept take a second weight-gradient pass in full float32) keeping more: at 512
  # up to what its pass holds; at 256 every layer (a share of 4), as a step of 512 in two chunks could if the budget
  # were counted against the non-private step at the step's batch (its memory against non-private's at 512, by hand)
  for spec in "512|1" "256|4"; do
    IFS='|' read -r batch share <<< "$spec"
    step timeout 55 python3 benchmarks/speed.py --device cuda --models wrn --batches "$batch" --rounds 8 --peers \
      --skip nonprivate-chunked dpml-one-chunk --keep-share "$share" --out "$OUT/speed_cuda_wrn${batch}_keep$share" \
      > "$OUT/speed_wrn${batch}_keep$share.log" 2>&1
    say "keep wrn $batch, share $share: exit $?"
    grep -E "^\| [0-9a-z]" "$OUT/speed_cuda_wrn${batch}_keep$share/speed_cuda.md" 2>/dev/null | cut -c1-150
  done
fi
if [[ " $STEPS " == *" speed "* ]]; then
  say "3. the speed table"
  # model|batches|seconds|options after the common ones (a later --rounds wins)
  for spec in "mlp|512 4096|40|" "cnn|512 4096|50|" "wrn|512|55|" \
      "wrn|4096|75|--rounds 8 --skip nonprivate-chunked dpml-one-chunk"; do
    IFS='|' read -r model batches limit extra <<< "$spec"
    name=$model${batches// /_}
    # shellcheck disable=SC2086  # batches and extra are word lists
    step timeout "$limit" python3 benchmarks/speed.py --device cuda --models "$model" --batches $batches --rounds 20 \
      --peer-rounds 2 $extra --out "$OUT/speed_cuda_$name" > "$OUT/speed_$name.log" 2>&1
    say "speed $name: exit $?"; grep -E "^\| [0-9]" "$OUT/speed_cuda_$name/speed_cuda.md" 2>/dev/null | cut -c1-150
  done
fi
if [[ " $STEPS " == *" profile "* ]]; then
  say "4. where the families' DP steps spend their time"
  step timeout 30 python3 benchmarks/speed_profile.py --device cuda --models resnet18-gn vit --size base --batch 256 \
    --repeats 10 --ops 15 --out "$OUT" --out-name families_profile_cuda.md > "$OUT/profile.log" 2>&1
  say "profile: exit $?"; grep -E "^\| [a-z]" "$OUT/families_profile_cuda.md" 2>/dev/null
  # the encoder's DP step ran at 0.52 where BERT's, the same shapes, ran at 0.89: the two side by side
  step timeout 60 python3 benchmarks/speed_profile.py --device cuda --models encoder bert --size base --batch 64 \
    --repeats 3 --ops 20 --out "$OUT" --out-name encoder_profile_cuda.md > "$OUT/profile_encoder.log" 2>&1
  say "profile encoder: exit $?"; grep -E "^\| [a-z]" "$OUT/encoder_profile_cuda.md" 2>/dev/null
fi
if [[ " $STEPS " == *" grouped "* ]]; then
  say "5. grouped and depthwise convolutions' per-example ways"
  step timeout 15 python3 benchmarks/grouped_conv_ways.py --device cuda --repeats 5 --out "$OUT" > "$OUT/grouped.log" 2>&1
  say "grouped: exit $?"; grep -E "^\| [A-Z]" "$OUT/grouped_conv_ways_cuda.md" 2>/dev/null | cut -c1-160
fi
if [[ " $STEPS " == *" peft "* ]]; then
  say "6. peft's adapters on BERT"
  families_step peft 150 --size base --batch 256 --length 128 --rounds 4 --peers --family-timeout 18 \
    --total-timeout 140 --families peft --stem families_peft_cuda
  grep -E "^\| bert" "$OUT/families_peft_cuda.md" 2>/dev/null | cut -c1-160
fi
if [[ " $STEPS " == *" moe "* ]]; then
  say "7. the mixtures of experts"
  families_step moe 120 --size small --batch 256 --length 128 --rounds 4 --family-timeout 28 --total-timeout 110 \
    --families mixtral qwen2-moe qwen3-moe mixtral-eager --stem families_moe_cuda
  grep -E "^\| [a-z]" "$OUT/families_moe_cuda.md" 2>/dev/null | cut -c1-160
fi
if [[ " $STEPS " == *" layers "* ]]; then
  say "8. torch's own layers and parametrizations"
  families_step layers 90 --size small --batch 256 --length 128 --rounds 4 --peers --family-timeout 12 \
    --total-timeout 80 --families layers --stem families_layers_cuda
  grep -E "^\| layer" "$OUT/families_layers_cuda.md" 2>/dev/null | cut -c1-160
fi
if [ "${SESSION_PACK:-0}" = 1 ] && [ -z "$DRY" ]; then
  tar -czf /tmp/gpu-session.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu-session.tar.gz "$OUT/session.tar.gz"
  say "packed into $OUT/session.tar.gz"
fi
exit $status
