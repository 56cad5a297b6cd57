"""Sliding windows, softcap and attention sinks (``learnable_sink``) through
FlashAttention-3's interface: flash_attn_func, flash_attn_varlen_func and
flash_attn_qkvpacked_func.

CPU (run everywhere; the argument errors are in test_masks_api.py): the options reach the
kernels with FlashAttention-3's semantics, the return conventions hold
(``return_attn_probs=True`` gives ``(out, softmax_lse)``) and gradients reach
``learnable_sink``, with the kernels replaced by the float64 reference (head-dim padding,
packed batches with seqused, the 4-D GQA qkv layout included).

GPU (Hopper): the same calls on the local-mask kernels against the float64 reference,
forward (out and lse) and backward (q, k, v and the sinks, through out and lse), with the
tolerance of test_masks_gpu.py: the max error against float64 at most twice a
same-precision PyTorch implementation's, plus a floor of one unit in the last place at the
values' magnitude (and the tanh's error under softcap).
"""
import pytest
import torch

import flash3
from flash3 import flash_attn_interface as fai
from flash3.flash_attn_interface import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func
from flash3.reference import attention_ref
from test_flash_attn_interface import cpu_kernels  # noqa: F401  (fixture)

TANH_ERROR = 2.0 ** -10


# ----------------------------------------------------------------------------------------
# CPU: the wrapper's work, the kernels replaced by the float64 reference
# ----------------------------------------------------------------------------------------


def _cpu_qkv(seed, b, sq, sk, h, hk, d):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d))
    return [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]


@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize("causal, window, softcap", [(True, (6, 6), 0.0), (False, (3, 2), 4.0),
                                                     (True, (-1, -1), 2.0)])
def test_func_options_and_sink_gradient_cpu(cpu_kernels, d, causal, window, softcap):  # noqa: F811
    q, k, v = _cpu_qkv(1, 2, 19, 29, 4, 2, d)
    sink = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, learnable_sink=sink)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    out2, lse = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, learnable_sink=sink,
                                return_attn_probs=True)
    assert lse.shape == (2, 4, 19) and lse.dtype == torch.float32
    ref, lse_ref = attention_ref(q, k, v, causal=causal, window_size=window, softcap=softcap, sinks=sink)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out2, ref)
    torch.testing.assert_close(lse, lse_ref)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out2 * dout).sum() + lse.sum(), (q, k, v, sink))
    grads_ref = torch.autograd.grad((ref * dout).sum() + lse_ref.sum(), (q, k, v, sink))
    for g, g_ref in zip(grads, grads_ref):
        assert g.shape == g_ref.shape
        torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-6)


def test_varlen_options_with_seqused_cpu(cpu_kernels):  # noqa: F811
    g = torch.Generator().manual_seed(3)
    cu_q = torch.tensor([0, 7, 7, 20, 31], dtype=torch.int32)
    cu_k = torch.tensor([0, 12, 15, 15, 40], dtype=torch.int32)
    used_q = torch.tensor([5, 0, 13, 11], dtype=torch.int32)
    used_k = torch.tensor([12, 2, 0, 20], dtype=torch.int32)
    q = torch.randn(31, 4, 64, generator=g, dtype=torch.float64)
    k = torch.randn(40, 2, 64, generator=g, dtype=torch.float64)
    v = torch.randn(40, 2, 64, generator=g, dtype=torch.float64)
    sink = torch.randn(4, generator=g, dtype=torch.float64)
    opts = dict(causal=True, window_size=(3, 3), softcap=6.0)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 13, 25, seqused_q=used_q, seqused_k=used_k,
                                      learnable_sink=sink, return_attn_probs=True, **opts)
    assert out.shape == q.shape and lse.shape == (4, 31)
    for b in range(4):
        rq = slice(int(cu_q[b]), int(cu_q[b]) + int(used_q[b]))
        rk = slice(int(cu_k[b]), int(cu_k[b]) + int(used_k[b]))
        ref, lse_ref = attention_ref(q[None, rq], k[None, rk], v[None, rk], sinks=sink, **opts)
        torch.testing.assert_close(out[rq], ref[0])
        torch.testing.assert_close(lse[:, rq], lse_ref[0])
    # sequence 2 has no key: output 0, lse the sink
    rq = slice(int(cu_q[2]), int(cu_q[2]) + int(used_q[2]))
    assert (out[rq] == 0).all()
    torch.testing.assert_close(lse[:, rq], sink.float()[:, None].expand(4, 13))


def test_qkvpacked_gqa_options_cpu(cpu_kernels):  # noqa: F811
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(2, 21, 4 + 2 * 2, 64, generator=g, dtype=torch.float64, requires_grad=True)
    sink = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    out, lse = flash_attn_qkvpacked_func(qkv, causal=True, window_size=(4, 4), softcap=3.0, num_heads_q=4,
                                         learnable_sink=sink, return_attn_probs=True)
    q, k, v = qkv.split([4, 2, 2], dim=2)
    ref, lse_ref = attention_ref(q, k, v, causal=True, window_size=(4, 0), softcap=3.0, sinks=sink)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, lse_ref)
    dqkv, dsink = torch.autograd.grad(out.sum(), (qkv, sink))
    dqkv_ref, dsink_ref = torch.autograd.grad(ref.sum(), (qkv, sink))
    assert dqkv.shape == qkv.shape
    torch.testing.assert_close(dqkv, dqkv_ref)
    torch.testing.assert_close(dsink, dsink_ref)


def test_defaults_pass_no_options(monkeypatch):
    """Without options the wrapper calls flash3.attention exactly as before (no window,
    softcap or sinks keywords): the none and causal kernels."""
    seen = {}

    def spy(q, k, v, **kwargs):
        seen.update(kwargs)
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    monkeypatch.setattr(fai, "_attention", spy)
    q, k, v = (t.detach() for t in _cpu_qkv(0, 1, 5, 7, 2, 2, 64))
    for kwargs in (dict(), dict(window_size=(-1, 0)), dict(window_size=(6, 4)), dict(softcap=0.0),
                   dict(softcap=None), dict(causal=True, window_size=(10, 10))):
        seen.clear()
        flash_attn_func(q, k, v, **kwargs)
        assert not {"window_size", "softcap", "sinks"} & set(seen), (kwargs, seen)
    flash_attn_func(q, k, v, window_size=(2, 1), softcap=5.0, learnable_sink=torch.zeros(2))
    assert seen["window_size"] == (2, 1) and seen["softcap"] == 5.0 and seen["sinks"].shape == (2,)


# ----------------------------------------------------------------------------------------
# GPU: the local-mask kernels against the float64 reference
# ----------------------------------------------------------------------------------------


def _skip_unless_built(dtype, d):
    dp = fai._padded_headdim(d, flash3.SUPPORTED_HEADDIMS)
    for kind in ("fwd", "bwd"):
        if not flash3.is_supported(kind, dtype, dp, False, mask="local"):
            pytest.skip(f"{kind} {dtype} hdim{dp} local mask not in this build")


def _bound(got, want, pt, dtype, what, extra=0.0, magnitude=None, factor=2.0):
    assert got.shape == want.shape, what
    assert not torch.isnan(got).any(), f"{what} has NaN"
    if not got.numel():
        return
    magnitude = magnitude if magnitude is not None else max(want.abs().max().item(), 1e-3)
    err = (got.double() - want.double()).abs().max().item()
    err_pt = (pt.double() - want.double()).abs().max().item()
    floor = (torch.finfo(dtype).eps + extra) * magnitude
    assert err <= factor * err_pt + floor, f"{what}: max error {err:.3e} > {factor} * {err_pt:.3e} + {floor:.1e}"


def _check_lse(lse, lse_ref, extra):
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite), "lse: -inf rows differ"
    if finite.any():
        err = (lse.double() - lse_ref.double())[finite].abs().max().item()
        assert err <= 1e-3 + extra, f"lse: max error {err:.3e}"


def _loss(out, lse, dout, weights):
    """A loss through out and the finite lse entries (a row without key and sink has lse
    -inf and no gradient)."""
    lse = lse.masked_fill(~torch.isfinite(lse.detach()), 0.0)
    return (out * dout.to(out.dtype)).sum() + (lse * weights.to(lse.dtype)).sum()


def _leaves(tensors, upcast):
    """Fresh leaves of the inputs: float64 copies for the truth, same-precision copies (the
    sink in float32) for the yardstick."""
    leaves = []
    for t in tensors:
        if t is None:
            leaves.append(None)
            continue
        t = t.detach()
        t = t.double() if upcast else (t.float() if t.dim() == 1 else t.clone())
        leaves.append(t.requires_grad_())
    return leaves


def _compare(seed, dtype, run, reference, inputs, softcap):
    """run(*inputs) and reference(*leaves, upcast) -> (out, lse); checks out, lse and the
    gradients of the inputs (the sink's included) through both."""
    out, lse = run(*inputs)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
    weights = torch.randn(lse.shape, device="cuda", generator=g)
    with_grad = [t for t in inputs if t is not None]
    grads = torch.autograd.grad(_loss(out, lse, dout, weights), with_grad)
    results = {}
    for upcast in (True, False):
        leaves = _leaves(inputs, upcast)
        o, l = reference(*leaves, upcast=upcast)
        gr = torch.autograd.grad(_loss(o, l, dout, weights), [t for t in leaves if t is not None])
        results[upcast] = (o, l, gr)
    (out_ref, lse_ref, grads_ref), (out_pt, _, grads_pt) = results[True], results[False]
    extra = TANH_ERROR * softcap
    _bound(out, out_ref, out_pt, dtype, "out", extra)
    _check_lse(lse, lse_ref, extra)
    names = ["dq", "dk", "dv", "dsink"] if len(inputs) == 4 else ["dqkv", "dsink"]
    names = [n for n, t in zip(names, inputs) if t is not None]
    magnitude = max([g_.abs().max().item() for n, g_ in zip(names, grads_ref) if n != "dsink"] + [1e-3])
    for name, got, want, pt in zip(names, grads, grads_ref, grads_pt):
        if name == "dsink":
            err = (got.double() - want).abs().max().item()
            err_pt = (pt.double() - want).abs().max().item()
            assert err <= 2 * err_pt + 1e-2 * max(want.abs().max().item(), 1.0), f"dsink: error {err:.3e}"
        else:
            _bound(got, want, pt, dtype, name, extra, magnitude)


DENSE_CASES = [
    # (seqlen_q, seqlen_k, causal, window_size, softcap, sink)
    (257, 257, True, (64, 64), 0.0, True),  # FlashAttention-3: causal makes it (64, 0)
    (200, 333, False, (17, 3), 30.0, False),
    (333, 200, True, (-1, -1), 5.0, True),  # the first 133 rows see no key: lse = sink
    (1, 500, False, (100, 0), 0.0, True),
    (300, 300, False, (0, 0), 0.0, False),
]
DENSE_IDS = [f"{sq}x{sk}-{'c' if c else 'f'}-w{w[0]}_{w[1]}-sc{int(sc)}-{'sink' if s else 'nosink'}"
             for sq, sk, c, w, sc, s in DENSE_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("case", DENSE_CASES, ids=DENSE_IDS)
@pytest.mark.parametrize("d", [64, 128, 80])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flash_attn_func_options(seed, dtype, d, case):
    _skip_unless_built(dtype, d)
    sq, sk, causal, window, softcap, with_sink = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, sq, 6, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(2, sk, 2, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(2, sk, 2, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    sink = (torch.randn(6, device="cuda", generator=g) * 2).requires_grad_() if with_sink else None
    opts = dict(causal=causal, window_size=window, softcap=softcap)

    def run(q, k, v, sink):
        out = flash_attn_func(q, k, v, learnable_sink=sink, **opts)
        assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == dtype
        out2, lse = flash_attn_func(q, k, v, learnable_sink=sink, return_attn_probs=True, **opts)
        assert lse.shape == (2, 6, sq) and lse.dtype == torch.float32
        assert torch.equal(out, out2)
        return out2, lse

    def reference(q, k, v, sink, upcast):
        return attention_ref(q, k, v, sinks=sink, upcast=upcast, **opts)

    _compare(seed, dtype, run, reference, [q, k, v, sink], softcap)


VARLEN_CASES = [
    dict(causal=True, window_size=(40, 40), softcap=0.0, sink=True),
    dict(causal=False, window_size=(25, 10), softcap=15.0, sink=False),
    dict(causal=False, window_size=(-1, -1), softcap=0.0, sink=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", VARLEN_CASES, ids=["causal-w40-sink", "w25_10-softcap", "sink"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flash_attn_varlen_func_options(seed, dtype, d, case):
    _skip_unless_built(dtype, d)
    lens_q = [1, 130, 0, 257, 64]
    lens_k = [50, 100, 9, 300, 0]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(lens_q), 4, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    sink = (torch.randn(4, device="cuda", generator=g) * 2).requires_grad_() if case["sink"] else None
    opts = dict(causal=case["causal"], window_size=case["window_size"], softcap=case["softcap"])

    def run(q, k, v, sink):
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), learnable_sink=sink,
                                          return_attn_probs=True, **opts)
        assert out.shape == q.shape and lse.shape == (4, q.shape[0])
        return out, lse

    def reference(q, k, v, sink, upcast):
        outs, lses = [], []
        cq, ck = cu_q.tolist(), cu_k.tolist()
        for b in range(len(lens_q)):
            o, l = attention_ref(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]],
                                 sinks=sink, upcast=upcast, **opts)
            outs.append(o[0])
            lses.append(l[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    _compare(seed, dtype, run, reference, [q, k, v, sink], case["softcap"])


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["5d", "4d-gqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flash_attn_qkvpacked_func_options(seed, dtype, layout):
    _skip_unless_built(dtype, 128)
    g = torch.Generator(device="cuda").manual_seed(seed)
    heads = (3, 4) if layout == "5d" else (4 + 2 * 2,)
    qkv = torch.randn(2, 311, *heads, 128, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    sink = (torch.randn(4, device="cuda", generator=g) * 2).requires_grad_()
    opts = dict(window_size=(31, 31), softcap=10.0)
    extra = dict() if layout == "5d" else dict(num_heads_q=4)

    def split(qkv):
        return qkv.unbind(2) if layout == "5d" else qkv.split([4, 2, 2], dim=2)

    def run(qkv, sink):
        return flash_attn_qkvpacked_func(qkv, learnable_sink=sink, return_attn_probs=True, **opts, **extra)

    def reference(qkv, sink, upcast):
        return attention_ref(*split(qkv), sinks=sink, upcast=upcast, **opts)

    _compare(seed, dtype, run, reference, [qkv, sink], opts["softcap"])
