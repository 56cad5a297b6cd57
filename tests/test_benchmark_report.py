"""The grid benchmark's report runs without a GPU: `bench_attention.py --replot` rebuilds a
committed results table from its JSON, to the byte (its runner, backends, timing and
report modules all import on the way)."""
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def test_replot_rebuilds_the_committed_table(tmp_path):
    tag = "h100-fa3-fwdbwd"
    subprocess.run([sys.executable, str(BENCH / "bench_attention.py"), "--replot",
                    str(BENCH / "results" / f"{tag}.json"), "--out-dir", str(tmp_path)],
                   check=True, capture_output=True, text=True)
    assert (tmp_path / f"{tag}.md").read_text() == (BENCH / "results" / f"{tag}.md").read_text()


def test_without_a_gpu_the_grid_exits_with_code_2(tmp_path):
    """No GPU: the documented exit code 2, and nothing written."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the grid would run")
    r = subprocess.run([sys.executable, str(BENCH / "bench_attention.py"), "--out-dir", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "no CUDA GPU" in r.stderr
    assert not any(tmp_path.iterdir())
