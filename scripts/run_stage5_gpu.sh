#!/usr/bin/env bash
# Stage 5 on a CUDA GPU, as one prepared run (< 6 minutes on an H100/H200-class card):
#   1. the stage-5 tests, compiled on the GPU this time: every kernel case, those marked `cuda`
#      (real shapes, fp16/bf16, both layouts), the backend in the tiny model, exercise 5;
#   2. the whole benchmark (python -m kvlab.tools.bench_paged_attention);
# everything goes into one archive, results/<card>/stage5_gpu.tar.gz, with the logs.
# Usage: bash scripts/run_stage5_gpu.sh [OUT_DIR]
set -euo pipefail
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU: nothing to measure')"
card=$(python -c "import torch; n = torch.cuda.get_device_name(); print(''.join(c if c.isalnum() else '-' for c in n).strip('-'))")
out=${1:-results/$card}
mkdir -p "$out"
unset TRITON_INTERPRET  # the real compiler, not the interpreter
# A failing test is recorded in the log, and the benchmark still runs.
timeout 240 python -m pytest -o addopts="" -q tests/test_triton_paged_attention.py \
    tests/test_triton_backend.py tests/exercises/test_stage5.py \
    2>&1 | tee "$out/stage5_tests.log" || echo "TESTS FAILED" | tee -a "$out/stage5_tests.log"
# Stopped early, the benchmark still leaves bench_paged_attention.partial.json (every point so far).
timeout 300 python -m kvlab.tools.bench_paged_attention --out "$out" 2>&1 | tee "$out/stage5_bench.log" \
    || echo "BENCHMARK STOPPED EARLY" | tee -a "$out/stage5_bench.log"
tar -czf "$out/stage5_gpu.tar.gz" -C "$out" stage5_tests.log stage5_bench.log \
    $(cd "$out" && ls bench_paged_attention*.json bench_paged_attention.md roofline.png 2>/dev/null)
echo "archive: $out/stage5_gpu.tar.gz"
