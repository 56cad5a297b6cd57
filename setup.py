"""Builds flash3._C, the Hopper attention kernels, with PyTorch's CUDAExtension and ninja.

Environment variables:
  FLASH3_HDIMS     comma list of head dims to compile (default: 64,96,128,192,256,192v128);
                   192v128 is head dim 192 for Q and K with 128 for V
  FLASH3_DTYPES    comma list of dtypes to compile (default: bf16,fp16,e4m3); e4m3 is the
                   FP8 forward (head dims 64, 128, 256) and the fused quantiser
  FLASH3_KINDS     comma list of passes to compile: fwd, bwd (default: both)
  CUTLASS_DIR      a CUTLASS checkout (its include/ is used) instead of the nvidia-cutlass wheel
  MAX_JOBS         parallel compile jobs (ninja); NVCC_THREADS threads per nvcc (default 2)

Build with `pip install --no-build-isolation .` (or `-e .`): the extension compiles
against the torch already installed. The project's metadata (name, version from
flash3/_version.py, dependencies) is in pyproject.toml; this file adds the extension.
"""
import os
import re
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
# In the order of dispatch.cu's kHeadDims (bit i of FLASH3_HDIM_MASK).
ALL_HDIMS = ["64", "96", "128", "192", "256", "192v128"]
ALL_DTYPES = ["bf16", "fp16", "e4m3"]
ALL_KINDS = ["fwd", "bwd"]


def _env_list(name, allowed, convert=str):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return list(allowed)
    values = [convert(x.strip()) for x in raw.split(",") if x.strip()]
    bad = [v for v in values if v not in allowed]
    if bad:
        raise SystemExit(f"{name}={raw!r}: {bad} not supported; choose from {allowed}")
    return values


def cutlass_include_dir():
    override = os.environ.get("CUTLASS_DIR")
    if override:
        path = Path(override) / "include"
        if not (path / "cute" / "tensor.hpp").exists():
            raise SystemExit(f"CUTLASS_DIR={override}: no include/cute/tensor.hpp there")
        return str(path)
    try:
        import cutlass_library
    except ImportError as exc:
        raise SystemExit(
            "flash3 needs the CUTLASS/CuTe headers: `pip install nvidia-cutlass` "
            "or set CUTLASS_DIR to a CUTLASS checkout (see third_party/README.md)"
        ) from exc
    path = Path(cutlass_library.__file__).resolve().parent / "source" / "include"
    if not (path / "cute" / "tensor.hpp").exists():
        raise SystemExit(f"nvidia-cutlass is installed but {path} holds no CuTe headers")
    return str(path)


def _set_cuda_home():
    """torch locates CUDA from CUDA_HOME, else from the nvcc on PATH. A wrapper script
    there (as on some images) points it at the wrong folder; prefer /usr/local/cuda
    when that holds the runtime headers."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    default = Path("/usr/local/cuda")
    if (default / "include" / "cuda_runtime.h").exists():
        os.environ["CUDA_HOME"] = str(default)


def extension():
    _set_cuda_home()
    from torch.utils.cpp_extension import CUDAExtension

    hdims = _env_list("FLASH3_HDIMS", ALL_HDIMS)
    dtypes = _env_list("FLASH3_DTYPES", ALL_DTYPES)
    kinds = _env_list("FLASH3_KINDS", ALL_KINDS)
    hdim_mask = sum(1 << ALL_HDIMS.index(h) for h in hdims)
    dtype_mask = sum(1 << ALL_DTYPES.index(d) for d in dtypes)
    kind_mask = sum(1 << ALL_KINDS.index(k) for k in kinds)

    def wanted(path):
        kind, dtype, hdim, _mask = path.stem.split("_")
        return kind in kinds and dtype in dtypes and hdim[len("hdim"):] in hdims

    kernels = sorted(
        f"csrc/instantiations/{p.name}"
        for p in (ROOT / "csrc" / "instantiations").glob("*_*_hdim*_*.cu")
        if wanted(p)
    )
    sources = ["csrc/api.cpp", "csrc/autograd.cpp", "csrc/dispatch.cu", "csrc/sum_kv_heads.cu", "csrc/kvcache.cu", "csrc/packed_tiles.cu", *kernels]
    if "e4m3" in dtypes and "fwd" in kinds:
        sources += ["csrc/api_fp8.cpp", "csrc/dispatch_fp8.cu", "csrc/quantize_fp8.cu"]

    defines = [
        f"-DFLASH3_HDIM_MASK={hdim_mask}",
        f"-DFLASH3_DTYPE_MASK={dtype_mask}",
        f"-DFLASH3_KIND_MASK={kind_mask}",
    ]
    nvcc_flags = [
        "-gencode", "arch=compute_90a,code=sm_90a",
        "-O3", "-std=c++17", "--use_fast_math", "-DNDEBUG", "-lineinfo",
        "--expt-relaxed-constexpr",
        # Lets GMMA::ss_op_selector pick 64xN atoms for N not a power of two (e.g. 80, 112).
        "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",
        "-Xptxas=--warn-on-spills",
        "--threads", os.environ.get("NVCC_THREADS", "2"),
        *defines,
    ]
    cxx_flags = ["-O3", "-std=c++17", "-DNDEBUG", *defines]
    return CUDAExtension(
        name="flash3._C",
        sources=sources,
        include_dirs=[str(ROOT / "csrc"), cutlass_include_dir()],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )


def cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension.with_options(use_ninja=True)}


def version():
    """flash3/_version.py's __version__, read without importing flash3."""
    text = (ROOT / "flash3" / "_version.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, flags=re.M).group(1)


setup(
    version=version(),
    packages=find_packages(include=["flash3", "flash3.*"]),
    ext_modules=[extension()],
    cmdclass=cmdclass(),
)
