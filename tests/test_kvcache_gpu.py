"""GPU tests of flash3.attention_with_kvcache: dense and paged caches, the append with and
without rotary embedding, GQA packing and split-KV, windows, softcap and sinks, packed
queries, CUDA-graph replay.

Each sequence is compared with the float64 reference (flash3.reference.attention_ref) on
its logical keys, built here independently of the cache's layout, under the tolerance rule
of test_attention_gpu.py. Cache slots past a sequence's length and pages no sequence uses
hold NaN: they must never reach the output.
"""
import math

import pytest
import torch

import flash3
from flash3.reference import attention_ref

pytestmark = pytest.mark.gpu

DT = torch.bfloat16


def _skip_unless_built(d, mask="none", dtype=DT):
    if not flash3.is_supported("fwd", dtype, d, False, mask=mask):
        pytest.skip(f"fwd {dtype} hdim{d} {mask} not in this build")


class Cache:
    """A cache holding `lengths[b]` random tokens per sequence (NaN elsewhere), dense
    (page_size None) or paged with a shuffled page table."""

    def __init__(self, gen, batch, capacity, hk, d, lengths, page_size=None, dtype=DT):
        self.lengths = lengths
        self.logical_k = [torch.randn(n, hk, d, device="cuda", dtype=dtype, generator=gen) for n in lengths]
        self.logical_v = [torch.randn(n, hk, d, device="cuda", dtype=dtype, generator=gen) for n in lengths]
        self.page_size = page_size
        if page_size is None:
            self.k = torch.full((batch, capacity, hk, d), float("nan"), device="cuda", dtype=dtype)
            self.v = torch.full_like(self.k, float("nan"))
            for b, n in enumerate(lengths):
                self.k[b, :n] = self.logical_k[b]
                self.v[b, :n] = self.logical_v[b]
            self.page_table = None
        else:
            max_pages = -(-capacity // page_size)
            num_pages = batch * max_pages + 3  # a few pages no sequence owns
            perm = torch.randperm(num_pages, device="cuda", generator=gen).to(torch.int32)
            self.page_table = perm[: batch * max_pages].view(batch, max_pages).contiguous()
            self.k = torch.full((num_pages, page_size, hk, d), float("nan"), device="cuda", dtype=dtype)
            self.v = torch.full_like(self.k, float("nan"))
            for b, n in enumerate(lengths):
                idx = torch.arange(n, device="cuda")
                pages = self.page_table[b].long()[idx // page_size]
                self.k[pages, idx % page_size] = self.logical_k[b]
                self.v[pages, idx % page_size] = self.logical_v[b]

    def read(self, b, n):
        """Sequence b's first n slots, as the cache holds them now."""
        if self.page_table is None:
            return self.k[b, :n], self.v[b, :n]
        idx = torch.arange(n, device="cuda")
        pages = self.page_table[b].long()[idx // self.page_size]
        return self.k[pages, idx % self.page_size], self.v[pages, idx % self.page_size]

    def garble_unused_entries(self, final_lengths):
        """Page-table entries past each sequence's last page: out of range (never read)."""
        if self.page_table is None:
            return
        for b, n in enumerate(final_lengths):
            self.page_table[b, -(-n // self.page_size):] = 10**6 + b


def _rotary(gen, seqlen, rotary_dim):
    angle = torch.rand(seqlen, rotary_dim // 2, device="cuda", generator=gen, dtype=torch.float64) * 2 * math.pi
    return torch.cos(angle).float(), torch.sin(angle).float()


def _rotate_ref(x, cos, sin, positions, interleaved):
    """x (n, h, d) at positions (n,): complex multiplication of the rotary feature pairs."""
    rd = 2 * cos.shape[1]
    xr = x[..., :rd].double()
    if interleaved:
        pairs = torch.complex(xr[..., 0::2], xr[..., 1::2])
    else:
        pairs = torch.complex(xr[..., : rd // 2], xr[..., rd // 2:])
    rot = torch.complex(cos[positions].double(), sin[positions].double()).unsqueeze(1)
    turned = pairs * rot
    if interleaved:
        out = torch.stack((turned.real, turned.imag), dim=-1).flatten(-2)
    else:
        out = torch.cat((turned.real, turned.imag), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., rd:]), dim=-1)


def _check(q_b, k_b, v_b, out_b, lse_b, causal=False, window=(-1, -1), softcap=0.0, sinks=None):
    """One sequence (1, sq, h, d) against the float64 reference."""
    kw = dict(causal=causal, window_size=window, softcap=softcap, sinks=sinks)
    out_ref, lse_ref = attention_ref(q_b, k_b, v_b, upcast=True, **kw)
    out_pt, _ = attention_ref(q_b, k_b, v_b, upcast=False, **kw)
    assert torch.isfinite(out_b).all(), "NaN or inf in the output"
    err = (out_b.double() - out_ref).abs().max().item()
    err_pt = (out_pt.double() - out_ref).abs().max().item()
    ulp = torch.finfo(q_b.dtype).eps * max(out_ref.abs().max().item(), 1e-3)
    assert err <= 2 * err_pt + ulp, f"out error {err:.3e} > 2 x {err_pt:.3e} + {ulp:.1e}"
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse_b), finite), "lse finite where the reference's is not, or back"
    if finite.any():
        lse_err = (lse_b.double() - lse_ref)[finite].abs().max().item()
        assert lse_err <= 1e-3 * max(1.0, lse_ref[finite].abs().max().item()), f"lse error {lse_err:.3e}"


def _check_batch(q, cache, seqlens, out, lse, **kw):
    for b, n in enumerate(seqlens):
        _check(q[b:b + 1], cache.logical_k[b][:n][None], cache.logical_v[b][:n][None], out[b:b + 1],
               lse[b:b + 1], **kw)


LAYOUTS = [None, 1, 16, 48, 128]  # dense, then page sizes (48: key tiles across pages)


@pytest.mark.parametrize("page_size", LAYOUTS)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sq", [1, 4, 100])  # 100 x 4 query heads per K/V head: more rows than one tile
@pytest.mark.parametrize("causal", [False, True])
def test_attention_against_cache(seed, page_size, d, sq, causal):
    _skip_unless_built(d, "causal" if causal and sq > 1 else "none")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = [0, 1, 300, 1000, 129]  # 0, a partial tile, the full cache
    lengths[3] = 1000
    batch, capacity, h, hk = len(lengths), 1000, 8, 2
    cache = Cache(gen, batch, capacity, hk, d, lengths, page_size)
    cache.garble_unused_entries(lengths)
    q = torch.randn(batch, sq, h, d, device="cuda", dtype=DT, generator=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flash3.attention_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens, page_table=cache.page_table,
                                             causal=causal, return_lse=True)
    assert out.shape == q.shape and lse.shape == (batch, h, sq)
    _check_batch(q, cache, lengths, out, lse, causal=causal)


@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize("rotary", [None, "halves", "pairs"])
@pytest.mark.parametrize("s_new", [1, 3])
def test_append_then_attend(seed, page_size, rotary, s_new):
    d, h, hk = 128, 8, 8
    causal = s_new > 1
    _skip_unless_built(d, "causal" if causal else "none")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = [0, 5, 250, 512 - s_new]  # the last one fills the cache
    batch, capacity = len(lengths), 512
    cache = Cache(gen, batch, capacity, hk, d, lengths, page_size)
    final = [n + s_new for n in lengths]
    cache.garble_unused_entries(final)
    q = torch.randn(batch, s_new, h, d, device="cuda", dtype=DT, generator=gen)
    k_new = torch.randn(batch, s_new, hk, d, device="cuda", dtype=DT, generator=gen)
    v_new = torch.randn(batch, s_new, hk, d, device="cuda", dtype=DT, generator=gen)
    kw = {}
    interleaved = rotary == "pairs"
    if rotary is not None:
        cos, sin = _rotary(gen, capacity + 4, 64)
        kw = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flash3.attention_with_kvcache(q, cache.k, cache.v, k=k_new, v=v_new, cache_seqlens=seqlens,
                                             page_table=cache.page_table, causal=causal, return_lse=True, **kw)
    for b, n in enumerate(lengths):
        pos = torch.arange(n, n + s_new, device="cuda")
        k_b, q_b = k_new[b], q[b]
        if rotary is not None:
            k_b = _rotate_ref(k_b, cos, sin, pos, interleaved)
            q_b = _rotate_ref(q_b, cos, sin, pos, interleaved)  # causal or one token: the new positions
        want_k = torch.cat((cache.logical_k[b], k_b))
        cache.logical_v[b] = torch.cat((cache.logical_v[b], v_new[b]))
        # The cache now holds the appended (rotated: within a rounding) tokens; older slots
        # are unchanged.
        got_k, got_v = cache.read(b, n + s_new)
        if rotary is None:
            assert torch.equal(got_k, want_k)
        else:
            assert torch.equal(got_k[:n], want_k[:n])
            torch.testing.assert_close(got_k.float(), want_k.float(), rtol=1e-2, atol=1e-2)
        assert torch.equal(got_v, cache.logical_v[b])
        cache.logical_k[b] = got_k
        _check(q_b[None], cache.logical_k[b][None], cache.logical_v[b][None], out[b:b + 1], lse[b:b + 1],
               causal=causal)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("page_size", [64, 128])  # gathered pages; pages read in place
@pytest.mark.parametrize("sq, opts", [(1, {}), (5, dict(causal=True)), (3, dict(causal=True, window_size=(300, -1)))])
def test_split_counts_agree(seed, d, page_size, sq, opts):
    """Split counts 1..many (and the automatic one) agree with each other and the
    reference; several masked query tokens align every split to the sequence's end."""
    _skip_unless_built(d, "none" if sq == 1 else "local" if "window_size" in opts else "causal")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = [3000, 1, 777, 0, 4096, 6]
    batch, capacity, h, hk = len(lengths), 4096, 16, 4
    cache = Cache(gen, batch, capacity, hk, d, lengths, page_size)
    cache.garble_unused_entries(lengths)
    q = torch.randn(batch, sq, h, d, device="cuda", dtype=DT, generator=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    outs = []
    for splits in (1, 2, 7, 32, 0):
        out, lse = flash3.attention_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens,
                                                 page_table=cache.page_table, num_splits=splits, return_lse=True,
                                                 **opts)
        _check_batch(q, cache, lengths, out, lse, causal=opts.get("causal", False),
                     window=opts.get("window_size", (-1, -1)))
        outs.append(out.float())
    for o in outs[1:]:
        assert (o - outs[0]).abs().max().item() <= 2e-2


@pytest.mark.parametrize("sq, causal", [(1, False), (4, True)])
def test_fixed_split_size_is_batch_invariant(seed, sq, causal):
    """With split_size a request's output is bitwise the same alone and in any batch."""
    d = 128
    _skip_unless_built(d, "causal" if causal else "none")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = [2500, 40, 4000, 1]
    batch, capacity, h, hk = len(lengths), 4096, 32, 8
    cache = Cache(gen, batch, capacity, hk, d, lengths)
    q = torch.randn(batch, sq, h, d, device="cuda", dtype=DT, generator=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = flash3.attention_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens, split_size=512, causal=causal)
    for b in range(batch):
        alone = flash3.attention_with_kvcache(q[b:b + 1], cache.k[b:b + 1], cache.v[b:b + 1],
                                              cache_seqlens=seqlens[b:b + 1], split_size=512, causal=causal)
        assert torch.equal(alone, out[b:b + 1])
    # ... and with the automatic split count, still within tolerance
    auto, lse = flash3.attention_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens, return_lse=True,
                                              causal=causal)
    _check_batch(q, cache, lengths, auto, lse, causal=causal)


@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("case", ["window", "window_causal", "softcap", "sinks", "all"])
def test_options(seed, page_size, sq, case):
    d, h, hk = 128, 8, 2
    _skip_unless_built(d, "local")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = [700, 5, 0, 1024]
    batch, capacity = len(lengths), 1024
    cache = Cache(gen, batch, capacity, hk, d, lengths, page_size)
    cache.garble_unused_entries(lengths)
    q = torch.randn(batch, sq, h, d, device="cuda", dtype=DT, generator=gen)
    sinks = torch.randn(h, device="cuda", generator=gen)
    opts = {
        "window": dict(window_size=(100, 0)),
        "window_causal": dict(window_size=(37, -1), causal=True),
        "softcap": dict(softcap=5.0, causal=True),
        "sinks": dict(sinks=sinks, causal=True),
        "all": dict(window_size=(200, 0), softcap=8.0, sinks=sinks),
    }[case]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flash3.attention_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens, page_table=cache.page_table,
                                             return_lse=True, **opts)
    window = opts.get("window_size", (-1, -1))
    _check_batch(q, cache, lengths, out, lse, causal=opts.get("causal", False), window=window,
                 softcap=opts.get("softcap", 0.0), sinks=opts.get("sinks"))


@pytest.mark.parametrize("h, hk", [(6, 2), (5, 1), (14, 2)])  # 3, 5 and 7 query heads per K/V head
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("sq, window", [(1, (-1, -1)), (4, (-1, 0)), (3, (70, 0))])
def test_query_head_groups_not_powers_of_two(seed, h, hk, page_size, sq, window):
    """GQA packing with groups that are not powers of two: the masks divide each packed row
    by the group (csrc/flash3/mask.h RowsPerQuery), causal and windowed rows included."""
    d = 128
    _skip_unless_built(d, "none" if window == (-1, -1) else "local")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = [700, 1, 129, 0]
    batch, capacity = len(lengths), 768
    cache = Cache(gen, batch, capacity, hk, d, lengths, page_size)
    q = torch.randn(batch, sq, h, d, device="cuda", dtype=DT, generator=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flash3.attention_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens, page_table=cache.page_table,
                                             window_size=window, return_lse=True)
    _check_batch(q, cache, lengths, out, lse, window=window)


@pytest.mark.parametrize("page_size", [None, 128])
def test_packed_queries(seed, page_size):
    """Chunked prefill: packed queries of different lengths, causal, against a cache."""
    d, h, hk = 128, 8, 4
    _skip_unless_built(d, "causal")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = [300, 1, 1000, 64]
    lens_q = [17, 1, 300, 0]
    batch, capacity = len(lengths), 1024
    cache = Cache(gen, batch, capacity, hk, d, lengths, page_size)
    total = sum(lens_q)
    q = torch.randn(total, h, d, device="cuda", dtype=DT, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flash3.attention_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens, page_table=cache.page_table,
                                             cu_seqlens_q=cu, max_seqlen_q=max(lens_q), causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (h, total)
    c = cu.tolist()
    for b in range(batch):
        rows = slice(c[b], c[b + 1])
        if c[b + 1] == c[b]:
            continue
        _check(q[None, rows], cache.logical_k[b][None], cache.logical_v[b][None], out[None, rows],
               lse[None, :, rows], causal=True)


def test_mqa_fp16_one_page_per_token(seed):
    d, h, hk = 64, 8, 1
    _skip_unless_built(d, dtype=torch.float16)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = [33, 190]
    cache = Cache(gen, 2, 200, hk, d, lengths, 1, dtype=torch.float16)
    q = torch.randn(2, 1, h, d, device="cuda", dtype=torch.float16, generator=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flash3.attention_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens, page_table=cache.page_table,
                                             return_lse=True)
    _check_batch(q, cache, lengths, out, lse)


@pytest.mark.parametrize("page, sq", [(16, 1), (128, 1), (128, 3)])
def test_cuda_graph_replay(seed, page, sq):
    """A decode step (append with rotary, paged cache, splits) captured once and replayed
    with other lengths and inputs gives the eager results."""
    d, h, hk = 128, 16, 4
    _skip_unless_built(d)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = [100, 2000, 7]
    batch, capacity = len(lengths), 2048
    cache = Cache(gen, batch, capacity, hk, d, lengths, page)
    cache.garble_unused_entries([2048] * batch)
    cos, sin = _rotary(gen, capacity, 32)
    static = dict(
        q=torch.randn(batch, sq, h, d, device="cuda", dtype=DT, generator=gen),
        k=torch.randn(batch, sq, hk, d, device="cuda", dtype=DT, generator=gen),
        v=torch.randn(batch, sq, hk, d, device="cuda", dtype=DT, generator=gen),
        seqlens=torch.tensor(lengths, dtype=torch.int32, device="cuda"),
    )
    k_eager, v_eager = cache.k.clone(), cache.v.clone()

    def step(kc, vc):
        return flash3.attention_with_kvcache(static["q"], kc, vc, k=static["k"], v=static["v"],
                                             cache_seqlens=static["seqlens"], page_table=cache.page_table,
                                             rotary_cos=cos, rotary_sin=sin, num_splits=4, causal=sq > 1)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(cache.k.clone(), cache.v.clone())  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = step(cache.k, cache.v)
    # Each step appends at the lengths given; the keys before them were written already.
    for new_lengths in (lengths, [101, 2001, 8], [0, 1500, 5]):
        for name in ("q", "k", "v"):
            static[name].copy_(torch.randn(static[name].shape, device="cuda", dtype=DT, generator=gen))
        static["seqlens"].copy_(torch.tensor(new_lengths, dtype=torch.int32, device="cuda"))
        graph.replay()
        want = step(k_eager, v_eager)
        torch.cuda.synchronize()
        assert torch.equal(out_static, want)
        assert torch.equal(cache.k.nan_to_num(7.0), k_eager.nan_to_num(7.0))


@pytest.mark.parametrize("page_size", [None, 16, 128])
@pytest.mark.parametrize("extra", [24, 32])
def test_strided_caches(seed, page_size, extra):
    """Caches that are slices of larger allocations (rows of a batch entry or a page apart
    by more than the slots used: 24, which the kernels cannot follow through a page table,
    and 32, which they can) give the same results."""
    d, h, hk = 64, 8, 2
    _skip_unless_built(d)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = [130, 1, 255]
    batch, capacity = len(lengths), 256
    cache = Cache(gen, batch, capacity, hk, d, lengths, page_size)
    q = torch.randn(batch, 1, h, d, device="cuda", dtype=DT, generator=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    want = flash3.attention_with_kvcache(q, cache.k, cache.v, cache_seqlens=seqlens, page_table=cache.page_table,
                                         num_splits=3)
    # The same cache inside larger buffers: extra slots per batch entry / page (NaN).
    big_k = torch.full((cache.k.shape[0], cache.k.shape[1] + extra, hk, d), float("nan"), device="cuda", dtype=DT)
    big_v = torch.full_like(big_k, float("nan"))
    big_k[:, :cache.k.shape[1]] = cache.k
    big_v[:, :cache.v.shape[1]] = cache.v
    k_view, v_view = big_k[:, :cache.k.shape[1]], big_v[:, :cache.v.shape[1]]
    assert not k_view.is_contiguous()
    got = flash3.attention_with_kvcache(q, k_view, v_view, cache_seqlens=seqlens, page_table=cache.page_table,
                                        num_splits=3)
    assert torch.equal(got, want)
    _check_batch(q, cache, lengths, got, flash3.attention_with_kvcache(
        q, k_view, v_view, cache_seqlens=seqlens, page_table=cache.page_table, return_lse=True)[1])


@pytest.mark.parametrize("layout", ["heads_of_larger", "misaligned", "head_dim_strided"])
@pytest.mark.parametrize("sq, causal", [(1, False), (3, True)])
def test_strided_queries(seed, layout, sq, causal):
    """Queries that are views (the query heads of a larger tensor; an address off 16
    bytes, packed element by element; a head dim of stride 2) give the contiguous
    queries' results bit for bit."""
    d, h, hk = 128, 8, 2
    _skip_unless_built(d, "causal" if causal else "none")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = [700, 5, 300]
    cache = Cache(gen, len(lengths), 768, hk, d, lengths, 16)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lengths), sq, h, d, device="cuda", dtype=DT, generator=gen)
    if layout == "heads_of_larger":
        big = torch.randn(len(lengths), sq, h + 3, d, device="cuda", dtype=DT, generator=gen)
        big[:, :, 1:h + 1] = q
        view = big[:, :, 1:h + 1]
    elif layout == "misaligned":
        flat = torch.randn(q.numel() + 1, device="cuda", dtype=DT, generator=gen)
        flat[1:] = q.flatten()
        view = flat[1:].view(q.shape)
        assert view.data_ptr() % 16 != 0
    else:
        wide = torch.randn(*q.shape[:-1], 2 * d, device="cuda", dtype=DT, generator=gen)
        wide[..., ::2] = q
        view = wide[..., ::2]
    kw = dict(cache_seqlens=seqlens, page_table=cache.page_table, causal=causal, num_splits=3, return_lse=True)
    want, want_lse = flash3.attention_with_kvcache(q, cache.k, cache.v, **kw)
    got, got_lse = flash3.attention_with_kvcache(view, cache.k, cache.v, **kw)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    _check_batch(q, cache, lengths, got, got_lse, causal=causal)
