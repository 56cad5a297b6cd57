"""Variable-length (packed) batches: ``flash3.attention_varlen``.

The compiled ops are ``torch.ops.flash3.fwd_varlen`` and ``torch.ops.flash3.bwd_varlen``.
The sequences' lengths stay on the GPU (the kernels read ``cu_seqlens`` per tile), so a
call never synchronises with the host and can be captured in a CUDA graph and replayed
with other lengths of the same totals.
"""
from __future__ import annotations

import math
import os

import torch

from .interface import _C, _check_built, _check_devices, _check_flags, _check_options, _check_tensors, _mask_kind
from .interface import _fail as _fail_as

_NAME = "flash3.attention_varlen"


def _fail(exc_type, name, value, supported):
    _fail_as(exc_type, name, value, supported, _NAME)


def _check_index_tensor(name, t, size):
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, name, type(t).__name__, "a torch.Tensor of int32")
    if t.dtype != torch.int32:
        _fail(TypeError, f"{name}.dtype", t.dtype, "torch.int32")
    if t.dim() != 1:
        _fail(ValueError, f"{name}.dim()", t.dim(), "1")
    if size is not None and t.shape[0] != size:
        _fail(ValueError, f"{name}.shape[0]", t.shape[0], f"{size} (the batch size that cu_seqlens_q gives)")


def _check_max_seqlen(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(TypeError, name, type(value).__name__, "a Python int (the longest sequence's length)")
    if value < 0 or value >= 2**31:
        _fail(ValueError, name, value, "0 <= max_seqlen < 2^31")


def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, causal,
                  softmax_scale, deterministic, window_size=(-1, -1), softcap=0.0, sinks=None):
    """Every argument of attention_varlen but the length tensors' values; returns the
    options as the op takes them: (window_left, window_right, softcap)."""
    _check_tensors(_NAME, q, k, v)
    _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    _check_flags(_NAME, causal, softmax_scale, deterministic)
    options = _check_options(_NAME, q, window_size, softcap, sinks)
    # The length tensors' types and shapes before any device: every argument error is
    # reported the same way on a machine without a GPU.
    _check_index_tensor("cu_seqlens_q", cu_seqlens_q, None)
    if cu_seqlens_q.shape[0] < 1:
        _fail(ValueError, "cu_seqlens_q.shape[0]", 0, "batch + 1 >= 1")
    batch = cu_seqlens_q.shape[0] - 1
    _check_index_tensor("cu_seqlens_k", cu_seqlens_k, batch + 1)
    index_tensors = [("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)]
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is not None:
            _check_index_tensor(name, t, batch)
            index_tensors.append((name, t))
    sink_tensor = [("sinks", sinks)] if sinks is not None else []
    _check_devices(_NAME, q, [("k", k), ("v", v), *index_tensors, *sink_tensor])
    return options


def validate_seqlens(total_q, total_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                     seqused_k=None):
    """Check the *values* of the length tensors (copies them to the host: a sync).

    ``cu_seqlens`` must start at 0, never decrease and end at the total number of rows;
    no sequence (nor ``seqused`` entry) may be longer than ``max_seqlen``; ``seqused[b]``
    must fit in sequence b's slot. Raises ValueError naming the argument.
    """
    for name, cu, total, max_len, used in (
        ("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q, seqused_q),
        ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k, seqused_k),
    ):
        c = cu.cpu().tolist()
        if c[0] != 0:
            _fail(ValueError, f"{name}[0]", c[0], "0")
        lengths = [b - a for a, b in zip(c[:-1], c[1:])]
        if any(n < 0 for n in lengths):
            _fail(ValueError, name, c, "a non-decreasing sequence of offsets")
        if c[-1] != total:
            _fail(ValueError, f"{name}[-1]", c[-1], f"the total number of rows ({total})")
        side = name[-1]
        if used is not None:
            u = used.cpu().tolist()
            bad = [b for b, (n, m) in enumerate(zip(u, lengths)) if n < 0 or n > m]
            if bad:
                _fail(ValueError, f"seqused_{side}[{bad[0]}]", u[bad[0]],
                      f"0 <= seqused <= the slot's length ({lengths[bad[0]]})")
            lengths = u
        longest = max(lengths, default=0)
        if longest > max_len:
            _fail(ValueError, f"max_seqlen_{side}", max_len, f">= the longest sequence ({longest})")


if _C is not None:

    @torch.library.register_fake("flash3::fwd_varlen")
    def _fwd_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                         softmax_scale, causal, deterministic=False, window_left=-1, window_right=-1, softcap=0.0,
                         sinks=None, page_table=None, page_size=0, page_rows=0, rows_per_query=1, split_keys=False):
        total_q, nheads, _ = q.shape
        return q.new_empty((total_q, nheads, v.shape[-1])), q.new_empty((nheads, total_q), dtype=torch.float32)

    @torch.library.register_fake("flash3::bwd_varlen")
    def _bwd_varlen_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                         max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic, window_left=-1,
                         window_right=-1, softcap=0.0, sinks=None):
        return (
            torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            q.new_empty((0,) if sinks is None else tuple(sinks.shape), dtype=torch.float32),
        )

    # The gradient of flash3::fwd_varlen is registered in C++ (csrc/autograd.cpp).


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqused_q=None,
                     seqused_k=None, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, sinks=None,
                     return_lse=False, deterministic=False, validate=False):
    """Attention over a packed batch of sequences of different lengths, on a Hopper GPU.

    Args:
        q: (total_q, nheads, headdim), the batch's query tokens back to back;
            torch.bfloat16 or torch.float16, CUDA.
        k, v: (total_k, nheads_k, headdim), same dtype and device; GQA/MQA and v's own
            head dim (192 with 128) as in ``flash3.attention``.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on q's device: sequence b owns rows
            ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q (and of the output) and
            ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and v. Empty sequences are legal.
        max_seqlen_q, max_seqlen_k: Python ints, at least the longest sequence's length
            (they size the grid; the lengths themselves are read on the GPU).
        seqused_q, seqused_k: int32 (batch,) or None: sequence b uses only the first
            ``seqused[b]`` rows of its slot; the rest is neither attended to nor written
            (its gradients are zero).
        causal: bottom-right aligned per sequence, as in ``flash3.attention``.
        softmax_scale, deterministic: as in ``flash3.attention``.
        window_size, softcap, sinks: as in ``flash3.attention``, per sequence (windows
            bottom-right aligned in each sequence; a window side reaching past the
            longest sequence is unbounded).
        return_lse: also return the logsumexp, float32 (nheads, total_q) (FlashAttention-3's
            layout); gradients flow through it.
        validate: check the values of the length tensors first (a host synchronisation;
            also on when the environment sets FLASH3_VALIDATE=1). Without it, wrong
            lengths are the caller's contract: rows may be left unwritten.

    Returns:
        out (total_q, nheads, v's headdim), or (out, lse) when return_lse. Output rows that
        belong to no sequence (past ``seqused`` or ``cu_seqlens[-1]``) are not written.

    No host synchronisation happens in the call (unless ``validate``): it can be captured
    in a CUDA graph and replayed with other lengths of the same totals and maxima.
    Rows of a slot past ``seqused`` and rows past the tensors' valid sequences are read
    by the kernels (multiplied by zero weights), so they must hold finite values.
    """
    left, right, softcap = _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                         seqused_k, causal, softmax_scale, deterministic, window_size, softcap, sinks)
    mask = _mask_kind(causal, (left, right), softcap, sinks, max_seqlen_q, max_seqlen_k)
    _check_built("fwd", q, causal, mask, _NAME, v=v)
    if torch.is_grad_enabled() and (any(t.requires_grad for t in (q, k, v)) or
                                    (sinks is not None and sinks.requires_grad)):
        _check_built("bwd", q, causal, mask, _NAME, v=v)
    if validate or os.environ.get("FLASH3_VALIDATE") == "1":
        validate_seqlens(q.shape[0], k.shape[0], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                         seqused_k)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = torch.ops.flash3.fwd_varlen(
        q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
        None if seqused_q is None else seqused_q.contiguous(),
        None if seqused_k is None else seqused_k.contiguous(),
        max_seqlen_q, max_seqlen_k, float(softmax_scale), causal, deterministic, left, right, softcap,
        None if sinks is None else sinks.float().contiguous(),
    )
    return (out, lse) if return_lse else out
