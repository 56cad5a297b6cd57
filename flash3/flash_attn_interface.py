"""FlashAttention-3's Python interface on flash3's kernels.

Code written against FlashAttention-3 (``hopper/flash_attn_interface.py``) switches with
one import line::

    # from flash_attn_interface import flash_attn_func, flash_attn_varlen_func
    from flash3.flash_attn_interface import flash_attn_func, flash_attn_varlen_func

The functions keep FlashAttention-3's names, argument order, defaults and return
conventions: ``out`` by default, ``(out, softmax_lse)`` with ``return_attn_probs=True``
(lse float32, ``(batch, nheads, seqlen_q)``, or ``(nheads, total_q)`` for the varlen
function). Gradients flow through ``out`` and ``softmax_lse``.

What flash3 runs, and what it does not run yet:

* bf16 / fp16, causal or not (bottom-right aligned, as in FlashAttention-3), GQA/MQA,
  ``deterministic`` backward, variable-length batches (``cu_seqlens``, ``seqused``).
* Head dims 64, 96, 128, 192, 256 run as they are. Other multiples of 8 up to 256 (e.g.
  80, 112, 160) are zero-padded to the next of those inside the call; see
  :func:`flash_attn_func` for the cost.
* float8_e4m3fn q, k, v (with FlashAttention-3's ``(batch, nheads_k)`` descales) run the
  FP8 forward of :mod:`flash3.fp8` (head dims 64, 128, 256; others up to 256 padded);
  fixed-length batches only, no backward (as in FlashAttention-3).
* :func:`flash_attn_combine` merges split-KV partial results (in PyTorch, exact in float32).
* ``window_size`` (sliding windows, FlashAttention-3's definition and normalisation: a
  window covering the whole sequence is none, (-1, 0) is causal), ``softcap``, and
  attention sinks as the keyword-only ``learnable_sink`` (one float32 logit per query
  head, FlashAttention's name for them; gradients flow to it) run flash3's local-mask
  kernels, in bf16 / fp16, dense and variable-length, forward and backward, and in the
  FP8 forward for fixed-length batches.
* :func:`flash_attn_with_kvcache` runs :func:`flash3.attention_with_kvcache`: dense and
  paged caches, the in-place append with rotary embedding, split-KV, GQA packing.
  :func:`get_scheduler_metadata` returns None (flash3 needs none).
* v of head dim 128 with q and k of 192 (DeepSeek-V3-style attention) runs flash3's
  kernels for that pair, in bf16 / fp16, dense and variable-length, forward and backward.
* ``qv``, ``attention_chunk`` other than 0, split-KV in the attention calls
  (``num_splits`` > 1) and other V head dims different from Q/K's raise
  ``NotImplementedError`` naming the argument, before any other check.
* ``pack_gqa`` and ``sm_margin`` are tuning hints; flash3 accepts and ignores them
  (flash3 always reads the shared K/V head in place for GQA, and uses every SM).
* Descales given with bf16/fp16 inputs are ignored, as FlashAttention-3 ignores them.

Argument errors (types, shapes, devices, kernels left out of the build) are those of
:func:`flash3.attention` and :func:`flash3.attention_varlen`.
"""
from __future__ import annotations

import torch

from . import fp8 as _fp8
from ._fa3_arguments import (
    _E4M3,
    _as_int,
    _check_common,
    _check_learnable_sink,
    _check_v_headdim,
    _is_tensor,
    _not_implemented,
    _options,
    _pad_last,
    _padded_headdim,
    _window,
)
from .combine import combine as _combine
from .interface import SUPPORTED_HEADDIMS, attention as _attention
from .varlen import attention_varlen as _attention_varlen

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_with_kvcache",
    "flash_attn_combine",
    "get_scheduler_metadata",
]


# ----------------------------------------------------------------------------------------
# Dense (fixed-length) attention
# ----------------------------------------------------------------------------------------


def _dense(fname, q, k, v, softmax_scale, causal, deterministic, return_lse, descales, options):
    if not _is_tensor(q, k, v):
        # flash3.attention reports the wrong argument type
        return _attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                          deterministic=deterministic, **options)
    d = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = d ** (-0.5)  # from the caller's head dim, before any padding
    if q.dtype == _E4M3:
        dp = _padded_headdim(d, _fp8.SUPPORTED_HEADDIMS)
        q8, k8, v8 = (_pad_last(t, dp) if t.dtype == _E4M3 else t for t in (q, k, v))
        q_descale, k_descale, v_descale = descales
        out, lse = _fp8.attention_fp8(q8, k8, v8, q_descale, k_descale, v_descale, causal=causal,
                                      softmax_scale=softmax_scale, return_lse=True, **options)
    else:
        dp = _padded_headdim(d, SUPPORTED_HEADDIMS)
        if k.shape[-1] == d and v.shape[-1] == d:
            q, k, v = (_pad_last(t, dp) for t in (q, k, v))
        else:
            dp = d
        out, lse = _attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True,
                              deterministic=deterministic, **options)
    if dp != d:
        out = out[..., :d].contiguous()
    return (out, lse) if return_lse else out


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
    *,
    learnable_sink=None,
):
    """FlashAttention-3's ``flash_attn_func`` on flash3: softmax(q k^T * softmax_scale) v.

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim), bf16 / fp16 (or float8_e4m3fn, forward
            only, through :mod:`flash3.fp8`).
        k, v: (batch_size, seqlen_k, nheads_k, headdim); nheads % nheads_k == 0 (GQA/MQA:
            query heads i * g .. i * g + g - 1 use K/V head i, g = nheads // nheads_k).
        softmax_scale: defaults to 1 / sqrt(headdim) of the given q.
        causal: bottom-right aligned causal mask: for seqlen_q = 2, seqlen_k = 5::

                1 1 1 1 0
                1 1 1 1 1

            A row that sees no key (seqlen_q > seqlen_k) gives 0 and lse -inf.
        q_descale, k_descale, v_descale: float32 (batch_size, nheads_k) for float8 inputs.
        window_size: (left, right) sliding window, -1 unbounded: query row i sees key j iff
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right
            (bottom-right aligned). As in FlashAttention-3, causal sets right to 0, a side
            reaching past the sequence (left >= seqlen_k - 1, right >= seqlen_q - 1) is
            unbounded and (-1, 0) is the causal mask. For seqlen_q = seqlen_k = 4,
            window_size = (1, 0)::

                1 0 0 0
                1 1 0 0
                0 1 1 0
                0 0 1 1

        softcap: > 0 caps the scores: softcap * tanh(scores / softcap) (0: off).
        learnable_sink: keyword-only, None or (nheads,), used as float32: attention sinks,
            one logit per query head in each row's softmax denominator (no value); the lse
            includes it and gradients flow to it.
        deterministic: bitwise reproducible backward.
        return_attn_probs: also return softmax_lse, float32 (batch_size, nheads, seqlen_q)
            (FlashAttention-3 returns the logsumexp here, not the probabilities).
        qv, attention_chunk != 0, num_splits > 1: NotImplementedError.
        pack_gqa, sm_margin: accepted and ignored.

    Returns:
        out (batch_size, seqlen_q, nheads, headdim), or (out, softmax_lse).

    Head dims: 64, 96, 128, 192, 256 run as they are (64, 128, 256 in float8), and v of
    head dim 128 with q and k of 192 (bf16 / fp16; the output has v's head dim). Other
    multiples of 8 up to 256 are zero-padded to the next of those (e.g. 80 -> 96,
    112 -> 128, 160 -> 192): q, k and v are copied once into padded tensors, the kernel
    does the work of the padded head dim (80 -> 96 costs about 20% more matmul work), and
    the output is sliced back and copied to a contiguous tensor; the backward pays the
    same copies. The softmax scale stays 1/sqrt(original head dim) and the padding is
    zeros, so the result is the unpadded attention's.
    """
    fname = "flash_attn_func"
    _check_common(fname, qv=qv, softcap=softcap, attention_chunk=attention_chunk, num_splits=num_splits)
    seqlens = (q.shape[1], k.shape[1]) if _is_tensor(q, k) and q.dim() == 4 and k.dim() == 4 else (None, None)
    causal, window = _window(fname, window_size, causal, *seqlens)
    _check_v_headdim(fname, q, k, v)
    _check_learnable_sink(fname, learnable_sink, q)
    return _dense(fname, q, k, v, softmax_scale, causal, deterministic, return_attn_probs,
                  (q_descale, k_descale, v_descale), _options(fname, window, softcap, learnable_sink))


def flash_attn_qkvpacked_func(
    qkv,
    softmax_scale=None,
    causal=False,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    deterministic=False,
    num_heads_q=None,
    sm_margin=0,
    return_attn_probs=False,
    *,
    learnable_sink=None,
):
    """FlashAttention-3's ``flash_attn_qkvpacked_func``: :func:`flash_attn_func` on q, k, v
    stacked in one tensor.

    Arguments:
        qkv: (batch_size, seqlen, 3, nheads, headdim), or (batch_size, seqlen,
            num_heads_q + 2 * nheads_k, headdim) with ``num_heads_q`` given (GQA: q's heads,
            then k's, then v's).
        The other arguments are :func:`flash_attn_func`'s.

    q, k and v are views into qkv (no copy); the gradient comes back as one tensor shaped
    like qkv. Returns out (batch_size, seqlen, nheads, headdim) or (out, softmax_lse).
    """
    fname = "flash_attn_qkvpacked_func"
    _check_common(fname, softcap=softcap, attention_chunk=attention_chunk)
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"{fname}: qkv is {type(qkv).__name__}; supported: a torch.Tensor")
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"{fname}: qkv.shape[2] is {qkv.shape[2]}; supported: 3 (q, k, v)")
        q, k, v = qkv.unbind(dim=2)
    elif qkv.dim() == 4:
        if num_heads_q is None:
            raise ValueError(f"{fname}: num_heads_q is None; supported: q's head count when qkv is 4-D")
        num_heads_k, rem = divmod(qkv.shape[2] - num_heads_q, 2)
        if rem or num_heads_k <= 0:
            raise ValueError(f"{fname}: qkv.shape[2] is {qkv.shape[2]}; supported: num_heads_q ({num_heads_q}) "
                             f"+ 2 * nheads_k")
        q, k, v = qkv.split([num_heads_q, num_heads_k, num_heads_k], dim=2)
    else:
        raise ValueError(f"{fname}: qkv.dim() is {qkv.dim()}; supported: 5 (batch, seqlen, 3, nheads, headdim) "
                         "or 4 with num_heads_q")
    causal, window = _window(fname, window_size, causal, qkv.shape[1], qkv.shape[1])
    _check_learnable_sink(fname, learnable_sink, q)
    return _dense(fname, q, k, v, softmax_scale, causal, deterministic, return_attn_probs,
                  (q_descale, k_descale, v_descale), _options(fname, window, softcap, learnable_sink))


# ----------------------------------------------------------------------------------------
# Variable-length attention
# ----------------------------------------------------------------------------------------


def _max_seqlen(cu_seqlens, given):
    if given is not None:
        return given
    if not isinstance(cu_seqlens, torch.Tensor):
        return None
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item()) if cu_seqlens.numel() > 1 else 0


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
    *,
    learnable_sink=None,
):
    """FlashAttention-3's ``flash_attn_varlen_func`` on :func:`flash3.attention_varlen`.

    Arguments:
        q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); bf16 / fp16.
        cu_seqlens_q, cu_seqlens_k: int32 (batch_size + 1,), the sequences' offsets.
        max_seqlen_q, max_seqlen_k: the longest sequence (int); None computes it from
            cu_seqlens (one device sync).
        seqused_q, seqused_k: int32 (batch_size,) or None: tokens of each sequence actually
            used (the rest of its span in q / k is ignored).
        causal: bottom-right aligned per sequence.
        The other arguments are :func:`flash_attn_func`'s (same support; head dims are
        padded the same way); float8 inputs are not supported here yet.

    Returns:
        out (total_q, nheads, headdim), or (out, softmax_lse) with softmax_lse float32
        (nheads, total_q).
    """
    fname = "flash_attn_varlen_func"
    _check_common(fname, qv=qv, softcap=softcap, attention_chunk=attention_chunk, num_splits=num_splits)
    # FlashAttention-3 clamps windows with the longest sequences (hopper/flash_api.cpp)
    if max_seqlen_q is not None:
        max_seqlen_q = _as_int(max_seqlen_q, fname, "max_seqlen_q")
    if max_seqlen_k is not None:
        max_seqlen_k = _as_int(max_seqlen_k, fname, "max_seqlen_k")
    causal, window = _window(fname, window_size, causal, max_seqlen_q, max_seqlen_k)
    options = _options(fname, window, softcap, learnable_sink)
    _check_v_headdim(fname, q, k, v)
    _check_learnable_sink(fname, learnable_sink, q)
    if isinstance(q, torch.Tensor) and q.dtype == _E4M3:
        _not_implemented(fname, "q.dtype", q.dtype, "FP8 variable-length attention")
    max_seqlen_q = _max_seqlen(cu_seqlens_q, max_seqlen_q)
    max_seqlen_k = _max_seqlen(cu_seqlens_k, max_seqlen_k)
    d = q.shape[-1] if _is_tensor(q, k, v) else None
    dp = d
    if d is not None:
        if softmax_scale is None:
            softmax_scale = d ** (-0.5)
        if k.shape[-1] == d and v.shape[-1] == d:
            dp = _padded_headdim(d, SUPPORTED_HEADDIMS)
            q, k, v = (_pad_last(t, dp) for t in (q, k, v))
    out, lse = _attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        seqused_q=seqused_q, seqused_k=seqused_k, causal=causal, softmax_scale=softmax_scale,
        return_lse=True, deterministic=deterministic, **options,
    )
    if dp != d:
        out = out[..., :d].contiguous()
    return (out, lse) if return_attn_probs else out


# ----------------------------------------------------------------------------------------
# KV cache, split-KV combine, scheduler metadata
# ----------------------------------------------------------------------------------------


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    page_table=None,
    cu_seqlens_q=None,
    cu_seqlens_k_new=None,
    max_seqlen_q=None,
    rotary_seqlens=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
    return_softmax_lse=False,
    *,
    learnable_sink=None,
):
    """FlashAttention-3's ``flash_attn_with_kvcache`` on :func:`flash3.attention_with_kvcache`.

    Dense or paged caches (``page_table``, any page size), the in-place append of ``k``,
    ``v`` at ``cache_seqlens`` with the optional rotary embedding (``rotary_interleaved``
    defaults to True, as in FlashAttention), causal masks and windows bottom-right aligned,
    ``softcap``, ``learnable_sink`` (keyword-only), packed queries (``cu_seqlens_q``,
    ``max_seqlen_q``; no new tokens with them), ``num_splits`` (0: chosen from the shapes),
    bf16 / fp16, head dims 64, 96, 128, 192, 256.

    ``qv``, ``cache_batch_idx``, ``cache_leftpad``, ``cu_seqlens_k_new``,
    ``rotary_seqlens``, ``attention_chunk`` other than 0 and float8 caches raise
    ``NotImplementedError`` naming the argument. ``scheduler_metadata`` (from
    :func:`get_scheduler_metadata`), ``pack_gqa`` and ``sm_margin`` are accepted and
    ignored; descales with bf16/fp16 tensors are ignored, as FlashAttention-3 ignores them.

    Returns out like q, or (out, softmax_lse) with softmax_lse float32 (batch, nheads,
    seqlen_q) ((nheads, total_q) with cu_seqlens_q).
    """
    fname = "flash_attn_with_kvcache"
    _check_common(fname, qv=qv, softcap=softcap, attention_chunk=attention_chunk)
    for name, value in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
                        ("cu_seqlens_k_new", cu_seqlens_k_new), ("rotary_seqlens", rotary_seqlens)):
        if value is not None:
            _not_implemented(fname, name, value, {"cache_batch_idx": "indexing the cache's batch",
                                                  "cache_leftpad": "left-padded caches",
                                                  "cu_seqlens_k_new": "packed new tokens",
                                                  "rotary_seqlens": "rotary positions apart from cache_seqlens"}[name])
    if isinstance(q, torch.Tensor) and q.dtype == _E4M3:
        _not_implemented(fname, "q.dtype", q.dtype, "an FP8 KV cache")
    if cache_seqlens is None:
        raise TypeError(f"{fname}: cache_seqlens is None; supported: an int32 tensor (batch,) or an int")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"{fname}: num_splits is {num_splits!r}; supported: an int >= 0 (0: chosen from the shapes)")
    capacity = None
    if isinstance(k_cache, torch.Tensor) and k_cache.dim() == 4:
        capacity = k_cache.shape[1] * (page_table.shape[1] if isinstance(page_table, torch.Tensor) else 1)
    seqlen_q = max_seqlen_q if cu_seqlens_q is not None else (q.shape[1] if isinstance(q, torch.Tensor) else None)
    causal, window = _window(fname, window_size, causal, seqlen_q, capacity)
    _check_learnable_sink(fname, learnable_sink, q)
    from .kvcache import attention_with_kvcache

    out, lse = attention_with_kvcache(
        q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, page_table=page_table, cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, causal=causal, window_size=window, softcap=softcap or 0.0,
        sinks=learnable_sink, softmax_scale=softmax_scale, num_splits=num_splits, return_lse=True)
    return (out, lse) if return_softmax_lse else out


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """FlashAttention-3's combine of split-KV partial results: :func:`flash3.combine.combine`
    (float32 (num_splits, batch, seqlen, nheads, headdim) outputs and (num_splits, batch,
    seqlen, nheads) logsumexps in; (out, softmax_lse) out)."""
    return _combine(out_partial, lse_partial, out=out, out_dtype=out_dtype)


def get_scheduler_metadata(*args, **kwargs):
    """FlashAttention-3's scheduler metadata for :func:`flash_attn_with_kvcache`. flash3's
    KV-cache call computes what it needs on the device within the call (no host
    synchronisation, CUDA-graph safe), so there is no metadata: returns None, which
    :func:`flash_attn_with_kvcache` accepts as ``scheduler_metadata``."""
    return None
