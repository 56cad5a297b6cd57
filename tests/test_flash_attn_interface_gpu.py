"""GPU tests of flash3.flash_attn_interface (Hopper): the functions exercised the way
FlashAttention-3's own tests (hopper/test_flash_attn.py) exercise them, against
flash3.reference: shapes, bf16/fp16, GQA, causal, return conventions, gradients,
variable-length batches with random cu_seqlens, head-dim rounding. Tolerance as in
test_attention_gpu.py: the max error against float64 is at most twice a same-precision
PyTorch implementation's, plus a floor. The CPU tests are in test_flash_attn_interface.py.
"""
import pytest
import torch

import flash3
from flash3 import flash_attn_interface as fai
from flash3.flash_attn_interface import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func
from flash3.reference import attention_ref
from test_flash_attn_interface import _random_cu_seqlens, needs_varlen

def _built(kind, dtype, d, causal):
    return flash3.is_supported(kind, dtype, d, causal)


def _skip_unless_built(dtype, d, causal, backward=False):
    dp = fai._padded_headdim(d, flash3.SUPPORTED_HEADDIMS)
    for kind in ("fwd", "bwd") if backward else ("fwd",):
        if not _built(kind, dtype, dp, causal):
            pytest.skip(f"{kind} {dtype} hdim{dp} causal={causal} not in this build")


def _cuda_qkv(seed, b, sq, sk, h, hk, d, dtype, requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d))
    return [torch.randn(s, device="cuda", dtype=dtype, generator=g).requires_grad_(requires_grad) for s in shapes]


def _assert_close_to_reference(out, out_ref, out_pt, dtype, what="out", factor=2.0):
    assert not torch.isnan(out).any(), f"{what} has NaN"
    err = (out.double() - out_ref.double()).abs().max().item()
    err_pt = (out_pt.double() - out_ref.double()).abs().max().item()
    floor = torch.finfo(dtype).eps * max(out_ref.abs().max().item(), 1e-3)
    assert err <= factor * err_pt + floor, f"{what}: max error {err:.3e} > {factor} * {err_pt:.3e} + {floor:.1e}"


GPU_SHAPES = [(1, 1), (113, 203), (128, 128), (239, 97), (1024, 1024)]


@pytest.mark.gpu
@pytest.mark.parametrize("seqlens", GPU_SHAPES, ids=[f"{a}x{b}" for a, b in GPU_SHAPES])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flash_attn_func_output(seed, dtype, d, causal, heads, seqlens):
    _skip_unless_built(dtype, d, causal)
    (sq, sk), (h, hk) = seqlens, heads
    q, k, v = _cuda_qkv(seed, 2, sq, sk, h, hk, d, dtype)
    out = flash_attn_func(q, k, v, causal=causal)
    assert isinstance(out, torch.Tensor), "FlashAttention-3 returns out alone by default"
    assert out.shape == q.shape and out.dtype == dtype
    out2, lse = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert lse.shape == (2, h, sq) and lse.dtype == torch.float32
    assert torch.equal(out, out2)
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal)
    out_pt, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    _assert_close_to_reference(out, out_ref, out_pt, dtype)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    if finite.any():
        assert (lse[finite] - lse_ref[finite]).abs().max().item() <= 1e-3


def _grads_check(q, k, v, out, lse, out_fn_ref, dtype, factor=3.0):
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out * dout).sum(), (q, k, v), retain_graph=True)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    out_ref = out_fn_ref(qd, kd, vd, True)
    grads_ref = torch.autograd.grad((out_ref * dout.double()).sum(), (qd, kd, vd))
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out_pt = out_fn_ref(ql, kl, vl, False)
    grads_pt = torch.autograd.grad((out_pt * dout).sum(), (ql, kl, vl))
    for name, g, g_ref, g_pt in zip("qkv", grads, grads_ref, grads_pt):
        assert g.shape == g_ref.shape
        _assert_close_to_reference(g, g_ref, g_pt, dtype, what=f"d{name}", factor=factor)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flash_attn_func_gradients(seed, dtype, d, causal, heads):
    _skip_unless_built(dtype, d, causal, backward=True)
    h, hk = heads
    q, k, v = _cuda_qkv(seed, 2, 239, 307, h, hk, d, dtype, requires_grad=True)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)

    def ref(q_, k_, v_, upcast):
        o, _ = attention_ref(q_, k_, v_, causal=causal, upcast=upcast)
        return o

    _grads_check(q, k, v, out, lse, ref, dtype)


@pytest.mark.gpu
def test_flash_attn_func_gradient_through_lse(seed):
    _skip_unless_built(torch.bfloat16, 64, True, backward=True)
    q, k, v = _cuda_qkv(seed, 2, 129, 257, 4, 2, 64, torch.bfloat16, requires_grad=True)
    _, lse = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    grads = torch.autograd.grad(lse.sum(), (q, k, v))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    _, lse_ref = attention_ref(qd, kd, vd, causal=True)
    # lse_ref is float32 from a float64 computation: differentiate the float64 logsumexp instead
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kd.repeat_interleave(2, dim=2)) / 8.0
    mask = flash3.reference.causal_mask(129, 257, device="cuda")
    lse64 = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
    # The lse does not depend on v: its reference gradient is zero.
    grads_ref = torch.autograd.grad(lse64.sum(), (qd, kd, vd), allow_unused=True)
    grads_ref = [torch.zeros_like(t) if g is None else g for g, t in zip(grads_ref, (qd, kd, vd))]
    for g, g_ref in zip(grads, grads_ref):
        assert (g.double() - g_ref).abs().max().item() <= 2e-2 * max(g_ref.abs().max().item(), 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [40, 80, 112, 160, 200])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attn_func_rounds_head_dims_up(seed, d, causal):
    dtype = torch.bfloat16
    _skip_unless_built(dtype, d, causal, backward=True)
    q, k, v = _cuda_qkv(seed, 2, 193, 257, 4, 2, d, dtype, requires_grad=True)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert out.shape == q.shape and out.is_contiguous()
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal)  # 1/sqrt(d) of the unpadded head dim
    out_pt, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    _assert_close_to_reference(out, out_ref, out_pt, dtype)
    assert (lse - lse_ref).abs().max().item() <= 1e-3

    def ref(q_, k_, v_, upcast):
        return attention_ref(q_, k_, v_, causal=causal, upcast=upcast)[0]

    _grads_check(q, k, v, out, lse, ref, dtype)


@pytest.mark.gpu
def test_flash_attn_func_matches_flash3_attention_bitwise(seed):
    _skip_unless_built(torch.bfloat16, 128, True)
    q, k, v = _cuda_qkv(seed, 2, 300, 500, 8, 2, 128, torch.bfloat16)
    out, lse = flash_attn_func(q, k, v, causal=True, softmax_scale=0.1, return_attn_probs=True)
    out3, lse3 = flash3.attention(q, k, v, causal=True, softmax_scale=0.1, return_lse=True)
    assert torch.equal(out, out3) and torch.equal(lse, lse3)
    assert torch.equal(flash_attn_func(q, k, v, window_size=(-1, 0)), flash3.attention(q, k, v, causal=True))


@pytest.mark.gpu
def test_window_softcap_sinks_match_flash3_bitwise(seed):
    """The options go to the local-mask kernels unchanged, forward and backward (the
    sinks' gradient included), through all three functions. (Deterministic, so that two
    backward calls can be compared bit for bit: under GQA the query heads add their dK and
    dV with atomics otherwise.)"""
    if not all(flash3.is_supported(kind, torch.bfloat16, 128, False, mask="local") for kind in ("fwd", "bwd")):
        pytest.skip("bf16 hdim128 local-mask kernels not in this build")
    q, k, v = _cuda_qkv(seed, 2, 300, 500, 8, 2, 128, torch.bfloat16, requires_grad=True)
    sinks = torch.randn(8, device="cuda", requires_grad=True)
    opts = dict(causal=True, window_size=(100, 0), softcap=20.0, deterministic=True)
    out, lse = flash_attn_func(q, k, v, learnable_sink=sinks, return_attn_probs=True, **opts)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v, sinks))
    out3, lse3 = flash3.attention(q, k, v, sinks=sinks, return_lse=True, **opts)
    grads3 = torch.autograd.grad(out3.float().square().sum(), (q, k, v, sinks))
    assert torch.equal(out, out3) and torch.equal(lse, lse3)
    for g, g3 in zip(grads, grads3):
        assert torch.equal(g, g3)
    # varlen: one sequence, the same call
    cu_q = torch.tensor([0, 300], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 500], dtype=torch.int32, device="cuda")
    out_v = flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 300, 500, learnable_sink=sinks, **opts)
    torch.testing.assert_close(out_v, out3[0])  # the packed kernel: same math, not always the same bits
    # qkvpacked (seqlen_q = seqlen_k)
    qkv = torch.randn(1, 257, 3, 8, 128, device="cuda", dtype=torch.bfloat16)
    out_p = flash_attn_qkvpacked_func(qkv, window_size=(31, 31), softcap=10.0)
    ref = flash3.attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], window_size=(31, 31), softcap=10.0)
    assert torch.equal(out_p, ref)


@pytest.mark.gpu
def test_flash_attn_func_deterministic(seed):
    _skip_unless_built(torch.bfloat16, 64, False, backward=True)
    q, k, v = _cuda_qkv(seed, 2, 1000, 1000, 4, 4, 64, torch.bfloat16, requires_grad=True)
    dout = torch.randn_like(q)
    runs = []
    for _ in range(2):
        out = flash_attn_func(q, k, v, deterministic=True)
        runs.append(torch.autograd.grad((out * dout).sum(), (q, k, v)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["5d", "4d-gqa"])
def test_flash_attn_qkvpacked_func(seed, layout):
    dtype = torch.bfloat16
    _skip_unless_built(dtype, 64, True, backward=True)
    g = torch.Generator(device="cuda").manual_seed(seed)
    if layout == "5d":
        qkv = torch.randn(2, 257, 3, 4, 64, device="cuda", dtype=dtype, generator=g, requires_grad=True)
        out, lse = flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
        q, k, v = qkv.unbind(2)
    else:
        qkv = torch.randn(2, 257, 8, 64, device="cuda", dtype=dtype, generator=g, requires_grad=True)
        out, lse = flash_attn_qkvpacked_func(qkv, causal=True, num_heads_q=4, return_attn_probs=True)
        q, k, v = qkv.split([4, 2, 2], dim=2)
    out_ref, out_f = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out, out_ref) and torch.equal(lse, out_f)
    (dqkv,) = torch.autograd.grad(out.sum(), qkv)
    assert dqkv.shape == qkv.shape and torch.isfinite(dqkv).all()


@pytest.mark.gpu
def test_flash_attn_func_fp8_routes_to_flash3_fp8(seed):
    if not flash3.fp8.is_supported(128, True):
        pytest.skip("FP8 hdim 128 causal not in this build")
    q, k, v = _cuda_qkv(seed, 2, 300, 400, 4, 2, 128, torch.bfloat16)
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    q_descale, k_descale, v_descale = (torch.rand(2, 2, device="cuda", generator=g) + 0.5 for _ in range(3))
    out, lse = flash_attn_func(q8, k8, v8, causal=True, q_descale=q_descale, k_descale=k_descale,
                               v_descale=v_descale, return_attn_probs=True)
    out8, lse8 = flash3.fp8.attention_fp8(q8, k8, v8, q_descale, k_descale, v_descale, causal=True, return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (2, 4, 300)
    assert torch.equal(out, out8) and torch.equal(lse, lse8)


def _varlen_inputs(seed, batch, max_q, max_k, h, hk, d, dtype, zero_lengths=False):
    g = torch.Generator().manual_seed(seed)
    cu_q, mq = _random_cu_seqlens(g, batch, max_q, 1)
    cu_k, mk = _random_cu_seqlens(g, batch, max_k, 0 if zero_lengths else 1)
    gc = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(tq, h, d, device="cuda", dtype=dtype, generator=gc)
    k = torch.randn(tk, hk, d, device="cuda", dtype=dtype, generator=gc)
    v = torch.randn(tk, hk, d, device="cuda", dtype=dtype, generator=gc)
    return q, k, v, cu_q.cuda(), cu_k.cuda(), mq, mk


def _varlen_reference(q, k, v, cu_q, cu_k, causal, upcast, seqused_q=None, seqused_k=None):
    out = torch.zeros(q.shape, dtype=torch.float64 if upcast else q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    for i in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if seqused_q is not None:
            q1 = q0 + int(seqused_q[i])
        if seqused_k is not None:
            k1 = k0 + int(seqused_k[i])
        o, l = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=causal, upcast=upcast)
        out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return out, lse


@pytest.mark.gpu
@needs_varlen
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 80])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flash_attn_varlen_func(seed, dtype, d, causal, heads):
    _skip_unless_built(dtype, d, causal, backward=True)
    h, hk = heads
    q, k, v, cu_q, cu_k, mq, mk = _varlen_inputs(seed, 5, 300, 400, h, hk, d, dtype, zero_lengths=not causal)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    out2, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal, return_attn_probs=True)
    assert lse.shape == (h, q.shape[0]) and lse.dtype == torch.float32
    assert torch.equal(out, out2)
    out_ref, lse_ref = _varlen_reference(q, k, v, cu_q, cu_k, causal, True)
    out_pt, _ = _varlen_reference(q, k, v, cu_q, cu_k, causal, False)
    _assert_close_to_reference(out, out_ref, out_pt, dtype)
    finite = torch.isfinite(lse_ref)
    assert (lse[finite] - lse_ref[finite]).abs().max().item() <= 1e-3

    def ref(q_, k_, v_, upcast):
        return _varlen_reference(q_, k_, v_, cu_q, cu_k, causal, upcast)[0]

    _grads_check(q, k, v, out, lse, ref, dtype)


@pytest.mark.gpu
@needs_varlen
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flash_attn_varlen_func_seqused(seed, causal):
    dtype = torch.bfloat16
    _skip_unless_built(dtype, 64, causal)
    q, k, v, cu_q, cu_k, mq, mk = _varlen_inputs(seed, 4, 200, 300, 4, 2, 64, dtype)
    g = torch.Generator().manual_seed(seed)
    lengths_q, lengths_k = ((cu[1:] - cu[:-1]).cpu() for cu in (cu_q, cu_k))
    seqused_q = (torch.rand(4, generator=g) * (lengths_q + 1)).floor().clamp(max=lengths_q).to(torch.int32)
    seqused_k = (torch.rand(4, generator=g) * (lengths_k + 1)).floor().clamp(max=lengths_k).to(torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, seqused_q=seqused_q.cuda(), seqused_k=seqused_k.cuda(),
                                 causal=causal)
    out_ref, _ = _varlen_reference(q, k, v, cu_q, cu_k, causal, True, seqused_q, seqused_k)
    out_pt, _ = _varlen_reference(q, k, v, cu_q, cu_k, causal, False, seqused_q, seqused_k)
    used = torch.zeros(q.shape[0], dtype=torch.bool)
    for i in range(4):
        used[int(cu_q[i]): int(cu_q[i]) + int(seqused_q[i])] = True
    _assert_close_to_reference(out[used.cuda()], out_ref[used.cuda()], out_pt[used.cuda()], dtype)


@pytest.mark.gpu
@needs_varlen
def test_flash_attn_varlen_func_matches_dense_on_equal_lengths(seed):
    dtype = torch.bfloat16
    _skip_unless_built(dtype, 128, True)
    q, k, v = _cuda_qkv(seed, 3, 200, 200, 4, 2, 128, dtype)
    cu = torch.arange(0, 601, 200, dtype=torch.int32, device="cuda")
    out = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 200, 200, causal=True)
    dense = flash_attn_func(q, k, v, causal=True)
    out_ref, _ = attention_ref(q, k, v, causal=True)
    out_pt, _ = attention_ref(q, k, v, causal=True, upcast=False)
    _assert_close_to_reference(out.view_as(q), out_ref, out_pt, dtype)
    _assert_close_to_reference(dense, out_ref, out_pt, dtype)
