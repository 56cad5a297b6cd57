"""The FlashAttention-3 paper's benchmark grid: 16k tokens per batch, hidden 2048, and how
its TFLOPs/s are counted (bench_attention.py runs it; grid_report.py writes its tables)."""

from __future__ import annotations

import math

TOTAL_TOKENS = 16384
HIDDEN = 2048
DEFAULT_HDIMS = [64, 128, 256]
DEFAULT_SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
BWD_FLOP_FACTOR = 2.5


def config_shape(hdim: int, seqlen: int) -> tuple[int, int]:
    """(batch, nheads) for the paper's grid."""
    return max(1, TOTAL_TOKENS // seqlen), HIDDEN // hdim


def flops(batch: int, nheads: int, seqlen: int, hdim: int, causal: bool, kind: str = "fwd") -> float:
    f = 4.0 * batch * nheads * seqlen * seqlen * hdim
    if causal:
        f /= 2
    if kind == "bwd":
        f *= BWD_FLOP_FACTOR
    return f


def tflops_per_s(nflops: float, ms: float | None) -> float | None:
    if ms is None or ms <= 0 or not math.isfinite(ms):
        return None
    return nflops / (ms * 1e-3) / 1e12

