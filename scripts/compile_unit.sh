#!/usr/bin/env bash
# Compiles one kernel translation unit (csrc/instantiations/*.cu) to an object file with the
# nvcc flags of setup.py's extension(), for kernels that CI's narrowed build does not hold:
#   bash scripts/compile_unit.sh csrc/instantiations/bwd_bf16_hdim256_nomask.cu build/units/x.o
# then `python scripts/check_sass.py --module build/units/x.o` checks its SASS.
set -euo pipefail
cd "$(dirname "$0")/.."
src="$1"
out="$2"
python="${PYTHON:-.venv/bin/python}"
cutlass=$("$python" -c 'import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))')/source/include
nvcc="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
mkdir -p "$(dirname "$out")"
"$nvcc" -c "$src" -o "$out" -I csrc -I "$cutlass" \
  -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 --use_fast_math -DNDEBUG -lineinfo \
  --expt-relaxed-constexpr -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -Xptxas=--warn-on-spills \
  --threads "${NVCC_THREADS:-2}" -DFLASH3_HDIM_MASK=63 -DFLASH3_DTYPE_MASK=7 -DFLASH3_KIND_MASK=3
