"""Attention against a KV cache (decoding and chunked prefill): ``flash3.attention_with_kvcache``.

The cache is dense, (batch, seqlen_cache, nheads_k, headdim), or paged, (num_pages,
page_size, nheads_k, headdim) with a (batch, max_pages) int32 page table. New tokens are
written into it in place (after the optional rotary embedding), then every query attends
to its sequence's first ``cache_seqlens[b] + seqlen_new`` keys.

The attention runs on the variable-length forward kernels (``torch.ops.flash3.fwd_varlen``):
each sequence's keys are a slot of the cache seen as one packed tensor, and
``seqused_k`` holds the lengths, so nothing is synchronised with the host and a decode
step can be captured in a CUDA graph. Two things make a decode step (one query token, or
a few: speculative decoding) fill the GPU:

* GQA packing: the query heads that share a K/V head become rows of one tile, so a
  single query token does not leave a 128-row tile almost empty;
* split-KV: each sequence's key range is cut into ``num_splits`` parts that run as
  sequences of their own, and the parts' normalised outputs are merged with their
  logsumexps (flash3.combine's formula). The split of a sequence depends only on its own
  length and the split count, so with a fixed ``num_splits`` (or ``split_size``) a
  request's output does not depend on the rest of the batch.

Where every query row sees the same keys (one query, or neither a causal mask nor a
window) the parts run the unmasked kernels. Otherwise the kernels apply the mask to the
packed rows (row r is query r // group) with each part aligned to its sequence's end
(``split_keys``, csrc/flash3/params.h), while the packed rows fit one query tile; longer
query chunks run one kernel call over the cache, the mask applied per query head.

Sinks are merged into the logsumexp after the kernels there (they join the denominator
with no value). A paged cache whose pages are whole boxes of 16 rows is read in place:
the kernels follow the page table (csrc/flash3/paged_kv.h), sequence b's keys being the
virtual rows from b * max_pages * page_size. Other page sizes, and a left window with
one query row (where a split starts mid-box), gather the pages a sequence uses into a
contiguous buffer first, or with pages of 128 keys or more run each page as a split.
"""
from __future__ import annotations

import math

import torch

from .interface import _C, _check_built, _check_devices, _check_flags, _check_options, _mask_kind
from .interface import SUPPORTED_DTYPES, SUPPORTED_HEADDIMS
from .interface import _fail as _fail_as
from .kvcache_layout import CacheRows, append_new_tokens, cache_rows, paged_rows_view

__all__ = ["attention_with_kvcache"]

_NAME = "flash3.attention_with_kvcache"
# Keys per split are a multiple of this (whole key tiles in every split but the last).
_SPLIT_ALIGN = 128
_MAX_SPLITS = 128
# Masked query chunks run packed and split (_attend_masked) while their packed rows
# (seqlen_q * query heads per K/V head) fit one query tile; beyond, one kernel call over
# the cache is faster (a 4 x 8192-token prefill through the split wrote and merged a
# partial output of every row: 3x the time of the one call).
_MASKED_SPLIT_ROWS = 128
# Pages of a multiple of 128 keys, read in place: splits of at most this many keys per
# head dim, so that the packed kernels run their short-sequence tile (traits.h
# short_seq_max_seqlen, unmasked), whose 128- and 64-key tiles each lie in one page and
# load as one TMA box; the general hdim 128 and 256 tiles (176 and 80 keys) cross pages.
# (H200, hdim 128, 8 K/V heads, one query, batch 8, 32k keys on pages of 128: 16 splits
# 3797 GB/s, 2 splits 3035.)
_PAGED_SPLIT_KEYS = {128: 2048, 256: 512}
# Where the kernels cannot follow the page table, paged caches with pages of at least
# this many keys run each page as a split of its own (_pages_in_place); smaller pages are
# gathered into a contiguous buffer first (a page would fill too little of a key tile).
_PAGE_SPLIT_MIN = 128


if _C is not None:

    @torch.library.register_fake("flash3::kvcache_splits")
    def _splits_fake(seqlens, page_table, page_size, per_batch, window_left, splits, align, fixed_size, total_rows,
                     seqlen_q=1, split_keys=False):
        n = seqlens.shape[0] * splits
        return seqlens.new_empty((n + 1,)), seqlens.new_empty((n,))

    @torch.library.register_fake("flash3::kvcache_pack")
    def _pack_fake(q, seqlens, per_batch, window_left, splits, align, fixed_size, total_rows, group, split_keys):
        batch, seqlen_q, nheads, headdim = q.shape
        parts = batch * splits
        q_rows = q.new_empty((parts * seqlen_q * group, nheads // group, headdim))
        return q_rows, seqlens.new_empty((parts + 1,)), seqlens.new_empty((parts + 1,)), seqlens.new_empty((parts,))

    @torch.library.register_fake("flash3::kvcache_combine")
    def _combine_fake(out_partial, lse_partial, sinks, group):
        batch, _, rows, nheads_k, headdim = out_partial.shape
        out = out_partial.new_empty((batch, rows // group, nheads_k * group, headdim))
        return out, lse_partial.new_empty((batch, nheads_k * group, rows // group))


def _fail(exc_type, name, value, supported):
    _fail_as(exc_type, name, value, supported, _NAME)


def _check_tensor(name, t, dims, layout, dtype=None):
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, name, type(t).__name__, f"a torch.Tensor {layout}")
    if t.dim() != dims:
        _fail(ValueError, f"{name}.dim()", t.dim(), f"{dims}: {layout}")
    if dtype is not None and t.dtype != dtype:
        _fail(TypeError, f"{name}.dtype", t.dtype, str(dtype))


def _check_int(name, value, low, what):
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(TypeError, name, type(value).__name__, what)
    if value < low:
        _fail(ValueError, name, value, what)


def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


class _Call:
    """The checked arguments of one call and the shapes derived from them."""

    def __init__(self, q, k_cache, v_cache, k, v, cache_seqlens, page_table, cu_seqlens_q, max_seqlen_q, rotary_cos,
                 rotary_sin, rotary_interleaved, causal, window_size, softcap, sinks, softmax_scale, num_splits,
                 split_size, return_lse):
        self.packed_q = cu_seqlens_q is not None
        if self.packed_q:
            _check_tensor("q", q, 3, "(total_q, nheads, headdim) with cu_seqlens_q")
        else:
            _check_tensor("q", q, 4, "(batch, seqlen_q, nheads, headdim)")
        if q.dtype not in SUPPORTED_DTYPES:
            _fail(TypeError, "q.dtype", q.dtype, "torch.bfloat16, torch.float16")
        self.paged = page_table is not None
        layout = "(num_pages, page_size, nheads_k, headdim)" if self.paged else "(batch, seqlen_cache, nheads_k, headdim)"
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            _check_tensor(name, t, 4, layout, q.dtype)
        if v_cache.shape != k_cache.shape:
            _fail(ValueError, "v_cache.shape", tuple(v_cache.shape), f"the shape of k_cache {tuple(k_cache.shape)}")
        self.nheads, self.headdim = q.shape[-2], q.shape[-1]
        self.nheads_k = k_cache.shape[2]
        if self.headdim not in SUPPORTED_HEADDIMS:
            _fail(ValueError, "headdim", self.headdim, ", ".join(map(str, SUPPORTED_HEADDIMS)))
        if k_cache.shape[3] != self.headdim:
            _fail(ValueError, "k_cache.shape[3] (headdim)", k_cache.shape[3], f"the headdim of q ({self.headdim})")
        if self.nheads_k == 0 or self.nheads % self.nheads_k != 0:
            _fail(ValueError, "k_cache.shape[2] (nheads_k)", self.nheads_k,
                  f"a divisor of q's nheads ({self.nheads}) (GQA/MQA)")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.stride(-1) != 1:
                _fail(ValueError, f"{name}.stride(-1)", t.stride(-1), "1 (a contiguous head dim)")

        if self.packed_q:
            _check_tensor("cu_seqlens_q", cu_seqlens_q, 1, "(batch + 1,) of int32", torch.int32)
            self.batch = cu_seqlens_q.shape[0] - 1
            if self.batch < 0:
                _fail(ValueError, "cu_seqlens_q.shape[0]", 0, "batch + 1 >= 1")
            _check_int("max_seqlen_q", max_seqlen_q, 0, "a Python int >= 0 with cu_seqlens_q")
            self.seqlen_q = max_seqlen_q
        else:
            if max_seqlen_q is not None:
                _fail(ValueError, "max_seqlen_q", max_seqlen_q, "None without cu_seqlens_q")
            self.batch, self.seqlen_q = q.shape[0], q.shape[1]

        if self.paged:
            _check_tensor("page_table", page_table, 2, "(batch, max_pages) of int32", torch.int32)
            if page_table.shape[0] != self.batch:
                _fail(ValueError, "page_table.shape[0]", page_table.shape[0], f"the batch size ({self.batch})")
            self.page_size = k_cache.shape[1]
            if self.page_size < 1:
                _fail(ValueError, "k_cache.shape[1] (page_size)", self.page_size, ">= 1")
            self.capacity = page_table.shape[1] * self.page_size
        else:
            if k_cache.shape[0] != self.batch:
                _fail(ValueError, "k_cache.shape[0] (batch)", k_cache.shape[0], f"the batch size of q ({self.batch})")
            self.capacity = k_cache.shape[1]

        if isinstance(cache_seqlens, bool) or cache_seqlens is None:
            _fail(TypeError, "cache_seqlens", repr(cache_seqlens), "an int32 tensor (batch,) or a Python int")
        if isinstance(cache_seqlens, int):
            if not 0 <= cache_seqlens <= self.capacity:
                _fail(ValueError, "cache_seqlens", cache_seqlens, f"0 <= cache_seqlens <= the cache's {self.capacity} slots")
        else:
            _check_tensor("cache_seqlens", cache_seqlens, 1, "(batch,) of int32", torch.int32)
            if cache_seqlens.shape[0] != self.batch:
                _fail(ValueError, "cache_seqlens.shape[0]", cache_seqlens.shape[0], f"the batch size ({self.batch})")

        self.seqlen_new = 0
        if (k is None) != (v is None):
            _fail(ValueError, "k" if k is None else "v", None, "k and v both given (new tokens) or both None")
        if k is not None:
            if self.packed_q:
                _fail(ValueError, "k", "a tensor", "None with cu_seqlens_q (write the cache before the call)")
            for name, t in (("k", k), ("v", v)):
                _check_tensor(name, t, 4, "(batch, seqlen_new, nheads_k, headdim)", q.dtype)
            if k.shape != v.shape:
                _fail(ValueError, "v.shape", tuple(v.shape), f"the shape of k {tuple(k.shape)}")
            want = (self.batch, k.shape[1], self.nheads_k, self.headdim)
            if tuple(k.shape) != want:
                _fail(ValueError, "k.shape", tuple(k.shape), f"(batch, seqlen_new, nheads_k, headdim) = {want}")
            self.seqlen_new = k.shape[1]
            if self.seqlen_new > self.capacity:
                _fail(ValueError, "k.shape[1] (seqlen_new)", self.seqlen_new,
                      f"at most the cache's {self.capacity} slots per sequence")

        self.rotary_dim = 0
        if (rotary_cos is None) != (rotary_sin is None):
            _fail(ValueError, "rotary_sin" if rotary_sin is None else "rotary_cos", None,
                  "rotary_cos and rotary_sin both given or both None")
        if rotary_cos is not None:
            if k is None:
                _fail(ValueError, "rotary_cos", "a tensor", "None unless new tokens k, v are given")
            for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
                _check_tensor(name, t, 2, "(seqlen_rotary, rotary_dim / 2)")
                if not t.is_floating_point():
                    _fail(TypeError, f"{name}.dtype", t.dtype, "a floating dtype")
            if rotary_cos.shape != rotary_sin.shape:
                _fail(ValueError, "rotary_sin.shape", tuple(rotary_sin.shape), f"the shape of rotary_cos {tuple(rotary_cos.shape)}")
            self.rotary_dim = 2 * rotary_cos.shape[1]
            if not 0 < self.rotary_dim <= self.headdim:
                _fail(ValueError, "rotary_cos.shape[1]", rotary_cos.shape[1], f"1..headdim / 2 ({self.headdim // 2})")
        if not isinstance(rotary_interleaved, bool):
            _fail(TypeError, "rotary_interleaved", type(rotary_interleaved).__name__, "bool")
        _check_flags(_NAME, causal, softmax_scale)
        self.window_left, self.window_right, self.softcap = _check_options(_NAME, q, window_size, softcap, sinks)
        _check_int("num_splits", num_splits, 0, "an int >= 0 (0: chosen from the shapes)")
        if split_size is not None:
            _check_int("split_size", split_size, 1, "None or an int >= 1 (keys per split)")
            if num_splits not in (0, 1):
                _fail(ValueError, "num_splits", num_splits, "0 with split_size (the split count follows from it)")
        if not isinstance(return_lse, bool):
            _fail(TypeError, "return_lse", type(return_lse).__name__, "bool")
        others = [("k_cache", k_cache), ("v_cache", v_cache)]
        others += [(n, t) for n, t in (("k", k), ("v", v), ("page_table", page_table), ("cu_seqlens_q", cu_seqlens_q),
                                       ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("sinks", sinks))
                   if t is not None]
        if isinstance(cache_seqlens, torch.Tensor):
            others.append(("cache_seqlens", cache_seqlens))
        _check_devices(_NAME, q, others)
        self.causal = causal
        self.softmax_scale = 1.0 / math.sqrt(self.headdim) if softmax_scale is None else float(softmax_scale)
        self.num_splits, self.split_size = num_splits, split_size


def _choose_splits(c, rows_per_seq, heads, device, max_keys=None):
    """(splits, keys per split as an upper bound): num_splits or split_size as given, else
    about one tile per SM, each of at least 256 keys. (H200, hdim 128, 8 K/V heads, one
    query: 16 splits at batch 1, 2 at batch 8, none from batch 32 measured best; twice as
    many tiles was 10-20% slower at batch 1 and 8.) max_keys: where given, the automatic
    count makes splits of at most that many keys (up to _MAX_SPLITS)."""
    if c.split_size is not None:
        size = c.split_size
        return max(1, -(-c.capacity // size)), size
    splits = c.num_splits
    if splits == 0:
        tiles = max(1, c.batch * heads * -(-rows_per_seq // 128))
        splits = min(max(1, round(_num_sms(device) / tiles)), -(-c.capacity // 256), _MAX_SPLITS)
        if max_keys is not None:
            splits = max(splits, min(-(-c.capacity // max_keys), _MAX_SPLITS))
    splits = max(1, min(splits, max(1, c.capacity)))
    size = -(-c.capacity // splits)
    return splits, -(-size // _SPLIT_ALIGN) * _SPLIT_ALIGN


def attention_with_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens, page_table=None,
                           cu_seqlens_q=None, max_seqlen_q=None, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved=False, causal=False, window_size=(-1, -1), softcap=0.0, sinks=None,
                           softmax_scale=None, num_splits=0, split_size=None, return_lse=False):
    """Attention of new queries against a KV cache, with the new keys and values appended.

    Args:
        q: (batch, seqlen_q, nheads, headdim), or packed (total_q, nheads, headdim) with
            ``cu_seqlens_q``; torch.bfloat16 or torch.float16, CUDA.
        k_cache, v_cache: the cache, q's dtype: dense (batch, seqlen_cache, nheads_k,
            headdim), or paged (num_pages, page_size, nheads_k, headdim) with ``page_table``.
            Any page size from 1. nheads % nheads_k == 0 (GQA/MQA). Written in place when
            ``k``, ``v`` are given.
        k, v: None, or the new tokens (batch, seqlen_new, nheads_k, headdim): written into
            the cache at slots ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1``
            (after the rotary embedding), then attended to.
        cache_seqlens: int32 (batch,) (or a Python int for all): the tokens already in each
            sequence's cache. Sequence b's queries attend to its first
            ``cache_seqlens[b] + seqlen_new`` keys; slots past them may hold anything, NaN
            included.
        page_table: int32 (batch, max_pages): page p of sequence b (its slots
            ``p * page_size ..``) is ``k_cache[page_table[b, p]]``. Entries for pages past a
            sequence's length are not read; entries in use must be valid page indices (the
            caller's contract: not checked on the device).
        cu_seqlens_q, max_seqlen_q: packed queries (chunked prefill): sequence b's queries
            are rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q (their last rows align with
            the sequence's last keys). No new tokens (k, v) with packed queries.
        rotary_cos, rotary_sin: None, or (seqlen_rotary, rotary_dim / 2) tables: k and q
            are rotated on their first rotary_dim features at their positions (the new
            tokens' ``cache_seqlens[b] + t``; q at the same positions when causal or
            windowed, else all at ``cache_seqlens[b]``). Only with k, v.
        rotary_interleaved: False rotates the two halves of the rotary features (GPT-NeoX),
            True adjacent pairs (GPT-J).
        causal, window_size, softcap, sinks, softmax_scale: as in ``flash3.attention``,
            bottom-right aligned to each sequence's keys.
        num_splits: split-KV parts per sequence (0: chosen from the shapes and the SM
            count). Applies to the keys every query row of a sequence sees: all of them
            with one query per sequence or neither causal nor windowed; with a few
            causal queries (no left window, seqlen_q x query heads per K/V head at most
            128), those before the first query's position rounded down to 16, the rest
            running causally apart; otherwise one part.
        split_size: None, or the keys per part (the part count then follows from the
            cache size): a request's output is then independent of the rest of the batch.
        return_lse: also return the logsumexp, float32 (batch, nheads, seqlen_q) (packed
            queries: (nheads, total_q)).

    Returns:
        out like q, or (out, lse).

    The call never synchronises with the host (a decode step can be captured in a CUDA
    graph). Positions past the cache (``cache_seqlens[b] + seqlen_new > seqlen_cache``)
    are the caller's contract, like the page table's entries.
    """
    c = _Call(q, k_cache, v_cache, k, v, cache_seqlens, page_table, cu_seqlens_q, max_seqlen_q, rotary_cos,
              rotary_sin, rotary_interleaved, causal, window_size, softcap, sinks, softmax_scale, num_splits,
              split_size, return_lse)
    device = q.device
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((c.batch,), cache_seqlens, dtype=torch.int32, device=device)
    if k is not None:
        q = append_new_tokens(c, q, k_cache, v_cache, k, v, cache_seqlens, page_table, rotary_cos, rotary_sin,
                              rotary_interleaved)
    seqlens = cache_seqlens + c.seqlen_new if c.seqlen_new else cache_seqlens.contiguous()  # int32 (batch,)
    unwindowed = c.window_left < 0 and c.window_right < 0
    if not c.packed_q and (c.seqlen_q == 1 or (not c.causal and unwindowed)):
        out, lse = _attend_same_keys(c, q, k_cache, v_cache, seqlens, page_table, sinks)
    elif not c.packed_q and c.seqlen_q * (c.nheads // c.nheads_k) <= _MASKED_SPLIT_ROWS:
        out, lse = _attend_masked(c, q, k_cache, v_cache, seqlens, page_table, sinks)
    else:
        kv = cache_rows(c, k_cache, v_cache, seqlens, page_table)
        return _attend_rows(c, q, kv, seqlens, cu_seqlens_q, sinks, return_lse)
    return (out, lse) if return_lse else out


def _attend_same_keys(c, q, k_cache, v_cache, seqlens, page_table, sinks):
    """Every query row of sequence b sees its keys [lo, seqlens[b]) (lo: a left window's
    start for one query row, else 0): GQA packing and split-KV. Returns (out, lse)."""
    if (c.paged and c.window_left >= 0 and c.page_size >= _PAGE_SPLIT_MIN
            and _pages_in_place(c, q.device, page_table)):
        return _attend_pages(c, q, k_cache, v_cache, seqlens, page_table, sinks)
    kv = cache_rows(c, k_cache, v_cache, seqlens, page_table, starts_aligned=c.window_left < 0)
    return _attend_split(c, q, kv, seqlens, sinks, masked=False)


def _attend_masked(c, q, k_cache, v_cache, seqlens, page_table, sinks):
    """A few query tokens under a causal mask or a window: GQA packing and split-KV, the
    kernels applying the mask to the packed rows, each part aligned to its sequence's
    last key (split_keys). Parts start at a box of 16 keys (kvcache_layout.PAGE_CHUNK).
    Returns (out, lse)."""
    kv = cache_rows(c, k_cache, v_cache, seqlens, page_table)
    return _attend_split(c, q, kv, seqlens, sinks, masked=True)


def _attend_split(c, q, kv, seqlens, sinks, masked):
    """Sequence b's keys (from a left window's start) cut into parts, run packed."""
    max_keys = _PAGED_SPLIT_KEYS.get(c.headdim) if kv.pages is not None and c.page_size % 128 == 0 else None
    splits, max_split = _choose_splits(c, c.seqlen_q * (c.nheads // c.nheads_k), c.nheads_k, q.device, max_keys)
    if q.stride(-1) != 1:
        q = q.contiguous()
    # One launch: the splits' key rows and lengths, their query offsets, and the queries
    # packed for them (_pack_queries' layout).
    q_rows, cu_q, cu_k, used = torch.ops.flash3.kvcache_pack(q, seqlens, kv.per_batch, c.window_left, splits,
                                                             _SPLIT_ALIGN, c.split_size or 0, kv.total,
                                                             c.nheads // c.nheads_k, masked)
    return _attend_packed(c, q_rows, cu_q, cu_k, used, kv, splits, max_split, sinks, masked)


def _pages_in_place(c, device, page_table):
    """Whether a paged cache of large pages is read in place (else gathered): the merge of
    the pages' results runs one CTA per (sequence, row, K/V head) over all the pages, so
    with few such rows and many pages it is slow. (H200, hdim 128, 8 K/V heads, one query:
    in place 1.5-2.6x faster than the gather from batch 8 and at 1k-8k keys; 0.9x at batch
    1 and 32k keys, 0.65x at 128k.)"""
    rows = c.batch * c.seqlen_q * c.nheads
    return page_table.shape[1] <= 128 or rows >= _num_sms(device)


def _attend_pages(c, q, k_cache, v_cache, seqlens, page_table, sinks):
    """A paged cache of large pages where a left window starts the keys mid-box: each
    page is a split, read in place."""
    views = (paged_rows_view(c, k_cache), paged_rows_view(c, v_cache))
    if None in views or views[0][1] != views[1][1]:
        views = (paged_rows_view(c, k_cache.contiguous()), paged_rows_view(c, v_cache.contiguous()))  # one copy
    (keys, page_rows), (values, _) = views
    splits = page_table.shape[1]
    cu_k, used = torch.ops.flash3.kvcache_splits(seqlens, page_table.contiguous(), c.page_size, page_rows,
                                                 c.window_left, splits, 1, 0, keys.shape[0], 1, False)
    q_rows, cu_q = _pack_queries(c, q, splits)
    return _attend_packed(c, q_rows, cu_q, cu_k, used, CacheRows(keys, values, page_rows), splits, c.page_size, sinks,
                          False)


def _attend_rows(c, q, kv, seqlens, cu_seqlens_q, sinks, return_lse):
    """One sequence per cache slot, the mask applied by the kernel."""
    mask = _mask_kind(c.causal, (c.window_left, c.window_right), c.softcap, sinks, max(c.seqlen_q, 1),
                      max(c.capacity, 1))
    _check_built("fwd", q, c.causal, mask, _NAME)
    if cu_seqlens_q is None:
        cu_seqlens_q = torch.arange(c.batch + 1, device=q.device, dtype=torch.int32) * c.seqlen_q
        q_rows = q.reshape(c.batch * c.seqlen_q, c.nheads, c.headdim)
    else:
        q_rows = q
    # One part per sequence: its keys [0, seqlens[b]) from row b * per_batch.
    cu_k, used = torch.ops.flash3.kvcache_splits(seqlens, None, 0, kv.per_batch, -1, 1, _SPLIT_ALIGN, 0, kv.total, 1,
                                                 False)
    out, lse = torch.ops.flash3.fwd_varlen(
        q_rows, kv.keys, kv.values, cu_seqlens_q.contiguous(), cu_k, None, used, c.seqlen_q, c.capacity,
        c.softmax_scale, c.causal, False, c.window_left, c.window_right, c.softcap,
        None if sinks is None else sinks.float().contiguous(), *kv.kernel_args())
    if c.packed_q:
        return (out, lse) if return_lse else out
    out = out.view(c.batch, c.seqlen_q, c.nheads, c.headdim)
    lse = lse.view(c.nheads, c.batch, c.seqlen_q).transpose(0, 1)
    return (out, lse) if return_lse else out


def _pack_queries(c, q, splits):
    """GQA packing, once per split: query head h = kvh * g + j at position t becomes row
    t * g + j of K/V head kvh in part b * splits + s. Returns (q_rows, cu_q)."""
    g = c.nheads // c.nheads_k
    rows = c.seqlen_q * g
    qp = q.reshape(c.batch, c.seqlen_q, c.nheads_k, g, c.headdim).permute(0, 1, 3, 2, 4)
    qp = qp.reshape(c.batch, 1, rows, c.nheads_k, c.headdim).expand(c.batch, splits, rows, c.nheads_k, c.headdim)
    n = c.batch * splits + 1
    cu_q = (torch.arange(0, n * rows, rows, device=q.device, dtype=torch.int32) if rows > 0  # one launch
            else torch.zeros(n, device=q.device, dtype=torch.int32))
    return qp.reshape(c.batch * splits * rows, c.nheads_k, c.headdim), cu_q


def _attend_packed(c, q_rows, cu_q, cu_k, used, kv, splits, max_split, sinks, masked):
    """Split-KV over GQA-packed queries (_pack_queries' layout): split j of sequence b is
    packed-batch sequence b * splits + j, its queries at cu_q and its keys at cu_k, used.
    masked: the call's causal mask and window apply, each split aligned to its sequence's
    end (split_keys); else every row sees the split's keys. Returns (out, lse)."""
    g = c.nheads // c.nheads_k
    rows = c.seqlen_q * g
    causal = c.causal and masked
    window = (c.window_left, c.window_right) if masked else (-1, -1)
    mask = _mask_kind(causal, window, c.softcap, None, rows, max(c.capacity, 1))
    _check_built("fwd", q_rows, causal, mask, _NAME)
    out, lse = torch.ops.flash3.fwd_varlen(
        q_rows, kv.keys, kv.values, cu_q, cu_k, None, used, rows, max_split, c.softmax_scale, causal, False, *window,
        c.softcap, None, *kv.kernel_args(), g, masked)
    return torch.ops.flash3.kvcache_combine(
        out.view(c.batch, splits, rows, c.nheads_k, c.headdim), lse.view(c.nheads_k, c.batch, splits, rows),
        None if sinks is None else sinks.float().contiguous(), g)
