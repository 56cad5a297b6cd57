#!/usr/bin/env bash
# One full check of the working tree on the GPU machine: builds flash3 there (all 16
# cores), optionally a base build to A/B against, then the GPU tests, the SASS check, the
# A/B of the dense grid, the varlen and masks benchmarks beside FlashAttention-3. Results
# go to $OUT (with the built module, compressed, for a later run to carry as
# .anchors/flash3_C.so.xz instead of building). Expects in .anchors/ (an ignored folder, carried):
#   cutlass-include.tar.xz   the CUTLASS/CuTe headers (include/), as the nvidia-cutlass wheel has them
#   fa3-features-*.tar.xz    FlashAttention-3 built with varlen (../shared/anchors/fa3/)
#   base-src.tar.xz          optional: `git archive <base> csrc setup.py flash3`, built for the A/B
# Usage: dev/device_check.sh [steps...]   steps: base build tests sass ab varlen masks kvcache (default: all)
set -uo pipefail
OUT="${OUT:-/tmp/flash3-out}"
mkdir -p "$OUT"
steps="${*:-base build tests sass ab varlen masks kvcache}"
has() { [[ " $steps " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1 CUTLASS_DIR=/tmp/cutlass
mkdir -p /tmp/cutlass /tmp/fa3; [ -d /tmp/cutlass/include ] || tar xJf .anchors/cutlass-include.tar.xz -C /tmp/cutlass
[ -f /tmp/fa3/flash_attn_interface.py ] || ! ls .anchors/fa3-features-*.tar.xz >/dev/null 2>&1 || tar xJf .anchors/fa3-features-*.tar.xz -C /tmp/fa3
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
if has base && [ -f .anchors/base-src.tar.xz ] && ! ls /tmp/base/flash3/_C*.so >/dev/null 2>&1; then
  # The base build for the A/B (bf16, head dims 64/128/256), beside the main build; its
  # module comes back compressed, for a later run to carry as .anchors/base_C.so.xz.
  mkdir -p /tmp/base && tar xJf .anchors/base-src.tar.xz -C /tmp/base
  if [ -f .anchors/base_C.so.xz ]; then
    xz -dc .anchors/base_C.so.xz > "/tmp/base/flash3/_C.cpython-$(python3 -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')-x86_64-linux-gnu.so"
  else
    (cd /tmp/base && FLASH3_HDIMS=64,128,256 FLASH3_DTYPES=bf16 MAX_JOBS=${BASE_JOBS:-4} NVCC_THREADS=1 \
      python3 setup.py build_ext --inplace > "$OUT/build-base.log" 2>&1 || tail -20 "$OUT/build-base.log"
      xz -T0 -3 -c flash3/_C*.so > "$OUT/base_C.so.xz") &
  fi
fi
if has build; then
  # setup.py's ninja keeps its objects under build/: a build cut short by a time limit
  # resumes where it stopped.
  start=$(date +%s)
  MAX_JOBS=16 NVCC_THREADS=1 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || {
    grep -E "error" "$OUT/build.log" | head -30; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
  grep -i "spill" "$OUT/build.log" | sed 's/.*function//' | sort | uniq | head -20
  xz -T0 -3 -c flash3/_C*.so > "$OUT/flash3_C.so.xz"
elif [ -f .anchors/flash3_C.so.xz ] && ! ls flash3/_C*.so >/dev/null 2>&1; then
  xz -dc .anchors/flash3_C.so.xz > "flash3/_C.cpython-$(python3 -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')-x86_64-linux-gnu.so"
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
if has masks; then
  python3 benchmarks/bench_masks.py --out-dir "$OUT" ${MASKS_ARGS:-} 2>&1 | tee "$OUT/bench-masks.log" | grep -v "^  " | tail -50
fi
if has varlen; then
  python3 benchmarks/bench_varlen.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench-varlen.log" | grep -v "^  " | tail -70
fi
if has kvcache; then
  python3 benchmarks/bench_kvcache.py --out-dir "$OUT" ${KVCACHE_ARGS:-} 2>&1 | tee "$OUT/bench-kvcache.log" | grep -v "^  " | tail -70
fi
