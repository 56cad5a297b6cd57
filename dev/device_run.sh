#!/usr/bin/env bash
# One full run on the GPU machine: environment facts, GPU tests, SASS check, benchmark.
# Runs from the repository root with the prebuilt flash3/_C*.so carried along; results
# go to $OUT (copied back to the workstation). Usage:
#   dev/device_run.sh "<pytest args>" "<benchmark args>"
set -uo pipefail
TEST_ARGS="${1:-}"
BENCH_ARGS="${2:-}"
source "$(dirname "$0")/device_env.sh"
python3 -c "import torch, flash3; print(torch.__version__, torch.cuda.get_device_name(), flash3.build_info())" 2>&1 | tee -a "$OUT/gpu.txt"
if [ "$TEST_ARGS" != "skip" ]; then
  timeout 420 python3 -m pytest -q -x -p no:cacheprovider tests $TEST_ARGS 2>&1 | tee "$OUT/tests.log" | tail -25
fi
python3 scripts/check_sass.py 2>&1 | tee "$OUT/sass.txt" | tail -25
if [ "$BENCH_ARGS" != "skip" ]; then
  python3 benchmarks/bench_attention.py --out-dir "$OUT" --tag device $BENCH_ARGS 2>&1 | tee "$OUT/bench.log" | grep -v "^$" | tail -60
fi
