"""torch.compile(fullgraph=True) through the public entry points that compose several ops:
FlashAttention-3's functions and the KV-cache call. Each compiled call must give the eager
result bit for bit (the same kernels run), and gradients must flow where there is a backward."""
import pytest
import torch

import flash3
from flash3.flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

pytestmark = pytest.mark.gpu
DT = torch.bfloat16


def _skip_unless_built(kind, d, causal=True):
    if not flash3.is_supported(kind, DT, d, causal):
        pytest.skip(f"{kind} bf16 hdim{d} causal={causal} not in this build")


def _randn(gen, *shape):
    return torch.randn(*shape, device="cuda", dtype=DT, generator=gen)


def test_flash_attn_func(seed):
    _skip_unless_built("bwd", 128)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = _randn(g, 2, 300, 8, 128), _randn(g, 2, 300, 2, 128), _randn(g, 2, 300, 2, 128)

    def f(q, k, v):
        return flash_attn_func(q, k, v, causal=True, return_attn_probs=True)

    compiled = torch.compile(f, fullgraph=True)
    out_c, lse_c = compiled(q, k, v)
    out_e, lse_e = f(q, k, v)
    assert torch.equal(out_c, out_e) and torch.equal(lse_c, lse_e)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    compiled(qg, kg, vg)[0].sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (qg, kg, vg))


def test_flash_attn_varlen_func(seed):
    _skip_unless_built("bwd", 128)
    g = torch.Generator(device="cuda").manual_seed(seed)
    cu = torch.tensor([0, 7, 300, 301], dtype=torch.int32, device="cuda")
    q, k, v = _randn(g, 301, 8, 128), _randn(g, 301, 2, 128), _randn(g, 301, 2, 128)

    def f(q, k, v, cu):
        return flash_attn_varlen_func(q, k, v, cu, cu, 293, 293, causal=True)

    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(q, k, v, cu), f(q, k, v, cu))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    compiled(qg, kg, vg, cu).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (qg, kg, vg))


@pytest.mark.parametrize("page", [None, 16, 128], ids=["dense", "page16", "page128"])
@pytest.mark.parametrize("sq", [1, 4])
def test_kvcache(seed, page, sq):
    _skip_unless_built("fwd", 128)
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch, capacity, h, hk, d = 3, 1024, 8, 2, 128
    seqlens = torch.tensor([1000, 1, 333], dtype=torch.int32, device="cuda")
    if page is None:
        k_cache, v_cache, table = _randn(g, batch, capacity, hk, d), _randn(g, batch, capacity, hk, d), None
    else:
        pages = capacity // page
        k_cache, v_cache = _randn(g, batch * pages, page, hk, d), _randn(g, batch * pages, page, hk, d)
        table = torch.randperm(batch * pages, device="cuda", generator=g).to(torch.int32).view(batch, pages)
    q = _randn(g, batch, sq, h, d)

    def f(q, k_cache, v_cache, seqlens, table):
        return flash3.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, page_table=table,
                                             causal=True, return_lse=True)

    def fa3(q, k_cache, v_cache, seqlens, table):
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, page_table=table, causal=True)

    for fn in (f, fa3):
        compiled = torch.compile(fn, fullgraph=True)
        got, want = compiled(q, k_cache, v_cache, seqlens, table), fn(q, k_cache, v_cache, seqlens, table)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert torch.equal(a, b)


def test_kvcache_append(seed):
    """The in-place append (k, v written at cache_seqlens) traced and replayed."""
    _skip_unless_built("fwd", 128)
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch, capacity, h, hk, d = 2, 512, 8, 2, 128
    seqlens = torch.tensor([100, 300], dtype=torch.int32, device="cuda")
    k_cache, v_cache = _randn(g, batch, capacity, hk, d), _randn(g, batch, capacity, hk, d)
    q, k, v = _randn(g, batch, 1, h, d), _randn(g, batch, 1, hk, d), _randn(g, batch, 1, hk, d)

    def f(q, k_cache, v_cache, k, v, seqlens):
        return flash3.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens, causal=True)

    k_eager, v_eager = k_cache.clone(), v_cache.clone()
    want = f(q, k_eager, v_eager, k, v, seqlens)
    got = torch.compile(f, fullgraph=True)(q, k_cache, v_cache, k, v, seqlens)
    assert torch.equal(got, want)
    assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager)
