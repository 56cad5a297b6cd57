#!/usr/bin/env bash
# One run on the GPU machine for the FP8 path: environment, FP8 GPU tests, SASS check,
# accuracy table, FP8 speed grid. Runs from a directory holding flash3/ (with the built
# _C*.so), tests/, benchmarks/, scripts/, dev/; results go to $OUT. Usage:
#   dev/device_run_fp8.sh "<pytest args>" "<bench args or skip>"
set -uo pipefail
TEST_ARGS="${1:-}"
BENCH_ARGS="${2:-}"
source "$(dirname "$0")/device_env.sh"
python3 -c "import torch, flash3; print(torch.__version__, torch.cuda.get_device_name(), flash3.fp8.built_kernels())" 2>&1 | tee -a "$OUT/gpu.txt"
# Smoke test first: a hang (pipeline deadlock) or a fault shows here within seconds.
timeout 40 python3 -c "
import torch, flash3
q, k, v = (torch.randn(2, 1000, 4, 128, device='cuda', dtype=torch.bfloat16) for _ in range(3))
for causal in (False, True):
    out = flash3.fp8.attention(q, k, v, causal=causal)
    torch.cuda.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
    print('smoke causal', causal, 'max err vs sdpa', (out.float() - ref.float()).abs().max().item())
" 2>&1 | tee "$OUT/smoke.txt"
if [ "${PIPESTATUS[0]}" != "0" ]; then echo "SMOKE FAILED: skipping the rest"; exit 1; fi
python3 scripts/check_sass.py 2>&1 | tee "$OUT/sass.txt" | tail -12
if [ "$TEST_ARGS" != "skip" ]; then
  timeout 120 python3 -m pytest -v --maxfail=6 -p no:cacheprovider --tb=short -rfE tests/test_fp8.py tests/test_fp8_gpu.py $TEST_ARGS 2>&1 \
    | tee "$OUT/tests.log" | grep -v PASSED | tail -40
fi
timeout 60 python3 benchmarks/fp8_accuracy.py --backend kernel --json "$OUT/fp8_accuracy.json" 2>&1 | tee "$OUT/accuracy.md"
if [ "$BENCH_ARGS" != "skip" ]; then
  timeout 100 python3 benchmarks/bench_attention.py --fp8 --out-dir "$OUT" --tag fp8 $BENCH_ARGS 2>&1 \
    | tee "$OUT/bench.log" | grep -v "^$" | grep -v "^wrote" | cut -c1-150 | tail -40
fi
