"""flash3.attention_with_kvcache's composition, on the CPU: the cache append with rotary
embedding, the dense and paged key views, GQA packing, the splits' layout and the merge,
with the compiled ops replaced by PyTorch models of them (a per-sequence float64
attention for fwd_varlen; kvcache_splits, kvcache_pack and kvcache_combine as
csrc/kvcache.cu defines them). Every sequence is checked against
flash3.reference.attention_ref on keys built here, independently of the cache's layout. The kernels themselves are tested on the GPU
(test_kvcache_gpu.py).
"""
import math
import types

import pytest
import torch

import flash3
import flash3.kvcache as kvcache
from flash3.reference import attention_ref

DT = torch.float32


def _masked_attention(q, k, v, scale, causal, left, right, softcap, sinks, group, keys_after):
    """The kernels' masks on one sequence (csrc/flash3/mask.h): row r is query r // group,
    bottom-right aligned to the keys read plus keys_after more; float64."""
    rows, nk = q.shape[0], k.shape[0]
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))  # GQA
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    query = torch.arange(rows).unsqueeze(1) // group
    key = torch.arange(nk).unsqueeze(0)
    offset = nk + keys_after - rows // group
    visible = torch.ones(rows, nk, dtype=torch.bool)
    if causal:
        visible &= key <= query + offset
    if left >= 0:
        visible &= key >= query + offset - left
    if right >= 0 and not causal:
        visible &= key <= query + offset + right
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # one more logit per head, no value
        scores = torch.cat((scores, sinks.double().view(-1, 1, 1).expand(-1, rows, 1)), dim=-1)
    lse = torch.logsumexp(scores, dim=-1)  # (h, rows)
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    out = torch.einsum("hqk,khd->qhd", probs[..., :nk], v.double())
    return out, lse


def _fwd_varlen(q, k, v, cu_q, cu_k, used_q, used_k, max_q, max_k, scale, causal, deterministic, left, right,
                softcap, sinks, page_table=None, page_size=0, page_rows=0, rows_per_query=1, split_keys=False):
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"))
    cq, ck = cu_q.tolist(), cu_k.tolist()
    if page_table is not None:  # cu_k holds virtual rows (csrc/flash3/params.h)
        assert page_size % 16 == 0 and page_rows % 16 == 0 and all(x % 16 == 0 for x in ck[:-1])
        flat = page_table.flatten().long()
    # The binding's window normalisation (split_keys: not clamped to max_k).
    left_b = -1 if left >= (2**30 if split_keys else max_k) - 1 else left
    right_b = -1 if right >= max_q - 1 else right
    for b in range(len(cq) - 1):
        nq = cq[b + 1] - cq[b] if used_q is None else int(used_q[b])
        nk = ck[b + 1] - ck[b] if used_k is None else int(used_k[b])
        keys_after = 0
        if split_keys:  # csrc/flash3/seqlen.h: the slot is read, the rest counts for the mask
            assert used_k is not None and nq % rows_per_query == 0
            keys_after = max(nk - max(ck[b + 1] - ck[b], 0), 0)
            nk -= keys_after
        if page_table is not None:
            virtual = torch.arange(ck[b], ck[b] + nk)
            rows = flat[virtual // page_size] * page_rows + virtual % page_size
        else:
            rows = torch.arange(ck[b], ck[b] + nk)
        o, l = _masked_attention(q[cq[b]:cq[b] + nq], k[rows], v[rows], scale, causal, left_b, right_b, softcap,
                                 sinks, rows_per_query, keys_after)
        out[cq[b]:cq[b] + nq] = o.to(q.dtype)
        lse[:, cq[b]:cq[b] + nq] = l.float()
    return out, lse


def _kvcache_splits(seqlens, page_table, page_size, per_batch, window_left, splits, align, fixed_size, total_rows,
                    seqlen_q=1, split_keys=False):
    cu, used = [], []
    for b, n in enumerate(seqlens.tolist()):
        lo = max(0, n - seqlen_q - window_left) if window_left >= 0 else 0
        if split_keys:
            lo = lo // 16 * 16
        for j in range(splits):
            if page_table is not None:
                begin = j * page_size
                first, last = max(begin, lo), min(begin + page_size, n)
                cu.append(int(page_table[b, j]) * per_batch + first - begin if last > first else 0)
                used.append(max(last - first, 0))
            else:
                span = max(0, n - lo)
                size = fixed_size if fixed_size > 0 else -(-span // (splits * align)) * align
                cu.append(b * per_batch + lo + j * size)
                rest = max(span - j * size, 0)
                used.append(rest if split_keys else min(rest, size))
    return torch.tensor(cu + [total_rows], dtype=torch.int32), torch.tensor(used, dtype=torch.int32)


def _kvcache_pack(q, seqlens, per_batch, window_left, splits, align, fixed_size, total_rows, group, split_keys):
    batch, sq, nheads, d = q.shape
    cu_k, used = _kvcache_splits(seqlens, None, 0, per_batch, window_left, splits, align, fixed_size, total_rows, sq,
                                 split_keys)
    rows = sq * group
    packed = q.reshape(batch, sq, nheads // group, group, d).permute(0, 1, 3, 2, 4).reshape(batch, 1, rows,
                                                                                           nheads // group, d)
    q_rows = packed.expand(batch, splits, rows, nheads // group, d).reshape(batch * splits * rows, nheads // group, d)
    cu_q = torch.arange(batch * splits + 1, dtype=torch.int32) * rows
    return q_rows, cu_q, cu_k, used


def _kvcache_combine(out_partial, lse_partial, sinks, group):
    batch, splits, rows, nheads_k, d = out_partial.shape
    lse = lse_partial.permute(1, 2, 3, 0)  # (batch, splits, rows, nheads_k)
    terms = lse
    if sinks is not None:  # row r of K/V head kvh is query head kvh * group + r % group
        sink = sinks.view(nheads_k, group).t().repeat(rows // group, 1)  # (rows, nheads_k)
        terms = torch.cat((lse, sink.expand(batch, 1, rows, nheads_k)), dim=1)
    total = torch.logsumexp(terms, dim=1)  # (batch, rows, nheads_k)
    weights = torch.exp(lse - total.masked_fill(total == float("-inf"), 0.0).unsqueeze(1))
    out = (weights.unsqueeze(-1) * out_partial.float().nan_to_num(0.0)).sum(dim=1)
    sq = rows // group
    out = out.view(batch, sq, group, nheads_k, d).permute(0, 1, 3, 2, 4).reshape(batch, sq, nheads_k * group, d)
    total = total.view(batch, sq, group, nheads_k).permute(0, 3, 2, 1).reshape(batch, nheads_k * group, sq)
    return out.to(out_partial.dtype), total


@pytest.fixture
def cpu_ops(monkeypatch):
    ops = types.SimpleNamespace(flash3=types.SimpleNamespace(
        fwd_varlen=_fwd_varlen, kvcache_splits=_kvcache_splits, kvcache_pack=_kvcache_pack,
        kvcache_combine=_kvcache_combine))
    monkeypatch.setattr(kvcache.torch, "ops", ops)
    monkeypatch.setattr(kvcache, "SUPPORTED_DTYPES", (DT,))
    monkeypatch.setattr(kvcache, "_check_devices", lambda *args, **kwargs: None)
    monkeypatch.setattr(kvcache, "_check_built", lambda *args, **kwargs: None)
    monkeypatch.setattr(kvcache, "_num_sms", lambda device: 132)


def _cache(gen, lengths, capacity, hk, d, page_size, extra_tokens=0):
    """Logical keys and values per sequence, and the cache holding them (NaN elsewhere;
    page-table entries past what a sequence will use are out of range)."""
    batch = len(lengths)
    keys = [torch.randn(n, hk, d, generator=gen) for n in lengths]
    values = [torch.randn(n, hk, d, generator=gen) for n in lengths]
    if page_size is None:
        k = torch.full((batch, capacity, hk, d), float("nan"))
        v = k.clone()
        for b, n in enumerate(lengths):
            k[b, :n], v[b, :n] = keys[b], values[b]
        return keys, values, k, v, None
    max_pages = -(-capacity // page_size)
    pages = batch * max_pages + 3
    table = torch.randperm(pages, generator=gen).to(torch.int32)[: batch * max_pages].view(batch, max_pages).clone()
    k = torch.full((pages, page_size, hk, d), float("nan"))
    v = k.clone()
    for b, n in enumerate(lengths):
        idx = torch.arange(n)
        page = table[b].long()[idx // page_size]
        k[page, idx % page_size], v[page, idx % page_size] = keys[b], values[b]
        table[b, -(-(n + extra_tokens) // page_size):] = 10**6
    return keys, values, k, v, table


def _rotate(x, cos, sin, positions, interleaved):
    rd = 2 * cos.shape[1]
    xr = x[..., :rd].double()
    pairs = torch.complex(xr[..., 0::2], xr[..., 1::2]) if interleaved else torch.complex(xr[..., :rd // 2],
                                                                                         xr[..., rd // 2:])
    turned = pairs * torch.complex(cos[positions].double(), sin[positions].double()).unsqueeze(1)
    out = (torch.stack((turned.real, turned.imag), -1).flatten(-2) if interleaved
           else torch.cat((turned.real, turned.imag), -1))
    return torch.cat((out.to(x.dtype), x[..., rd:]), dim=-1)


def _run(seed, page_size, sq, causal=False, h=8, hk=2, d=64, lengths=(0, 1, 300, 1000, 129), capacity=1000,
         s_new=0, rotary=None, **options):
    gen = torch.Generator().manual_seed(seed)
    keys, values, k_cache, v_cache, table = _cache(gen, lengths, capacity, hk, d, page_size, s_new)
    q = torch.randn(len(lengths), sq, h, d, generator=gen)
    kwargs = {}
    if s_new:
        kwargs.update(k=torch.randn(len(lengths), s_new, hk, d, generator=gen),
                      v=torch.randn(len(lengths), s_new, hk, d, generator=gen))
    if rotary is not None:
        angles = torch.rand(capacity + s_new, 16, generator=gen) * 2 * math.pi
        kwargs.update(rotary_cos=angles.cos(), rotary_sin=angles.sin(), rotary_interleaved=rotary == "pairs")
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    out, lse = flash3.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, page_table=table,
                                             causal=causal, return_lse=True, **kwargs, **options)
    assert out.shape == q.shape and lse.shape == (len(lengths), h, sq)
    window = options.get("window_size", (-1, -1))
    for b, n in enumerate(lengths):
        k_b, v_b, q_b = keys[b], values[b], q[b]
        if s_new:
            k_new = kwargs["k"][b]
            if rotary is not None:
                pos = torch.arange(n, n + s_new)
                ordered = causal or window != (-1, -1)
                pos_q = torch.arange(n, n + sq) if ordered else torch.full((sq,), n)
                k_new = _rotate(k_new, kwargs["rotary_cos"], kwargs["rotary_sin"], pos, rotary == "pairs")
                q_b = _rotate(q_b, kwargs["rotary_cos"], kwargs["rotary_sin"], pos_q, rotary == "pairs")
            k_b, v_b = torch.cat((k_b, k_new)), torch.cat((v_b, kwargs["v"][b]))
        ref, ref_lse = attention_ref(q_b[None], k_b[None], v_b[None], causal=causal, window_size=window,
                                     softcap=options.get("softcap", 0.0), sinks=options.get("sinks"))
        assert (out[b].double() - ref[0]).abs().max().item() < 1e-4, f"sequence {b}"
        finite = torch.isfinite(ref_lse[0])
        assert torch.equal(torch.isfinite(lse[b]), finite), f"sequence {b}: lse -inf where the reference's is not"
        if finite.any():
            assert (lse[b][finite].double() - ref_lse[0][finite].double()).abs().max().item() < 1e-4


@pytest.mark.parametrize("page_size", [None, 1, 16, 128])
@pytest.mark.parametrize("sq", [1, 4, 40])  # 40 x 4 rows: more than one tile
@pytest.mark.parametrize("causal", [False, True])
def test_caches(cpu_ops, page_size, sq, causal):
    _run((page_size or 0) + sq, page_size, sq, causal)


@pytest.mark.parametrize("page_size", [None, 16, 128])
@pytest.mark.parametrize("s_new", [1, 3])
@pytest.mark.parametrize("rotary", [None, "halves", "pairs"])
def test_append(cpu_ops, page_size, s_new, rotary):
    _run(s_new, page_size, s_new, s_new > 1, lengths=(0, 5, 250, 509), capacity=512, s_new=s_new, rotary=rotary)


@pytest.mark.parametrize("options", [dict(num_splits=1), dict(num_splits=2), dict(num_splits=7), dict(num_splits=32),
                                     dict(num_splits=0), dict(split_size=512), dict(split_size=100)])
@pytest.mark.parametrize("sq, mask", [(1, {}), (5, dict(causal=True)), (3, dict(causal=True, window_size=(300, -1))),
                                      (6, dict(window_size=(1000, 2), softcap=3.0))])
def test_splits(cpu_ops, options, sq, mask):
    # Several query tokens under a mask: every split aligned to its sequence's end.
    _run(3, None, sq, h=16, hk=4, lengths=(3000, 1, 777, 0, 4096, 5), capacity=4096, **mask, **options)


@pytest.mark.parametrize("page_size", [16, 128, 256])
@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("case", ["window", "window_causal", "softcap", "sinks", "all"])
def test_options(cpu_ops, page_size, sq, case):
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(5))
    options = {
        "window": dict(window_size=(100, 0)),
        "window_causal": dict(window_size=(37, -1), causal=True),
        "softcap": dict(softcap=5.0, causal=True),
        "sinks": dict(sinks=sinks, causal=True),
        "all": dict(window_size=(200, 0), softcap=8.0, sinks=sinks),
    }[case]
    causal = options.pop("causal", False)
    _run(sq, page_size, sq, causal, lengths=(700, 5, 0, 1024, 128, 129), capacity=1024, **options)
