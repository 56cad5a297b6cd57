"""Builds and runs a host check program of tests/cpp/ with nvcc (no GPU needed): the kernel
library's headers compiled for the host, checked against brute force. The program prints
"ok ..." or its first failure."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def _cutlass_include():
    try:
        import cutlass_library
    except ImportError:
        return None
    path = Path(cutlass_library.__file__).parent / "source" / "include"
    return path if path.is_dir() else None


def run_host_check(source: str, tmp_path: Path, *args: str) -> str:
    """Compiles tests/cpp/<source> with the CUTLASS headers and runs it with args; returns
    its output, asserting that it reports ok."""
    include = _cutlass_include()
    if include is None:
        pytest.skip("needs the CUTLASS headers (nvidia-cutlass)")
    exe = tmp_path / Path(source).stem
    subprocess.run(
        ["nvcc", "-std=c++17", "-O1", "--expt-relaxed-constexpr", f"-I{ROOT / 'csrc'}", f"-I{include}",
         str(ROOT / "tests" / "cpp" / source), "-o", str(exe)],
        check=True, capture_output=True, text=True,
    )
    result = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok"), result.stdout
    return result.stdout
