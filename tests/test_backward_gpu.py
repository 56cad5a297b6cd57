"""GPU tests of the backward kernels (through autograd) against float64 references.

Tolerance (FlashAttention's rule, as for the forward): for each of dq, dk, dv the
kernel's max error against a float64 reference is at most twice the error of a
same-precision PyTorch implementation (its autograd through the same math in the input
dtype), plus a floor of one unit in the last place at the gradients' magnitude. The
floor takes the largest of the three gradients: dS = P * (dP - rowsum(dO * O)) is a
difference of float32 terms of that size, so where the true dq or dk is 0 (one key:
P = 1 and dP = rowsum(dO * O) exactly) the kernel returns their rounding residue, about
1e-6, while PyTorch's graph happens to cancel exactly.
Every check draws fresh random inputs (and a random dout); gradient buffers are poisoned
before the run, so an element the kernels fail to write reads NaN.
"""

import pytest
import torch

import flash3
from flash3.reference import attention_ref

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
HDIMS = [64, 96, 128, 192, 256]
SEQLENS = [(1, 1), (113, 203), (239, 1), (799, 3), (1023, 1024), (2177, 2177)]


def _skip_unless_built(dtype, d, causal):
    for kind in ("fwd", "bwd"):
        if not flash3.is_supported(kind, dtype, d, causal):
            pytest.skip(f"{kind} {dtype} hdim{d} causal={causal} not in this build")


def _inputs(seed, b, sq, sk, h, hk, d, dtype):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g)
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, generator=g)
    return q, k, v, dout


def _poison(*tensors):
    """Fill, then free, blocks the size of the gradients: the caching allocator hands the
    same memory back to the backward pass."""
    blocks = [torch.full_like(t, float("nan")) for t in tensors]
    blocks += [torch.full(t.shape, float("nan"), device=t.device, dtype=torch.float32) for t in tensors]
    del blocks


def _flash3_grads(q, k, v, dout, causal, deterministic=False, scale=None, with_lse=False):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = flash3.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True,
                                deterministic=deterministic)
    _poison(q, k, v)
    loss = (out * dout).sum()
    if with_lse:
        loss = loss + lse.sum()
    loss.backward()
    return out, q.grad, k.grad, v.grad


def _reference_grads(q, k, v, dout, causal, upcast, scale=None, with_lse=False):
    if upcast:
        q, k, v, dout = (t.detach().double() for t in (q, k, v, dout))
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = attention_ref(q, k, v, causal=causal, softmax_scale=scale, upcast=upcast)
    loss = (out * dout).sum()
    if with_lse:
        finite = torch.isfinite(lse)
        loss = loss + lse.masked_fill(~finite, 0.0).sum()
    loss.backward()
    return q.grad, k.grad, v.grad


def _check_grads(q, k, v, dout, causal, grads, scale=None, with_lse=False):
    ref = _reference_grads(q, k, v, dout, causal, upcast=True, scale=scale, with_lse=with_lse)
    same_precision = _reference_grads(q, k, v, dout, causal, upcast=False, scale=scale, with_lse=with_lse)
    magnitude = max([w.abs().max().item() for w in ref if w.numel()] + [1e-3])
    ulp = torch.finfo(q.dtype).eps * magnitude
    for name, got, want, pt in zip(("dq", "dk", "dv"), grads, ref, same_precision):
        assert got.shape == want.shape and got.dtype == q.dtype, name
        assert not torch.isnan(got).any(), f"{name} has NaN (unwritten or invalid)"
        err = (got.double() - want).abs().max().item() if got.numel() else 0.0
        err_pt = (pt.double() - want).abs().max().item() if got.numel() else 0.0
        assert err <= 2 * err_pt + ulp, (
            f"{name}: max error {err:.3e} > 2 * {err_pt:.3e} (same-precision PyTorch) + {ulp:.1e}"
        )


@pytest.mark.parametrize("seqlens", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HDIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_backward_matches_reference(seed, dtype, d, causal, seqlens):
    _skip_unless_built(dtype, d, causal)
    sq, sk = seqlens
    b, h = (1, 2) if sq * sk > 1_000_000 else (2, 3)
    q, k, v, dout = _inputs(seed, b, sq, sk, h, h, d, dtype)
    _, *grads = _flash3_grads(q, k, v, dout, causal)
    _check_grads(q, k, v, dout, causal, grads)


@pytest.mark.parametrize("hk", [1, 2], ids=["mqa", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_gqa(seed, d, causal, hk):
    _skip_unless_built(torch.bfloat16, d, causal)
    q, k, v, dout = _inputs(seed, 2, 377, 519, 6, hk, d, torch.bfloat16)
    _, *grads = _flash3_grads(q, k, v, dout, causal)
    _check_grads(q, k, v, dout, causal, grads)


# The causal backward takes its key tiles in sections of (batch, head) pairs, longest
# first across a section (kernel_bwd.h, scheduler.h section_size). On 132 SMs, 1300 keys
# give sections of 8 pairs at hdim 64 / 128 (11 key tiles of 128 per head) and of 4 at hdim
# 256 (17 key tiles of 80): 10 pairs leave a partial one.
@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_sectioned_tile_order(seed, d):
    _skip_unless_built(torch.bfloat16, d, True)
    q, k, v, dout = _inputs(seed, 2, 1100, 1300, 5, 5, d, torch.bfloat16)
    _, *grads = _flash3_grads(q, k, v, dout, True)
    _check_grads(q, k, v, dout, True, grads)


# Odd key-tile counts (401 keys: 7 tiles of 64, or 6 of 80 at hdim 256 outside
# deterministic mode, the last with one key; 135: 3, or 2), both masks, deterministic mode,
# GQA (dk and dv summed over the group) and a partial section of (batch, head) pairs at
# hdim 192/256: on 132 SMs a causal section holds 16 pairs at 7 (or 6) key tiles per head
# and 32 (or 64) at 3 (or 2), so 2 x 18 pairs leave a partial one at both lengths.
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(333, 401), (577, 135)], ids=["333x401", "577x135"])
@pytest.mark.parametrize("d", [192, 256])
def test_backward_key_tile_pairs(seed, d, sq, sk, causal, deterministic):
    _skip_unless_built(torch.bfloat16, d, causal)
    q, k, v, dout = _inputs(seed, 2, sq, sk, 18, 9, d, torch.bfloat16)
    _, *first = _flash3_grads(q, k, v, dout, causal, deterministic=deterministic)
    _check_grads(q, k, v, dout, causal, first)
    if deterministic:
        _, *again = _flash3_grads(q, k, v, dout, causal, deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between deterministic runs"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HDIMS)
def test_backward_deterministic_is_bitwise_repeatable(seed, d, causal):
    _skip_unless_built(torch.bfloat16, d, causal)
    q, k, v, dout = _inputs(seed, 2, 1500, 1100, 4, 2, d, torch.bfloat16)
    _, *first = _flash3_grads(q, k, v, dout, causal, deterministic=True)
    _check_grads(q, k, v, dout, causal, first)
    for _ in range(3):
        _, *again = _flash3_grads(q, k, v, dout, causal, deterministic=True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between deterministic runs"


def test_backward_through_lse(seed):
    _skip_unless_built(torch.bfloat16, 128, True)
    q, k, v, dout = _inputs(seed, 2, 300, 257, 4, 4, 128, torch.bfloat16)
    _, *grads = _flash3_grads(q, k, v, dout, True, with_lse=True)
    _check_grads(q, k, v, dout, True, grads, with_lse=True)


def test_backward_custom_scale_and_strided_dout(seed):
    _skip_unless_built(torch.bfloat16, 128, False)
    q, k, v, dout = _inputs(seed, 2, 200, 300, 4, 4, 128, torch.bfloat16)
    # A dout that is not contiguous (a transposed view) goes through the same checks.
    dout = dout.transpose(1, 2).contiguous().transpose(1, 2)
    _, *grads = _flash3_grads(q, k, v, dout, False, scale=0.3)
    _check_grads(q, k, v, dout, False, grads, scale=0.3)


def test_backward_of_sum_broadcast_grad(seed):
    # out.sum().backward() hands the op a stride-0 (expanded) dout.
    _skip_unless_built(torch.bfloat16, 128, True)
    q, k, v, _ = _inputs(seed, 1, 190, 190, 2, 2, 128, torch.bfloat16)
    q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
    flash3.attention(q1, k1, v1, causal=True).sum().backward()
    _check_grads(q, k, v, torch.ones_like(q), True, (q1.grad, k1.grad, v1.grad))


def test_backward_torch_compile_fullgraph(seed):
    # The loss is compiled with fullgraph=True; its backward (flash3::bwd, through the
    # autograd registration) runs as the compiled backward graph.
    _skip_unless_built(torch.bfloat16, 128, True)
    q, k, v, dout = _inputs(seed, 2, 300, 300, 4, 4, 128, torch.bfloat16)
    torch._dynamo.reset()

    # Deterministic, so that compiled and eager gradients can be compared bit for bit.
    def loss_fn(q, k, v, dout):
        return (flash3.attention(q, k, v, causal=True, deterministic=True) * dout).sum()

    compiled = torch.compile(loss_fn, fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled(*leaves, dout).backward()
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    loss_fn(*eager, dout).backward()
    for a, b in zip(leaves, eager):
        assert torch.equal(a.grad, b.grad)


def test_opcheck_backward(seed):
    _skip_unless_built(torch.bfloat16, 128, False)
    q, k, v, dout = _inputs(seed, 2, 130, 250, 4, 2, 128, torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.flash3.fwd.default, (q, k, v, 0.125, False, False))
    out, lse = torch.ops.flash3.fwd(q.detach(), k.detach(), v.detach(), 0.125, False)
    torch.library.opcheck(torch.ops.flash3.bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, None, 0.125, False, False))
