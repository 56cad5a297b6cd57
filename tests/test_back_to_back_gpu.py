"""GPU tests of calls issued back to back on one stream, each reading what the kernel just
before it wrote, with no synchronisation between them.

Each call's query is the previous call's output, read by the call's first kernel straight
after the previous call's last kernel; the varlen chain changes the lengths every step, so
its tile table is rewritten while the previous step's attention kernel may still be
queued; the backward chain feeds each dQ back as the next dO. A kernel that read its inputs
before the previous kernel had finished (for instance one launched to overlap it) would
see the previous step's values: the caching allocator hands the same blocks back. The
chain is run twice, without and with a synchronisation after every call; the kernels are
deterministic, so the two must agree bit for bit. The first step is also checked against
the float64 reference.
"""
import itertools

import pytest
import torch

import flash3
from flash3.reference import attention_ref

pytestmark = pytest.mark.gpu

DT = torch.bfloat16
STEPS = 12


def _skip_unless_built(kind, d, causal):
    if not flash3.is_supported(kind, DT, d, causal):
        pytest.skip(f"{kind} bf16 hdim{d} causal={causal} not in this build")


def _run_chain(step, first, sync):
    outs, x = [], first
    for i in range(STEPS):
        x = step(i, x)
        outs.append(x)
        if sync:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return outs


def _assert_chains_agree(step, first):
    free = _run_chain(step, first, sync=False)
    synced = _run_chain(step, first, sync=True)
    for i, (a, b) in enumerate(zip(free, synced)):
        assert torch.isfinite(a).all(), f"step {i}: non-finite output"
        assert torch.equal(a, b), f"step {i}: back-to-back result differs from the synchronised one"


def _close_to_reference(out, q, k, v, causal):
    """The suite's rule: at most twice the error of a same-precision implementation plus one ulp."""
    want, _ = attention_ref(q, k, v, causal=causal, upcast=True)
    same_precision, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    err = (out.double() - want).abs().max().item()
    err_pt = (same_precision.double() - want).abs().max().item()
    ulp = torch.finfo(q.dtype).eps * max(want.abs().max().item(), 1e-3)
    assert err <= 2 * err_pt + ulp, f"max error {err:.3e} > 2 * {err_pt:.3e} + {ulp:.1e}"


@pytest.mark.parametrize("causal", [False, True])
def test_dense_forward_chain(causal):
    d = 128
    _skip_unless_built("fwd", d, causal)
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(2, 777, 8, d, device="cuda", dtype=DT, generator=gen)
    k = torch.randn(2, 777, 4, d, device="cuda", dtype=DT, generator=gen)
    v = torch.randn(2, 777, 4, d, device="cuda", dtype=DT, generator=gen)
    _close_to_reference(flash3.attention(q, k, v, causal=causal), q, k, v, causal)
    # Each output is the next query, read by the next kernel straight after this one.
    _assert_chains_agree(lambda i, x: flash3.attention(x, k, v, causal=causal), q)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_forward_chain_new_lengths(causal):
    """The lengths change every step: the attention kernel must read the tile table that the
    kernel just before it wrote for this step."""
    d = 128
    _skip_unless_built("fwd", d, causal)
    gen = torch.Generator(device="cuda").manual_seed(5)
    orders = list(itertools.permutations([100, 400, 12, 511]))
    total, h = 1023, 4
    lens = torch.tensor([orders[(7 * i) % len(orders)] for i in range(STEPS)], dtype=torch.int32, device="cuda")
    k = torch.randn(total, h, d, device="cuda", dtype=DT, generator=gen)
    v = torch.randn(total, h, d, device="cuda", dtype=DT, generator=gen)
    q = torch.randn(total, h, d, device="cuda", dtype=DT, generator=gen)

    cu = torch.nn.functional.pad(torch.cumsum(lens, 1, dtype=torch.int32), (1, 0))  # (STEPS, 5)

    def step(i, x):
        return flash3.attention_varlen(x, k, v, cu[i], cu[i], 511, 511, causal=causal)

    _close_to_reference(step(0, q)[:100].unsqueeze(0), q[:100].unsqueeze(0), k[:100].unsqueeze(0),
                        v[:100].unsqueeze(0), causal)
    _assert_chains_agree(step, q)


@pytest.mark.parametrize("page_size", [None, 16])
def test_decode_chain(page_size):
    """Decode steps whose query is the previous step's output (the merge kernel's, read by
    the next step's packing kernel) and whose cache lengths grow by one each step."""
    d, h, hk, batch, capacity = 128, 32, 8, 3, 3000
    _skip_unless_built("fwd", d, False)
    gen = torch.Generator(device="cuda").manual_seed(11)
    if page_size is None:
        k_cache = torch.randn(batch, capacity, hk, d, device="cuda", dtype=DT, generator=gen)
        table = None
    else:
        pages = capacity // page_size
        k_cache = torch.randn(batch * pages, page_size, hk, d, device="cuda", dtype=DT, generator=gen)
        table = torch.randperm(batch * pages, device="cuda", generator=gen).to(torch.int32).view(batch, pages)
    v_cache = torch.randn(k_cache.shape, device="cuda", dtype=DT, generator=gen)
    start = torch.tensor([2500, 700, 1900], dtype=torch.int32, device="cuda")
    seqlens = start + torch.arange(STEPS, dtype=torch.int32, device="cuda")[:, None]  # (STEPS, batch)
    q = torch.randn(batch, 1, h, d, device="cuda", dtype=DT, generator=gen)

    def step(i, x):
        return flash3.attention_with_kvcache(x, k_cache, v_cache, cache_seqlens=seqlens[i], page_table=table)

    _assert_chains_agree(step, q)


def test_backward_chain():
    """Deterministic backward passes, each one's dQ the next one's dO."""
    d, causal = 128, True
    _skip_unless_built("bwd", d, causal)
    gen = torch.Generator(device="cuda").manual_seed(13)
    q, k, v = (torch.randn(2, 1000, 4, d, device="cuda", dtype=DT, generator=gen).requires_grad_() for _ in range(3))
    dout = torch.randn(2, 1000, 4, d, device="cuda", dtype=DT, generator=gen)

    def step(i, x):
        out = flash3.attention(q, k, v, causal=causal, deterministic=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), x)
        return dq / dq.abs().amax().clamp_min(1e-6)

    _assert_chains_agree(step, dout)
