"""The forward's choice of tile variant (csrc/flash3/variant_fwd.h: the 16-bit short tiles
and the FP8 kernels' variants) against the rules it states, on the host:
tests/cpp/variant_fwd_check.cpp, compiled with the host C++ compiler (no GPU needed)."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _compiler():
    return shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@pytest.mark.skipif(_compiler() is None, reason="needs a host C++ compiler")
def test_variant_choice(tmp_path):
    exe = tmp_path / "variant_fwd_check"
    subprocess.run(
        [_compiler(), "-std=c++17", "-O1", f"-I{ROOT / 'csrc'}", str(ROOT / "tests" / "cpp" / "variant_fwd_check.cpp"),
         "-o", str(exe)],
        check=True, capture_output=True, text=True,
    )
    result = subprocess.run([str(exe), "500"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok"), result.stdout
