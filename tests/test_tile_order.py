"""The persistent forward kernels' tile orders (csrc/flash3/scheduler.h, scheduler_tail.h:
the snake, pairs, the dealt tail) on the host: every tile visited once, and pairs where
the host's model finds the snake unbalanced. tests/cpp/tile_order_check.cu, compiled with
nvcc (no GPU needed)."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _cutlass_include():
    try:
        import cutlass_library
    except ImportError:
        return None
    path = Path(cutlass_library.__file__).parent / "source" / "include"
    return path if path.is_dir() else None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_tile_orders_visit_every_tile_once(tmp_path):
    include = _cutlass_include()
    if include is None:
        pytest.skip("needs the CUTLASS headers (nvidia-cutlass)")
    exe = tmp_path / "tile_order_check"
    subprocess.run(
        ["nvcc", "-std=c++17", "-O1", "--expt-relaxed-constexpr", f"-I{ROOT / 'csrc'}", f"-I{include}",
         str(ROOT / "tests" / "cpp" / "tile_order_check.cu"), "-o", str(exe)],
        check=True, capture_output=True, text=True,
    )
    result = subprocess.run([str(exe), "1000"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok"), result.stdout
