"""The KV cache as the kernels see it (flash3/kvcache.py): the in-place append of new
tokens (after the optional rotary embedding of q and k), and a dense or paged cache seen
as packed (rows, nheads_k, headdim) K and V, read in place where the kernels can follow
it and gathered otherwise."""
from __future__ import annotations

import torch

# The kernels read a paged cache in boxes of this many rows (params.h kPageChunkRows):
# page sizes, the rows between pages and split starts must be multiples of it.
PAGE_CHUNK = 16


def _rotate(x, cos, sin, interleaved):
    """x (..., headdim) with cos, sin (..., rotary_dim / 2) broadcast over its heads:
    the first rotary_dim features rotated (GPT-NeoX halves, or GPT-J pairs), in float32."""
    rd = 2 * cos.shape[-1]
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., rd:]), dim=-1)


def _slots(c, cache_seqlens, page_table, positions):
    """Indices into k_cache's first two dims of the cache slots at `positions` (batch, n)."""
    if not c.paged:
        rows = torch.arange(c.batch, device=positions.device).unsqueeze(1).expand_as(positions)
        return rows, positions
    pages = page_table.long().gather(1, torch.div(positions, c.page_size, rounding_mode="floor"))
    return pages, positions % c.page_size


def append_new_tokens(c, q, k_cache, v_cache, k, v, cache_seqlens, page_table, rotary_cos, rotary_sin, interleaved):
    """Rotates q and k (where rotary tables are given) and writes k, v into the cache at
    cache_seqlens[b] + t. Returns the (maybe rotated) q."""
    t = torch.arange(c.seqlen_new, device=q.device)
    positions = cache_seqlens.long().unsqueeze(1) + t  # (batch, seqlen_new)
    if rotary_cos is not None:
        cos, sin = rotary_cos.float()[positions], rotary_sin.float()[positions]  # (batch, n, rd / 2)
        k = _rotate(k, cos.unsqueeze(2), sin.unsqueeze(2), interleaved)
        # Queries sit at the new tokens' positions when a causal mask or window orders them;
        # otherwise all at the first new position (FlashAttention's convention).
        tq = torch.arange(c.seqlen_q, device=q.device) if (c.causal or c.window_left >= 0 or c.window_right >= 0) \
            else torch.zeros(c.seqlen_q, dtype=torch.long, device=q.device)
        pos_q = cache_seqlens.long().unsqueeze(1) + tq
        q = _rotate(q, rotary_cos.float()[pos_q].unsqueeze(2), rotary_sin.float()[pos_q].unsqueeze(2), interleaved)
    index = _slots(c, cache_seqlens, page_table, positions)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)
    return q


class CacheRows:
    """K and V as packed (rows, nheads_k, headdim) tensors, sequence b's keys from row
    b * per_batch, and pages: None, or (page_table, page_size, page_rows) when those rows
    are the kernels' virtual rows through the page table (params.h)."""

    def __init__(self, keys, values, per_batch, pages=None):
        self.keys, self.values, self.per_batch, self.pages = keys, values, per_batch, pages

    @property
    def total(self):
        """The rows the splits op ends cu_seqlens_k with."""
        return self.keys.shape[0] if self.pages is None else self.pages[0].shape[0] * self.per_batch

    def kernel_args(self):
        """fwd_varlen's trailing page arguments."""
        return self.pages if self.pages is not None else (None, 0, 0)


def paged_rows_view(c, cache):
    """A paged cache as (rows, nheads_k, headdim), page p's slots from row p * page_rows,
    and page_rows; None where the pages are not a whole number of rows apart."""
    page_stride, row_stride, head_stride = cache.stride(0), cache.stride(1), cache.stride(2)
    if row_stride == 0 or page_stride % row_stride != 0:
        return None
    page_rows = page_stride // row_stride
    total = (cache.shape[0] - 1) * page_rows + c.page_size
    return cache.as_strided((total, c.nheads_k, c.headdim), (row_stride, head_stride, 1)), page_rows


def cache_rows(c, k_cache, v_cache, seqlens, page_table, starts_aligned=True):
    """The cache as CacheRows. A paged cache is read in place through the page table where its
    pages are whole boxes and every key range starts at a box (starts_aligned: no left
    window cuts a split's first box); otherwise the pages a sequence uses are gathered."""
    if c.paged:
        views = (paged_rows_view(c, k_cache), paged_rows_view(c, v_cache))
        if (starts_aligned and c.page_size % PAGE_CHUNK == 0 and None not in views
                and views[0][1] == views[1][1] and views[0][1] % PAGE_CHUNK == 0
                and (c.split_size is None or c.split_size % PAGE_CHUNK == 0)
                and c.batch * c.capacity < 2 ** 31 and views[0][0].shape[0] < 2 ** 31):
            pages = (page_table.contiguous(), c.page_size, views[0][1])
            return CacheRows(views[0][0], views[1][0], c.capacity, pages)
        # Only the pages a sequence uses are gathered; the others read page 0 (any
        # value: they lie past the length, where nothing is read).
        max_pages = page_table.shape[1]
        used = (torch.arange(max_pages, device=k_cache.device) * c.page_size).unsqueeze(0) < seqlens.unsqueeze(1)
        pages = torch.where(used, page_table, torch.zeros_like(page_table)).flatten().long()
        gathered = []
        for cache in (k_cache, v_cache):
            if cache.is_contiguous():
                flat = cache.view(cache.shape[0], -1).index_select(0, pages)
            else:
                flat = cache[pages].reshape(pages.shape[0], -1)
            gathered.append(flat.view(-1, c.nheads_k, c.headdim))
        return CacheRows(gathered[0], gathered[1], c.capacity)
    views = []
    for cache in (k_cache, v_cache):
        batch_stride, row_stride, head_stride = cache.stride(0), cache.stride(1), cache.stride(2)
        if c.batch > 1 and batch_stride % row_stride != 0:
            cache = cache.contiguous()  # batches not a whole number of rows apart: one copy
            batch_stride, row_stride, head_stride = cache.stride(0), cache.stride(1), cache.stride(2)
        per_batch = batch_stride // row_stride if c.batch > 1 else c.capacity
        total = (c.batch - 1) * per_batch + c.capacity if c.batch > 0 else 0
        views.append((cache.as_strided((total, c.nheads_k, c.headdim), (row_stride, head_stride, 1)), per_batch))
    if views[0][1] != views[1][1]:  # K and V batches apart by different row counts
        return CacheRows(k_cache.contiguous().view(-1, c.nheads_k, c.headdim),
                     v_cache.contiguous().view(-1, c.nheads_k, c.headdim), c.capacity)
    return CacheRows(views[0][0], views[1][0], views[0][1])
