"""GPU tests of sliding windows, softcap and sinks in packed batches
(flash3.attention_varlen): each sequence against the float64 reference on that sequence
alone (windows bottom-right aligned per sequence), forward and backward, with seqused
slots and empty sequences; rows outside every sequence must stay unwritten (the output
memory is poisoned first)."""
import pytest
import torch

import flash3
from flash3.reference import attention_ref
from test_varlen_gpu import _cu

pytestmark = pytest.mark.gpu

HDIMS = [64, 96, 128, 192, 256]
OPTIONS = [
    dict(causal=True, window_size=(63, 0), softcap=0.0, sinks=False),
    dict(causal=False, window_size=(100, 30), softcap=0.0, sinks=False),
    dict(causal=True, window_size=(-1, -1), softcap=25.0, sinks=False),
    dict(causal=True, window_size=(127, 0), softcap=0.0, sinks=True),
    dict(causal=False, window_size=(-1, -1), softcap=8.0, sinks=True),
]
OPTION_IDS = ["causal-w63", "w100_30", "causal-softcap", "causal-w127-sinks", "softcap-sinks"]
TANH_ERROR = 2.0 ** -10


def _skip_unless_built(dtype, d):
    for kind in ("fwd", "bwd"):
        if not flash3.is_supported(kind, dtype, d, False, mask="local"):
            pytest.skip(f"{kind} {dtype} hdim{d} local mask not in this build")




@pytest.mark.parametrize("lengths", ["short", "long"])
@pytest.mark.parametrize("opts", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("d", HDIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_varlen_options(seed, dtype, d, opts, lengths):
    if dtype == torch.float16 and d not in (64, 128):
        pytest.skip("fp16: head dims 64 and 128 (the kernels are bf16's templates)")
    _skip_unless_built(dtype, d)
    check_varlen_options(seed, dtype, d, d, opts, lengths)


def check_varlen_options(seed, dtype, d, dv, opts, lengths):
    """A packed batch of seven sequences (empty ones, seqused slack, GQA) with the options
    opts, q and k of head dim d, v of dv: each sequence against the float64 reference, the
    rows outside every sequence unwritten."""
    lens_q = [0, 5, 300, 1, 129, 777, 64]
    lens_k = [3, 0, 350, 1, 129, 700, 200]
    if lengths == "long":
        # A sequence past 2k tokens: at hdim 64 and 128 the general tile for the unbounded
        # windows, the persistent short tile for the narrow ones (launch_fwd.h).
        lens_q[2], lens_k[2] = 2300, 2150
    slack_q = [2, 0, 9, 0, 31, 0, 5]  # rows of the slot past seqused
    slack_k = [0, 4, 0, 2, 0, 13, 1]
    h, hk = 4, 2
    g = torch.Generator(device="cuda").manual_seed(seed)
    slots_q = [n + s for n, s in zip(lens_q, slack_q)]
    slots_k = [n + s for n, s in zip(lens_k, slack_k)]
    q = torch.randn(sum(slots_q), h, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(sum(slots_k), hk, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(sum(slots_k), hk, dv, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    dout = torch.randn(sum(slots_q), h, dv, device="cuda", dtype=dtype, generator=g)
    sinks = (torch.randn(h, device="cuda", generator=g) * 2).requires_grad_() if opts["sinks"] else None
    cu_q, cu_k = _cu(slots_q), _cu(slots_k)
    used_q = torch.tensor(lens_q, dtype=torch.int32, device="cuda")
    used_k = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    kwargs = dict(causal=opts["causal"], window_size=opts["window_size"], softcap=opts["softcap"])

    poison = [torch.full((sum(slots_q), h, dv), float("nan"), device="cuda", dtype=dtype),
              torch.full((h, sum(slots_q)), float("nan"), device="cuda")]
    ptrs = [t.data_ptr() for t in poison]
    del poison
    out, lse = flash3.attention_varlen(q, k, v, cu_q, cu_k, max(slots_q), max(slots_k), seqused_q=used_q,
                                       seqused_k=used_k, sinks=sinks, return_lse=True, **kwargs)
    poisoned = out.data_ptr() == ptrs[0] and lse.data_ptr() == ptrs[1]
    (out * dout).nan_to_num(0.0).sum().backward()

    extra = TANH_ERROR * opts["softcap"]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    written = torch.zeros(q.shape[0], dtype=torch.bool, device="cuda")
    dsinks_ref = torch.zeros(h, dtype=torch.float64, device="cuda")
    for b in range(len(lens_q)):
        rq, rk = slice(cq[b], cq[b] + lens_q[b]), slice(ck[b], ck[b] + lens_k[b])
        written[rq] = True
        qb, kb, vb = (t.detach()[None, r].double().requires_grad_() for t, r in ((q, rq), (k, rk), (v, rk)))
        sb = sinks.detach().double().requires_grad_() if sinks is not None else None
        out_ref, lse_ref = attention_ref(qb, kb, vb, sinks=sb, **kwargs)
        (out_ref * dout[None, rq].double()).sum().backward()
        # The same-precision PyTorch implementation, forward and backward, for the error bounds.
        qp, kp, vp = (t.detach()[None, r].clone().requires_grad_() for t, r in ((q, rq), (k, rk), (v, rk)))
        out_pt, _ = attention_ref(qp, kp, vp, upcast=False, sinks=None if sinks is None else sinks.detach(), **kwargs)
        (out_pt * dout[None, rq]).sum().backward()
        got = out[None, rq].detach()
        assert not torch.isnan(got).any(), f"sequence {b}: NaN in its rows"
        if got.numel():
            mag = max(out_ref.abs().max().item(), 1e-3)
            err = (got.double() - out_ref).abs().max().item()
            err_pt = (out_pt.double() - out_ref).abs().max().item()
            assert err <= 2 * err_pt + (torch.finfo(dtype).eps + extra) * mag, f"sequence {b}: out error {err:.3e}"
            lr = lse_ref[0]
            fin = torch.isfinite(lr)
            assert torch.equal(torch.isfinite(lse[:, rq]), fin), f"sequence {b}: lse -inf rows"
            if fin.any():
                assert (lse[:, rq].double() - lr)[fin].abs().max().item() <= 1e-3 + extra
        # Gradients as in test_masks_gpu.py: twice the same-precision error plus a floor at the
        # sequence's largest gradient.
        mag = max([ref.grad.abs().max().item() for ref in (qb, kb, vb) if ref.grad.numel()] + [1e-3])
        floor = (torch.finfo(dtype).eps + extra) * mag
        for name, t, r, ref, pt in (("dq", q, rq, qb, qp), ("dk", k, rk, kb, kp), ("dv", v, rk, vb, vp)):
            if not t.grad[r].numel():
                continue
            err = (t.grad[r].double() - ref.grad[0]).abs().max().item()
            err_pt = (pt.grad[0].double() - ref.grad[0]).abs().max().item()
            assert err <= 2 * err_pt + floor, f"sequence {b}: {name} error {err:.3e} > 2 * {err_pt:.3e} + {floor:.1e}"
        if sb is not None:
            dsinks_ref += sb.grad
    if sinks is not None:
        err = (sinks.grad.double() - dsinks_ref).abs().max().item()
        assert err <= 1e-2 * max(dsinks_ref.abs().max().item(), 1.0), f"dsinks error {err:.3e}"
    # Slot rows past seqused get zero gradients; rows of no sequence are never written.
    assert torch.all(q.grad[~written] == 0)
    if poisoned:
        assert torch.isnan(out[~written]).all(), "rows outside the sequences were written"


def test_varlen_options_compile_fullgraph_and_opcheck():
    d, dtype = 128, torch.bfloat16
    _skip_unless_built(dtype, d)
    lens = [5, 300, 77]
    g = torch.Generator(device="cuda").manual_seed(21)
    q = torch.randn(sum(lens), 4, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(sum(lens), 2, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(sum(lens), 2, d, device="cuda", dtype=dtype, generator=g)
    sinks = torch.randn(4, device="cuda", generator=g)
    cu = _cu(lens)

    def f(q, k, v, sinks):
        return flash3.attention_varlen(q, k, v, cu, cu, 300, 300, causal=True, window_size=(40, 0), softcap=12.0,
                                       sinks=sinks)

    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(q, k, v, sinks), f(q, k, v, sinks))
    args = (q, k, v, cu, cu, None, None, 300, 300, d ** -0.5, True, False, 40, 0, 12.0, sinks)
    torch.library.opcheck(torch.ops.flash3.fwd_varlen.default, args, test_utils=("test_schema", "test_faketensor"))
    out, lse = torch.ops.flash3.fwd_varlen(*args)
    torch.library.opcheck(torch.ops.flash3.bwd_varlen.default,
                          (torch.randn_like(out), q, k, v, out, lse, None, cu, cu, None, None, 300, 300, d ** -0.5,
                           True, False, 40, 0, 12.0, sinks), test_utils=("test_schema", "test_faketensor"))
    qg, kg, vg, sg = (t.clone().requires_grad_() for t in (q, k, v, sinks))
    compiled(qg, kg, vg, sg).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (qg, kg, vg, sg))


def test_varlen_sinks_device_error():
    _skip_unless_built(torch.bfloat16, 64)
    q = torch.randn(10, 4, 64, device="cuda", dtype=torch.bfloat16)
    cu = _cu([4, 6])
    with pytest.raises(TypeError, match=r"flash3\.attention_varlen: sinks\.device is cpu; supported: the device"):
        flash3.attention_varlen(q, q, q, cu, cu, 6, 6, sinks=torch.zeros(4))
