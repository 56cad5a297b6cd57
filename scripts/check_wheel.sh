#!/usr/bin/env bash
# Packaging check (CI): builds a wheel with `python -m build --wheel --no-isolation` against
# the venv's torch, installs it into a fresh venv with the same torch, and imports it there,
# outside the source tree: it must load its compiled kernels and report them.
#
# The wheel is narrow unless told otherwise (head dim 64, bf16, forward: two kernels,
# minutes on 2 cores): this checks the packaging, not the kernels, which `make test`
# builds and tests. A release wheel is the same command without the narrowing
# (FLASH3_HDIMS=64,96,128,192,256 FLASH3_DTYPES=bf16,fp16,e4m3 FLASH3_KINDS=fwd,bwd).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
export FLASH3_HDIMS="${FLASH3_HDIMS:-64}" FLASH3_DTYPES="${FLASH3_DTYPES:-bf16}" FLASH3_KINDS="${FLASH3_KINDS:-fwd}"
work="$PWD/build/wheel-check"
rm -rf "$work" && mkdir -p "$work"

"$PYTHON" -m pip install -q build
"$PYTHON" -m build --wheel --no-isolation --outdir "$work/dist" . > "$work/build.log" 2>&1 || {
  tail -40 "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/flash3-*.whl)
echo "built $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"

torch_version=$("$PYTHON" -c "import torch; print(torch.__version__.split('+')[0])")
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "torch==$torch_version"
"$work/venv/bin/python" -m pip install -q --no-deps "$wheel"

cd "$work"  # away from the source tree, so that only the installed package can be imported
"$work/venv/bin/python" - <<PY
import os, flash3
assert os.path.realpath(flash3.__file__).startswith(os.path.realpath("$work/venv")), flash3.__file__
info = flash3.build_info()
kernels = info.get("kernels")
assert kernels, info
# "192v128": q/k head dim 192, v's 128; "64": both 64
hdims = [tuple(map(int, h.split("v"))) if "v" in h else (int(h), int(h)) for h in "$FLASH3_HDIMS".split(",")]
wanted = {(kind, dtype, d, dv) for kind in "$FLASH3_KINDS".split(",") for dtype in "$FLASH3_DTYPES".split(",")
          for d, dv in hdims if dtype != "e4m3"}
got = {(k["kind"], k["dtype"], k["hdim"], k["hdim_v"]) for k in kernels}
assert got == wanted, (got, wanted)
print(f"flash3 {flash3.__version__} from {os.path.dirname(flash3.__file__)}: {len(kernels)} kernels, "
      f"CUDA {info['cuda_version']}, CUTLASS {info['cutlass_version']}")
PY
