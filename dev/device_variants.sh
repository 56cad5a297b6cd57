#!/usr/bin/env bash
# A/B experiments on the GPU machine: builds variants of the extension from the current
# tree with extra nvcc flags, each into .ab/<name>/flash3, in parallel.
# Usage: dev/device_variants.sh "<FLASH3_HDIMS>" name1 "flags1" name2 "flags2" ...
set -uo pipefail
HDIMS="$1"; shift
root=$PWD
pids=()
while [ $# -ge 2 ]; do
  name=$1; flags=$2; shift 2
  rm -rf "/tmp/ab-$name" && mkdir -p "/tmp/ab-$name" && cp -r setup.py csrc flash3 "/tmp/ab-$name/"
  rm -f /tmp/ab-$name/flash3/_C*.so
  ( cd "/tmp/ab-$name" && NVCC_APPEND_FLAGS="$flags" FLASH3_HDIMS="$HDIMS" FLASH3_DTYPES=bf16 \
      CUTLASS_DIR="$root/.ab/cutlass" MAX_JOBS=6 NVCC_THREADS=1 python3 setup.py build_ext --inplace \
      > build.log 2>&1 && mkdir -p "$root/.ab/$name" && cp -r flash3 "$root/.ab/$name/" \
      && echo "built $name" || { echo "FAILED $name"; grep -E "error" build.log | head; } ) &
  pids+=($!)
done
wait "${pids[@]}"
