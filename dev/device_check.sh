#!/usr/bin/env bash
# One full check of the working tree on the GPU machine: builds flash3 there (all 16
# cores), optionally a base build to A/B against, then the GPU tests, the SASS check, the
# A/B of the dense grid and the varlen benchmark beside FlashAttention-3. Results go to
# $OUT. Expects in .anchors/ (an ignored folder, carried):
#   cutlass-include.tar.xz   the CUTLASS/CuTe headers (include/), as the nvidia-cutlass wheel has them
#   fa3-features-*.tar.xz    FlashAttention-3 built with varlen (../shared/anchors/fa3/)
#   base-src.tar.xz          optional: `git archive <base> csrc setup.py flash3`, built for the A/B
# Usage: dev/device_check.sh [steps...]   steps: base build tests sass ab varlen (default: all)
set -uo pipefail
OUT="${OUT:-/tmp/flash3-out}"
mkdir -p "$OUT"
steps="${*:-base build tests sass ab varlen}"
has() { [[ " $steps " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1 CUTLASS_DIR=/tmp/cutlass
mkdir -p /tmp/cutlass /tmp/fa3; [ -d /tmp/cutlass/include ] || tar xJf .anchors/cutlass-include.tar.xz -C /tmp/cutlass
[ -f /tmp/fa3/flash_attn_interface.py ] || ! ls .anchors/fa3-features-*.tar.xz >/dev/null 2>&1 || tar xJf .anchors/fa3-features-*.tar.xz -C /tmp/fa3
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
if has base && [ -f .anchors/base-src.tar.xz ] && ! ls /tmp/base/flash3/_C*.so >/dev/null 2>&1; then
  # The base build for the A/B (bf16, head dims 64/128/256), beside the main build.
  mkdir -p /tmp/base && tar xJf .anchors/base-src.tar.xz -C /tmp/base
  (cd /tmp/base && FLASH3_HDIMS=64,128,256 FLASH3_DTYPES=bf16 MAX_JOBS=4 NVCC_THREADS=1 \
    python3 setup.py build_ext --inplace > "$OUT/build-base.log" 2>&1 || tail -20 "$OUT/build-base.log") &
fi
if has build; then
  # setup.py's ninja keeps its objects under build/: a build cut short by a time limit
  # resumes where it stopped.
  start=$(date +%s)
  MAX_JOBS=16 NVCC_THREADS=1 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || {
    grep -E "error" "$OUT/build.log" | head -30; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
  grep -i "spill" "$OUT/build.log" | sed 's/.*function//' | sort | uniq | head -20
fi
wait
export PYTHONPATH="$PWD:/tmp/fa3"
python3 -c "import flash3; print(len(flash3.build_info()['kernels']), 'kernels')"
if has tests; then
  timeout 900 python3 -m pytest -q -p no:cacheprovider tests --maxfail=30 2>&1 | tee "$OUT/tests.log" | tail -15
fi
if has sass; then
  python3 scripts/check_sass.py 2>&1 | tee "$OUT/sass.txt" | tail -8
fi
if has ab && ls /tmp/base/flash3/_C*.so >/dev/null 2>&1; then
  python3 dev/ab_passes.py --trees base=/tmp/base,new=. --passes "${AB_PASSES:-1}" --out "$OUT/ab-dense.json" 2>&1 \
    | tee "$OUT/ab-dense.md" | tail -42
fi
if has varlen; then
  python3 benchmarks/bench_varlen.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench-varlen.log" | grep -v "^  " | tail -70
fi
