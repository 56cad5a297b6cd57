"""FP8 path on the CPU: the quantisation math, its emulation against the reference, the
accuracy ordering of the scaling methods, argument errors, and the ops' fake
implementations under torch.compile. The fused quantiser and the FP8 kernel on a Hopper
GPU: test_fp8_gpu.py.
"""
import math

import pytest
import torch

import flash3
from flash3 import fp8
from flash3.reference import attention_ref

# ---------------------------------------------------------------------------------------
# CPU: the quantisation math
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [64, 128, 256])
def test_hadamard_orthogonal(d):
    h = fp8.hadamard(d, dtype=torch.float64)
    assert torch.equal(h, h.T)
    torch.testing.assert_close(h @ h.T, d * torch.eye(d, dtype=torch.float64))


def test_rotation_cancels_in_qk():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 33, 3, 128, generator=g, dtype=torch.float64)
    k = torch.randn(2, 17, 3, 128, generator=g, dtype=torch.float64)
    s = fp8.random_signs(128, seed=3)
    qr, kr = fp8.rotate(q, s), fp8.rotate(k, s)
    torch.testing.assert_close(torch.einsum("bqhd,bkhd->bhqk", qr, kr), torch.einsum("bqhd,bkhd->bhqk", q, k))


def test_rotation_spreads_outliers():
    x = torch.zeros(1, 1, 1, 128)
    x[..., 5] = 100.0
    xr = fp8.rotate(x, fp8.random_signs(128))
    assert xr.abs().amax() == pytest.approx(100.0 / math.sqrt(128), rel=1e-5)


@pytest.mark.parametrize("block_rows", [64, 128])
@pytest.mark.parametrize("seqlen", [1, 100, 256, 300])
def test_quantize_ref_block_scales(block_rows, seqlen):
    g = torch.Generator().manual_seed(seqlen)
    x = torch.randn(2, seqlen, 3, 64, generator=g) * torch.linspace(0.1, 10, seqlen)[None, :, None, None]
    x8, scale = fp8.quantize_ref(x, block_rows)
    nblk = -(-seqlen // block_rows)
    assert x8.dtype == torch.float8_e4m3fn and scale.shape == (2, 3, nblk)
    # Every block's largest magnitude maps to 448 (e4m3's largest normal).
    deq = fp8.dequantize(x8, scale, block_rows)
    assert (deq.abs().amax(dim=(1, 3)) > 0).all()
    assert x8.float().abs().amax() == 448.0
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normal values.
    err = (deq - x.double()).abs()
    assert (err <= x.double().abs() * 2.0**-4 + scale.max().item() * 2.0**-9).all()


def test_quantize_ref_zero_block_scale_is_one():
    x = torch.zeros(1, 200, 1, 64)
    x[:, :64] = 1.0
    _, scale = fp8.quantize_ref(x, 128)
    assert scale[0, 0, 1].item() == 1.0


def test_emulation_matches_reference_without_quantisation_error():
    # Inputs exactly representable in e4m3 with scale 1: the emulation without P rounding
    # is the float64 reference.
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randint(-4, 5, (1, 70, 2, 64), generator=g).float() for _ in range(3))
    t = fp8.FP8Tensors(q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn),
                       torch.ones(1, 2, 2), torch.ones(1, 2, 1), torch.ones(1, 2, 1))
    for causal in (False, True):
        out = fp8.emulate(t, causal=causal, round_p=False)
        ref, _ = attention_ref(q, k, v, causal=causal, upcast=True)
        torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("causal,window,softcap,with_sinks", [
    (False, (5, 3), 0.0, False), (True, (20, -1), 0.0, False), (False, (0, 0), 0.0, True),
    (True, (-1, -1), 2.5, False), (False, (9, 30), 3.0, True), (True, (-1, -1), 0.0, True),
])
def test_emulation_options_match_reference_without_quantisation_error(causal, window, softcap, with_sinks):
    # As above, with the local mask's options: windows (left 0, right > 0), softcap and
    # sinks, alone and combined; 40 queries on 70 keys, so that with causal the first rows
    # see few keys.
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-4, 5, (1, 40, 2, 64), generator=g).float()
    k, v = (torch.randint(-4, 5, (1, 70, 2, 64), generator=g).float() for _ in range(2))
    t = fp8.FP8Tensors(q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn),
                       torch.ones(1, 2, 1), torch.ones(1, 2, 1), torch.ones(1, 2, 1))
    sinks = torch.randn(2, generator=g, dtype=torch.float64) * 2 if with_sinks else None
    options = dict(window_size=window, softcap=softcap, sinks=sinks)
    out = fp8.emulate(t, causal=causal, round_p=False, **options)
    ref, _ = attention_ref(q, k, v, causal=causal, upcast=True, **options)
    torch.testing.assert_close(out, ref)


def test_attention_fp8_option_errors_name_the_argument():
    q8 = torch.zeros(1, 8, 2, 64).to(torch.float8_e4m3fn)
    fn = "flash3.fp8.attention_fp8"
    cases = [
        (dict(window_size=4), TypeError, "window_size is 4"),
        (dict(window_size=(-2, 0)), ValueError, r"window_size\[0\] is -2"),
        (dict(softcap=-1.0), ValueError, "softcap is -1.0"),
        (dict(sinks=torch.zeros(3)), ValueError, r"sinks.shape is \(3,\)"),
        (dict(sinks=torch.zeros(2, requires_grad=True)), ValueError, "sinks.requires_grad is True"),
    ]
    for kwargs, exc, message in cases:
        with pytest.raises(exc, match=f"{fn}: {message}"):
            fp8.attention_fp8(q8, q8, q8, **kwargs)


# The benchmark module doubles as the data generator of the accuracy tests.
def _accuracy_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "fp8_accuracy.py"
    spec = importlib.util.spec_from_file_location("fp8_accuracy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_emulated_accuracy_ordering():
    acc = _accuracy_module()
    q, k, v = acc.make_inputs("outliers", 1, 1024, 2, 128, seed=0, device="cpu")
    ref = acc.reference(q, k, v, causal=False)
    err = {m: acc.rmse(acc.run_method("emulate", m, q, k, v, False, 0), ref) for m in "abc"}
    assert err["c"] < err["b"] < err["a"], err
    assert err["c"] <= 9.1e-3, err


def test_arguments_after_the_tensors_are_keyword_only():
    q, k, v = (torch.zeros(1, 8, 1, 64, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(TypeError, match="positional"):
        fp8.attention(q, k, v, True)
    q8 = q.to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="positional"):
        fp8.attention_fp8(q8, q8, q8, None, None, None, True)
    with pytest.raises(TypeError, match="positional"):
        fp8.emulate(fp8.FP8Tensors(q8, q8, q8, torch.ones(1, 1, 1), torch.ones(1, 1, 1), torch.ones(1, 1, 1)), True)


needs_fp8_ops = pytest.mark.skipif(not fp8._has_op("fwd_fp8"), reason="extension without the FP8 ops")
# The quantiser is built with the e4m3 kernels (FLASH3_DTYPES).
needs_quantizer = pytest.mark.skipif(not fp8._has_op("quantize_fp8"), reason="extension built without e4m3")


@needs_fp8_ops
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_fake_impls_on_meta(causal):
    """The fake (meta) implementations give the shapes and dtypes of csrc/api_fp8.cpp."""
    b, sq, sk, h, hk, d = 2, 300, 200, 8, 4, 128
    q = torch.empty(b, sq, h, d, dtype=torch.float8_e4m3fn, device="meta")
    k, v = (torch.empty(b, sk, hk, d, dtype=torch.float8_e4m3fn, device="meta") for _ in range(2))
    qs = torch.empty(b, h, 5, device="meta")
    ks, vs = (torch.empty(b, hk, 2, device="meta") for _ in range(2))
    out, lse = torch.ops.flash3.fwd_fp8(q, k, v, qs, ks, vs, 0.125, causal)
    assert out.shape == (b, sq, h, d) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    x = torch.empty(b, sq, h, d, dtype=torch.bfloat16, device="meta")
    signs = torch.empty(d, device="meta")
    for block_rows, blocks in ((64, 5), (128, 3)):
        x8, scale = torch.ops.flash3.quantize_fp8(x, signs, block_rows)
        assert x8.shape == x.shape and x8.dtype == torch.float8_e4m3fn and x8.is_contiguous()
        assert scale.shape == (b, h, blocks) and scale.dtype == torch.float32
    torch.library.opcheck(torch.ops.flash3.fwd_fp8.default, (q, k, v, qs, ks, vs, 0.125, causal),
                          test_utils=("test_schema", "test_faketensor"))
    sinks = torch.empty(h, device="meta")
    out, lse = torch.ops.flash3.fwd_fp8(q, k, v, qs, ks, vs, 0.125, causal, 64, 0, 30.0, sinks)
    assert out.shape == (b, sq, h, d) and lse.shape == (b, h, sq)
    torch.library.opcheck(torch.ops.flash3.fwd_fp8.default, (q, k, v, qs, ks, vs, 0.125, causal, 64, 0, 30.0, sinks),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.flash3.quantize_fp8.default, (x, None, 64),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.skipif(flash3.interface._C is not None, reason="built: the GPU test compiles the real ops")
def test_fp8_attention_traces_as_one_graph_with_stand_in_ops(monkeypatch):
    """torch.compile(fullgraph=True) traces flash3.fp8.attention, first call included (the
    rotation's signs then come from a constant): run on the CPU against stand-in ops of
    the extension's schemas, and a copy of flash3/fp8.py without its CUDA checks."""
    import importlib.util
    import sys

    lib = torch.library.Library("flash3", "FRAGMENT")
    try:
        lib.define("fwd_fp8(Tensor q, Tensor k, Tensor v, Tensor q_scale, Tensor k_scale, Tensor v_scale, "
                   "float softmax_scale, bool causal, int window_left=-1, int window_right=-1, float softcap=0.0, "
                   "Tensor? sinks=None) -> (Tensor out, Tensor lse)")
        lib.define("quantize_fp8(Tensor x, Tensor? signs, int block_rows) -> (Tensor out, Tensor scale)")
        lib.define("fp8_kernels() -> (int[] hdims, str[] masks)")
        monkeypatch.setattr(flash3.interface, "_C", object())
        src = open(fp8.__file__).read()
        cuda_checks = (("if not q8.is_cuda:", "if False:"), ("not per_tensor and q.is_cuda and", "not per_tensor and"))
        for old, new in cuda_checks:
            assert old in src, old
            src = src.replace(old, new)
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader("flash3._fp8_on_cpu", loader=None))
        module.__package__ = "flash3"
        monkeypatch.setitem(sys.modules, "flash3._fp8_on_cpu", module)

        def fwd_fp8(q, k, v, q_scale, k_scale, v_scale, softmax_scale, causal, window_left=-1, window_right=-1,
                    softcap=0.0, sinks=None):
            t = module.FP8Tensors(q, k, v, q_scale, k_scale, v_scale)
            out = module.emulate(t, causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
                                 softcap=softcap, sinks=sinks).to(torch.bfloat16)
            return out, torch.zeros(q.shape[0], q.shape[2], q.shape[1])

        lib.impl("fwd_fp8", fwd_fp8, "CPU")
        lib.impl("quantize_fp8", lambda x, signs, block_rows: module.quantize_ref(x, block_rows, signs), "CPU")
        lib.impl("fp8_kernels", lambda: ([128, 128, 128], ["none", "causal", "local"]), "CompositeExplicitAutograd")
        exec(compile(src, fp8.__file__, "exec"), module.__dict__)
        assert module._OPS == {"fwd_fp8", "quantize_fp8", "fp8_kernels"}

        from torch._dynamo.testing import CompileCounterWithBackend

        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 150, 2, 128, generator=g).to(torch.bfloat16) for _ in range(3))
        for causal, options in ((False, {}), (True, {}), (True, dict(window_size=(40, 0), softcap=20.0))):
            torch._dynamo.reset()
            counter = CompileCounterWithBackend("aot_eager")
            compiled = torch.compile(lambda q, k, v: module.attention(q, k, v, causal=causal, **options),
                                     fullgraph=True, backend=counter)
            out = compiled(q, k, v)
            assert counter.frame_count == 1
            ops = {str(n.target) for gm in counter.graphs for n in gm.graph.nodes if n.op == "call_function"}
            assert {"flash3.quantize_fp8", "flash3.fwd_fp8"} <= ops, ops
            assert torch.equal(out, module.attention(q, k, v, causal=causal, **options))
    finally:
        torch._dynamo.reset()
        lib._destroy()
