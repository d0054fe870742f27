#!/usr/bin/env bash
# The GPU checks and benchmarks in one call (the lent GPU machine keeps nothing between calls).
#
#   source .device/setup.sh && bash tools/gpu_check.sh [tests|bench|all]
#
# The bundle (.device/, built once on the CPU machine) must carry the test dependencies the GPU
# image lacks:  EXTRA="hypothesis pytest-timeout" bash ../shared/tools/device-bundle.sh
# A whole `all` run takes about 8 minutes of device time (the tests alone about 4.5).
#
# tests: every test that needs CUDA (kernels compiled by real triton, models vs transformers on
#        the GPU, backends against each other, the model with --fused-kernels against the torch
#        path: tests/kernels/test_fused_model.py), plus the rest of tests/engine and tests/kernels.
# bench: tools/bench_offline.py on a random-weight llama-3.2-1b (bf16) for each attention backend,
#        the triton backend again with --fused-kernels (bench_triton_fused.txt), and triton at
#        batch 1 without and with --fused-kernels (bench_triton_bs1.txt, bench_triton_bs1_fused.txt).
# Results go to $OUT (or ./gpu-out) and a short summary to stdout.
set -uo pipefail
what=${1:-all}
out=${OUT:-gpu-out}
mkdir -p "$out"
# flashinfer JIT-builds its kernels on first use; keep them in the carried bundle (.device/fi-cache,
# brought back from $OUT/fi-cache.tar.gz after a call) so that a fresh machine need not rebuild them.
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/.device/fi-cache}
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
trap 'tar -czf "$out/fi-cache.tar.gz" -C "$FLASHINFER_WORKSPACE_BASE" . 2>/dev/null' EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
python -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1 | tee -a "$out/gpu.txt"

if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 420 python -m pytest -q -p no:cacheprovider tests/kernels tests/engine > "$out/pytest.txt" 2>&1
  echo "pytest exit $?"; grep -E "passed|failed|error" "$out/pytest.txt" | tail -3
  grep -E "^(FAILED|ERROR)" "$out/pytest.txt" | head -20
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
  model=/tmp/models/llama-3.2-1b
  [ -d "$model" ] || python tools/make_model.py "$model" --preset llama-3.2-1b --dtype bfloat16 > "$out/make_model.txt" 2>&1
  for backend in flashinfer triton torch; do
    timeout 240 python tools/bench_offline.py --model-path "$model" --dtype bfloat16 --attention-backend "$backend" \
      --num-prompts 256 --input-len 512 --output-len 128 --max-total-tokens 400000 --max-running-requests 256 \
      > "$out/bench_$backend.txt" 2>&1
    echo "$backend exit $?: $(tail -1 "$out/bench_$backend.txt")"
  done
  timeout 240 python tools/bench_offline.py --model-path "$model" --dtype bfloat16 --attention-backend triton --fused-kernels \
    --num-prompts 256 --input-len 512 --output-len 128 --max-total-tokens 400000 --max-running-requests 256 \
    > "$out/bench_triton_fused.txt" 2>&1
  echo "triton --fused-kernels exit $?: $(tail -1 "$out/bench_triton_fused.txt")"
  # Batch 1 (decode-bound, from CUDA graphs): where the unfused norms and rotary cost most.
  for fused in "" --fused-kernels; do
    name=bench_triton_bs1${fused:+_fused}
    timeout 120 python tools/bench_offline.py --model-path "$model" --dtype bfloat16 --attention-backend triton $fused \
      --num-prompts 1 --input-len 128 --output-len 256 --max-total-tokens 400000 --max-running-requests 256 \
      > "$out/$name.txt" 2>&1
    echo "triton batch 1 ${fused:-unfused} exit $?: $(tail -1 "$out/$name.txt")"
  done
fi
