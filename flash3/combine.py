"""Split-KV partial results merged into the attention over all their keys.

Attention over a key range split into parts is recovered from each part's normalised
output and logsumexp: lse = log(sum_s exp(lse_s)) and out = sum_s exp(lse_s - lse) * out_s.
FlashAttention-3 exposes this as ``flash_attn_combine`` (its layouts are used here), and
``flash3.flash_attn_interface.flash_attn_combine`` is this function.
"""
from __future__ import annotations

import torch

__all__ = ["combine"]


def combine(out_partial, lse_partial, out=None, out_dtype=None):
    """FlashAttention-3's combine of split-KV partial results: the attention over the union
    of the key ranges from each range's normalised output and logsumexp.

    Args:
        out_partial: float32 (num_splits, batch, seqlen, nheads, headdim), split s's output.
        lse_partial: float32 (num_splits, batch, seqlen, nheads), split s's logsumexp
            (-inf for a split that saw no key).
        out: optional (batch, seqlen, nheads, headdim) tensor of ``out_dtype`` to write into.
        out_dtype: float32 (default), bfloat16 or float16.

    Returns:
        (out, softmax_lse): out (batch, seqlen, nheads, headdim) and the combined logsumexp,
        float32 (batch, seqlen, nheads). A row whose splits all saw no key gets 0 and -inf.

    lse = log(sum_s exp(lse_s)) and out = sum_s exp(lse_s - lse) * out_s, in float32. It runs
    as a few PyTorch operations (memory-bound, like FlashAttention-3's combine kernel, but
    not fused into one pass).
    """
    fname = "flash_attn_combine"
    for name, t, dims in (("out_partial", out_partial, 5), ("lse_partial", lse_partial, 4)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fname}: {name} is {type(t).__name__}; supported: a torch.Tensor")
        if t.dtype != torch.float32:
            raise TypeError(f"{fname}: {name}.dtype is {t.dtype}; supported: torch.float32")
        if t.dim() != dims:
            raise ValueError(f"{fname}: {name}.dim() is {t.dim()}; supported: {dims}")
    if tuple(lse_partial.shape) != tuple(out_partial.shape[:4]):
        raise ValueError(f"{fname}: lse_partial.shape is {tuple(lse_partial.shape)}; supported: "
                         f"out_partial.shape[:4] = {tuple(out_partial.shape[:4])}")
    if lse_partial.device != out_partial.device:
        raise TypeError(f"{fname}: lse_partial.device is {lse_partial.device}; supported: the device of out_partial")
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else torch.float32
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{fname}: out_dtype is {out_dtype}; supported: torch.float32, torch.bfloat16, torch.float16")
    shape = tuple(out_partial.shape[1:])
    if out is not None:
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != out_dtype:
            raise ValueError(f"{fname}: out must be a {out_dtype} tensor of shape {shape}")
        if out.device != out_partial.device:
            raise TypeError(f"{fname}: out.device is {out.device}; supported: the device of out_partial")
    lse = torch.logsumexp(lse_partial, dim=0)  # (batch, seqlen, nheads); -inf where every split is
    weights = torch.exp(lse_partial - lse.masked_fill(lse == float("-inf"), 0.0))  # 0 where a split is -inf
    combined = (weights.unsqueeze(-1) * out_partial).sum(dim=0)
    if out is None:
        return combined.to(out_dtype), lse
    out.copy_(combined)
    return out, lse
