"""GPU tests of sliding windows, softcap and attention sinks (the local-mask kernels)
through flash3.attention, forward and backward, against float64 references.

Tolerance as in test_attention_gpu.py / test_backward_gpu.py: the kernel's max error
against float64 is at most twice a same-precision PyTorch implementation's, plus a floor
of one unit in the last place at the values' magnitude (softcap adds its tanh's error:
MUFU.TANH, as FlashAttention-3, is good to about 2^-11 relative, so under softcap the
floor is that times the softcap). The sinks' gradient is float32 and checked against
float64 with a relative bound. Fresh random inputs; gradients poisoned before the run.
"""

import pytest
import torch

import flash3
from flash3.reference import attention_ref

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
HDIMS = [64, 96, 128, 192, 256]
TANH_ERROR = 2.0 ** -10

# (seqlen_q, seqlen_k, causal, window_size, softcap, sinks)
CASES = [
    (300, 300, False, (0, 0), 0.0, False),
    (300, 300, True, (1, 0), 0.0, False),
    (257, 1000, False, (17, 3), 0.0, False),
    (1000, 257, True, (17, 3), 0.0, False),
    (777, 777, False, (-1, 5), 0.0, False),
    (1111, 1111, True, (64, -1), 0.0, False),
    (77, 1300, False, (255, 255), 0.0, False),
    (513, 513, True, (-1, -1), 30.0, False),
    (333, 700, False, (-1, -1), 5.0, False),
    (640, 640, True, (127, 0), 0.0, True),
    (1, 900, False, (-1, -1), 0.0, True),
    (400, 100, True, (40, -1), 20.0, True),
    (1000, 1000, True, (4000, 4000), 0.0, False),  # a window past the sequence: plain causal
    # Past 2k tokens (1k at hdim 256): the local mask runs the general tile for wide
    # windows and the persistent short tile for narrow ones (launch_fwd.h); below, the
    # short tile, except softcap at hdim 256 (the general tile at every length).
    (2100, 2100, True, (-1, -1), 30.0, False),
    (2100, 2300, False, (1500, 600), 0.0, False),
    (2500, 2600, True, (127, 0), 0.0, False),
]
CASE_IDS = [f"{sq}x{sk}-{'c' if c else 'f'}-w{w[0]}_{w[1]}-sc{int(sc)}-{'sink' if s else 'nosink'}"
            for sq, sk, c, w, sc, s in CASES]


def _skip_unless_built(dtype, d):
    for kind in ("fwd", "bwd"):
        if not flash3.is_supported(kind, dtype, d, False, mask="local"):
            pytest.skip(f"{kind} {dtype} hdim{d} local mask not in this build")


def _inputs(seed, b, sq, sk, h, hk, d, dtype, with_sinks, dv=None):
    """q, k of head dim d; v and dout of dv (default d)."""
    dv = d if dv is None else dv
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, sk, hk, dv, device="cuda", dtype=dtype, generator=g)
    dout = torch.randn(b, sq, h, dv, device="cuda", dtype=dtype, generator=g)
    sinks = torch.randn(h, device="cuda", dtype=torch.float32, generator=g) * 2 if with_sinks else None
    return q, k, v, dout, sinks


def _run_flash3(q, k, v, dout, sinks, opts, with_lse):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    s = sinks.detach().clone().requires_grad_() if sinks is not None else None
    out, lse = flash3.attention(q, k, v, sinks=s, return_lse=True, **opts)
    blocks = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    del blocks
    loss = (out * dout).sum()
    if with_lse:
        loss = loss + (lse * torch.linspace(-1, 1, lse.numel(), device=lse.device).view_as(lse)).sum()
    loss.backward()
    return out, lse, (q.grad, k.grad, v.grad, s.grad if s is not None else None)


def _run_reference(q, k, v, dout, sinks, opts, with_lse, upcast):
    if upcast:
        q, k, v, dout = (t.detach().double() for t in (q, k, v, dout))
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    s = None
    if sinks is not None:
        s = (sinks.detach().double() if upcast else sinks.detach().float()).clone().requires_grad_()
    opts = {key: value for key, value in opts.items() if key != "deterministic"}
    out, lse = attention_ref(q, k, v, upcast=upcast, sinks=s, **opts)
    loss = (out * dout).sum()
    if with_lse:
        weights = torch.linspace(-1, 1, lse.numel(), device=lse.device, dtype=lse.dtype).view_as(lse)
        loss = loss + (lse.masked_fill(~torch.isfinite(lse), 0.0) * weights).sum()
    loss.backward()
    return out, lse, (q.grad, k.grad, v.grad, s.grad if s is not None else None)


def _check(q, k, v, dout, sinks, opts, with_lse=False):
    out, lse, grads = _run_flash3(q, k, v, dout, sinks, opts, with_lse)
    out_ref, lse_ref, grads_ref = _run_reference(q, k, v, dout, sinks, opts, with_lse, upcast=True)
    out_pt, _, grads_pt = _run_reference(q, k, v, dout, sinks, opts, with_lse, upcast=False)
    eps = torch.finfo(q.dtype).eps
    softcap = opts.get("softcap", 0.0)
    extra = TANH_ERROR * softcap  # the scores' absolute error under softcap

    def bound(got, want, pt, name):
        assert got.shape == want.shape, name
        assert not torch.isnan(got).any(), f"{name} has NaN (unwritten or invalid)"
        if not got.numel():
            return
        magnitude = max(want.abs().max().item(), 1e-3)
        err = (got.double() - want).abs().max().item()
        err_pt = (pt.double() - want).abs().max().item()
        floor = eps * magnitude + extra * magnitude
        assert err <= 2 * err_pt + floor, f"{name}: max error {err:.3e} > 2 * {err_pt:.3e} + {floor:.1e}"

    bound(out, out_ref, out_pt, "out")
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite.float().bool()), "lse: -inf rows differ"
    lse_err = (lse.double() - lse_ref.double())[finite].abs().max().item() if finite.any() else 0.0
    assert lse_err <= 1e-3 + extra, f"lse: max error {lse_err:.3e}"
    # Gradients: the floor at the largest gradient's magnitude (see test_backward_gpu.py).
    magnitude = max([g.abs().max().item() for g in grads_ref[:3] if g.numel()] + [1e-3])
    floor = (eps + extra) * magnitude
    for name, got, want, pt in zip(("dq", "dk", "dv"), grads[:3], grads_ref[:3], grads_pt[:3]):
        assert not torch.isnan(got).any(), f"{name} has NaN"
        err = (got.double() - want).abs().max().item() if got.numel() else 0.0
        err_pt = (pt.double() - want).abs().max().item() if got.numel() else 0.0
        assert err <= 2 * err_pt + floor, f"{name}: max error {err:.3e} > 2 * {err_pt:.3e} + {floor:.1e}"
    if sinks is not None:
        got, want = grads[3].double(), grads_ref[3]
        err = (got - want).abs().max().item()
        err_pt = (grads_pt[3].double() - want).abs().max().item()
        assert err <= 2 * err_pt + 1e-2 * max(want.abs().max().item(), 1.0), f"dsinks: error {err:.3e}"


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("d", HDIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_options_match_reference(seed, dtype, d, case):
    _skip_unless_built(dtype, d)
    sq, sk, causal, window, softcap, with_sinks = case
    if dtype == torch.float16 and d in (96, 192) and case is not CASES[2] and case is not CASES[7]:
        pytest.skip("fp16 at hdim 96/192: two cases (the kernels are bf16's templates)")
    q, k, v, dout, sinks = _inputs(seed, 2, sq, sk, 4, 4, d, dtype, with_sinks)
    _check(q, k, v, dout, sinks, dict(causal=causal, window_size=window, softcap=softcap))


@pytest.mark.parametrize("hk", [1, 2], ids=["mqa", "gqa"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_options_gqa_and_lse_gradient(seed, d, hk):
    _skip_unless_built(torch.bfloat16, d)
    q, k, v, dout, sinks = _inputs(seed, 2, 601, 733, 6, hk, d, torch.bfloat16, True)
    _check(q, k, v, dout, sinks, dict(causal=True, window_size=(100, 0), softcap=10.0), with_lse=True)


@pytest.mark.parametrize("d", [64, 128])
def test_window_deterministic_backward(seed, d):
    _skip_unless_built(torch.bfloat16, d)
    q, k, v, dout, sinks = _inputs(seed, 2, 1500, 1500, 4, 4, d, torch.bfloat16, True)
    runs = []
    for _ in range(2):
        _, _, grads = _run_flash3(q, k, v, dout, sinks,
                                  dict(causal=True, window_size=(300, 0), deterministic=True), False)
        runs.append(grads)
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    _check(q, k, v, dout, sinks, dict(causal=True, window_size=(300, 0), deterministic=True))


def test_window_rows_without_keys():
    """Rows whose window holds no key: output 0, lse -inf; with sinks lse = sink."""
    _skip_unless_built(torch.bfloat16, 128)
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(1, 200, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 50, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    # seqlen_q > seqlen_k and right window 0: rows 0..149 see no key.
    out, lse = flash3.attention(q, k, v, window_size=(10, 0), return_lse=True)
    assert torch.all(out[:, :150] == 0) and torch.all(lse[:, :, :150] == float("-inf"))
    assert torch.isfinite(lse[:, :, 150:]).all()
    sinks = torch.tensor([0.5, -1.5], device="cuda")
    out, lse = flash3.attention(q, k, v, window_size=(10, 0), sinks=sinks, return_lse=True)
    assert torch.all(out[:, :150] == 0)
    torch.testing.assert_close(lse[0, :, :150], sinks.view(2, 1).expand(2, 150))
    # No key at all.
    out, lse = flash3.attention(q, k[:, :0], v[:, :0], sinks=sinks, return_lse=True)
    assert torch.all(out == 0)
    torch.testing.assert_close(lse[0], sinks.view(2, 1).expand(2, 200))


def test_window_skips_tiles_outside():
    """A window's cost follows the window: keys far outside it do not change the result
    (NaN there would spread to every row if those tiles were read)."""
    _skip_unless_built(torch.bfloat16, 128)
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, 4096, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 4096, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    out = flash3.attention(q, k, v, causal=True, window_size=(255, 0))
    k2, v2 = k.clone(), v.clone()
    k2[:, :1024], v2[:, :1024] = float("nan"), float("nan")  # outside every window of rows >= 1536
    out2 = flash3.attention(q, k2, v2, causal=True, window_size=(255, 0))
    assert torch.equal(out[:, 1536:], out2[:, 1536:])


def test_options_compile_fullgraph():
    _skip_unless_built(torch.bfloat16, 128)
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(1, 300, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
               for _ in range(3))
    sinks = torch.randn(4, device="cuda", generator=g, requires_grad=True)

    def f(q, k, v, sinks):
        return flash3.attention(q, k, v, causal=True, window_size=(63, 0), softcap=20.0, sinks=sinks)

    compiled = torch.compile(f, fullgraph=True)
    out = compiled(q, k, v, sinks)
    out.sum().backward()
    ref = f(q, k, v, sinks)
    assert torch.equal(out, ref)
    assert sinks.grad is not None and torch.isfinite(sinks.grad).all()


def test_opcheck_options():
    _skip_unless_built(torch.bfloat16, 128)
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 130, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    sinks = torch.randn(4, device="cuda", generator=g)
    args = (q, k, v, 0.125, True, False, 31, 0, 15.0, sinks)
    torch.library.opcheck(torch.ops.flash3.fwd.default, args, test_utils=("test_schema", "test_faketensor"))
    out, lse = torch.ops.flash3.fwd(*args)
    torch.library.opcheck(torch.ops.flash3.bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, None, 0.125, True, False, 31, 0, 15.0, sinks),
                          test_utils=("test_schema", "test_faketensor"))


def test_equivalent_windows_run_the_same_mask():
    """(-1, 0) is causal; causal with (w, -1), (w, w) and (w, 0) and (w, 0) without causal
    are one window; a window covering every key is none: the same bits."""
    _skip_unless_built(torch.bfloat16, 128)
    g = torch.Generator(device="cuda").manual_seed(13)
    q, k, v = (torch.randn(2, 333, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    assert torch.equal(flash3.attention(q, k, v, window_size=(-1, 0)), flash3.attention(q, k, v, causal=True))
    assert torch.equal(flash3.attention(q, k, v, window_size=(332, 332)), flash3.attention(q, k, v))
    windows = [flash3.attention(q, k, v, causal=True, window_size=(50, right)) for right in (-1, 50, 0, 1000)]
    windows.append(flash3.attention(q, k, v, window_size=(50, 0)))
    for out in windows[1:]:
        assert torch.equal(out, windows[0])


def test_sinks_device_dtype_and_gradient():
    _skip_unless_built(torch.bfloat16, 64)
    g = torch.Generator(device="cuda").manual_seed(17)
    q, k, v = (torch.randn(1, 200, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
               for _ in range(3))
    with pytest.raises(TypeError, match=r"flash3\.attention: sinks\.device is cpu; supported: the device of q"):
        flash3.attention(q, k, v, sinks=torch.zeros(4))
    sinks32 = torch.randn(4, device="cuda", generator=g)
    # a sink that does not require grad: q, k, v still get theirs, the sink none
    s = sinks32.clone()
    flash3.attention(q, k, v, causal=True, sinks=s).sum().backward()
    assert s.grad is None and q.grad is not None
    # bf16 sinks: cast to float32 for the kernel, the gradient back in bf16
    s16 = sinks32.bfloat16().requires_grad_()
    s32 = s16.detach().float().requires_grad_()
    out16 = flash3.attention(q, k, v, causal=True, sinks=s16)
    out32 = flash3.attention(q, k, v, causal=True, sinks=s32)
    assert torch.equal(out16, out32)
    dout = torch.randn_like(out16)
    (g16,) = torch.autograd.grad((out16 * dout).sum(), s16)
    (g32,) = torch.autograd.grad((out32 * dout).sum(), s32)
    assert g16.dtype == torch.bfloat16 and torch.equal(g16, g32.bfloat16())
