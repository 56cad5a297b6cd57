"""CPU tests of the arguments of sliding windows, softcap and attention sinks: validation
(before any device check, so the same errors everywhere) through flash3.attention,
flash3.attention_varlen and the FlashAttention-3 interface; the window normalisation that
picks the kernel (none, causal or local) and its agreement with the reference masks; the
build check naming the local kernel; the ops' fake implementations with the options."""
import inspect
import math
import re

import pytest
import torch

import flash3
from flash3 import flash_attn_interface as fai
from flash3 import interface
from flash3.reference import causal_mask, window_mask
from test_api import _qkv


def _packed(h=4, hk=2, d=64):
    q, k, v = (t.flatten(0, 1) for t in _qkv(h=h, hk=hk, d=d))
    cu_q = torch.tensor([0, 17, 34], dtype=torch.int32)
    cu_k = torch.tensor([0, 33, 66], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def _dense(**kwargs):
    q, k, v = _qkv()
    return flash3.attention(q, k, v, **kwargs)


def _varlen(**kwargs):
    q, k, v, cu_q, cu_k = _packed()
    return flash3.attention_varlen(q, k, v, cu_q, cu_k, 17, 33, **kwargs)


CALLS = {"flash3.attention": _dense, "flash3.attention_varlen": _varlen}

# (kwargs, exception, message after "<function>: ")
INVALID = [
    (dict(window_size=5), TypeError, r"window_size is 5; supported: a pair \(left, right\) of ints >= -1"),
    (dict(window_size=(1, 2, 3)), TypeError, r"window_size is \(1, 2, 3\); supported: a pair"),
    (dict(window_size=None), TypeError, r"window_size is None; supported: a pair"),
    (dict(window_size=(True, 0)), TypeError, r"window_size\[0\] is True; supported: an int >= -1"),
    (dict(window_size=(4, 1.5)), TypeError, r"window_size\[1\] is 1\.5; supported: an int >= -1"),
    (dict(window_size=(4, torch.tensor(2))), TypeError, r"window_size\[1\] is tensor\(2\); supported: an int"),
    (dict(window_size=(-2, 0)), ValueError, r"window_size\[0\] is -2; supported: an int >= -1 \(-1: unbounded\)"),
    (dict(window_size=(3, -7)), ValueError, r"window_size\[1\] is -7; supported: an int >= -1"),
    (dict(softcap=True), TypeError, r"softcap is bool; supported: a float >= 0 \(0: off\)"),
    (dict(softcap="30"), TypeError, r"softcap is str; supported: a float >= 0"),
    (dict(softcap=None), TypeError, r"softcap is NoneType; supported: a float >= 0"),
    (dict(softcap=-1.0), ValueError, r"softcap is -1\.0; supported: a finite float >= 0 \(0: off\)"),
    (dict(softcap=float("inf")), ValueError, r"softcap is inf; supported: a finite float >= 0"),
    (dict(softcap=float("nan")), ValueError, r"softcap is nan; supported: a finite float >= 0"),
    (dict(sinks=[0.0] * 4), TypeError, r"sinks is list; supported: None or a torch\.Tensor of shape \(nheads,\)"),
    (dict(sinks=torch.zeros(4, dtype=torch.int32)), TypeError, r"sinks\.dtype is torch\.int32; supported: a floating"),
    (dict(sinks=torch.zeros(2)), ValueError, r"sinks\.shape is \(2,\); supported: \(nheads,\) = \(4,\)"),
    (dict(sinks=torch.zeros(4, 1)), ValueError, r"sinks\.shape is \(4, 1\); supported: \(nheads,\) = \(4,\)"),
    (dict(sinks=torch.zeros(())), ValueError, r"sinks\.shape is \(\); supported: \(nheads,\)"),
    (dict(deterministic=1), TypeError, r"deterministic is int; supported: bool"),
]
INVALID_IDS = ["window-int", "window-triple", "window-none", "window-bool", "window-float", "window-tensor",
               "window-left-2", "window-right-7", "softcap-bool", "softcap-str", "softcap-none", "softcap-negative",
               "softcap-inf", "softcap-nan", "sinks-list", "sinks-int", "sinks-short", "sinks-2d", "sinks-0d",
               "deterministic-int"]


@pytest.mark.parametrize("fn", sorted(CALLS))
@pytest.mark.parametrize("kwargs, exc, pattern", INVALID, ids=INVALID_IDS)
def test_invalid_options_raise_before_the_device_check(fn, kwargs, exc, pattern):
    # CPU tensors: the option, not the device, is what gets reported.
    with pytest.raises(exc, match="^" + fn.replace(".", r"\.") + ": " + pattern):
        CALLS[fn](**kwargs)


VALID = [
    dict(), dict(window_size=(-1, -1)), dict(window_size=[3, 0]), dict(window_size=(0, 0)),
    dict(window_size=(-1, 5)), dict(window_size=(10**30, 10**30)), dict(causal=True, window_size=(8, 8)),
    dict(softcap=0), dict(softcap=30), dict(softcap=5.0), dict(sinks=torch.zeros(4)),
    dict(sinks=torch.zeros(4, dtype=torch.float16)), dict(sinks=torch.zeros(4, dtype=torch.float64)),
    dict(window_size=(63, 0), softcap=20.0, sinks=torch.randn(4, requires_grad=True), deterministic=True),
]


@pytest.mark.parametrize("fn", sorted(CALLS))
@pytest.mark.parametrize("kwargs", VALID, ids=range(len(VALID)))
def test_valid_options_reach_the_device_check(fn, kwargs):
    with pytest.raises(TypeError, match="^" + fn.replace(".", r"\.") + r": q\.device is cpu; supported: CUDA"):
        CALLS[fn](**kwargs)


def test_options_are_keyword_only_with_defaults():
    for fn in (flash3.attention, flash3.attention_varlen):
        params = inspect.signature(fn).parameters
        for name, default in (("window_size", (-1, -1)), ("softcap", 0.0), ("sinks", None)):
            assert params[name].kind == params[name].KEYWORD_ONLY, (fn.__name__, name)
            assert params[name].default == default, (fn.__name__, name)
        names = list(params)
        # existing arguments keep their order; the options follow softmax_scale
        assert names.index("causal") < names.index("softmax_scale") < names.index("window_size")
        assert names.index("sinks") < names.index("return_lse") < names.index("deterministic")


def test_tensor_errors_come_before_option_errors():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"q\.dtype is torch\.float32"):
        flash3.attention(q.float(), k, v, window_size=(-5, 0))


# ----------------------------------------------------------------------------------------
# Window normalisation: which kernel a call runs
# ----------------------------------------------------------------------------------------

NORMALISATION = [
    # (causal, window, softcap, sinks, seqlen_q, seqlen_k, kernel)
    (False, (-1, -1), 0.0, False, 100, 200, "none"),
    (True, (-1, -1), 0.0, False, 100, 200, "causal"),
    (False, (-1, 0), 0.0, False, 100, 200, "causal"),
    (True, (-1, 0), 0.0, False, 100, 200, "causal"),
    (True, (-1, 5), 0.0, False, 100, 200, "causal"),  # causal sets right to 0
    (True, (199, 7), 0.0, False, 100, 200, "causal"),  # left covers every key
    (True, (198, 0), 0.0, False, 100, 200, "local"),
    (True, (50, -1), 0.0, False, 100, 200, "local"),
    (False, (199, 99), 0.0, False, 100, 200, "none"),  # both sides past the sequences
    (False, (10**9, 10**9), 0.0, False, 100, 200, "none"),
    (False, (-1, 99), 0.0, False, 100, 200, "none"),
    (False, (-1, 98), 0.0, False, 100, 200, "local"),
    (False, (199, 0), 0.0, False, 100, 200, "causal"),
    (False, (0, 0), 0.0, False, 100, 200, "local"),
    (False, (0, -1), 0.0, False, 100, 200, "local"),
    (False, (-1, -1), 30.0, False, 100, 200, "local"),
    (True, (-1, -1), 30.0, False, 100, 200, "local"),
    (False, (-1, -1), 0.0, True, 100, 200, "local"),
    (True, (-1, -1), 0.0, True, 100, 200, "local"),
    (True, (-1, -1), 0.0, False, 1, 200, "causal"),  # decoding: the causal kernel, as the op
    (False, (5, 0), 0.0, False, 1, 200, "local"),
    (False, (3, 3), 0.0, False, 1, 1, "none"),
    (False, (0, 0), 0.0, False, 0, 0, "none"),
]


@pytest.mark.parametrize("causal, window, softcap, sinks, sq, sk, kernel", NORMALISATION)
def test_mask_kind(causal, window, softcap, sinks, sq, sk, kernel):
    assert interface._mask_kind(causal, window, softcap, torch.zeros(4) if sinks else None, sq, sk) == kernel


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (1, 9), (9, 1), (6, 6), (5, 11), (11, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_normalisation_never_changes_the_mask(seqlen_q, seqlen_k, causal):
    """Whatever kernel _mask_kind picks, its mask is the window's: "none" sees every key,
    "causal" the causal mask; and FlashAttention-3's normalisation in
    flash_attn_interface gives the same mask as the raw window."""
    sides = [-1, 0, 1, 2, seqlen_q - 2, seqlen_q - 1, seqlen_k - 2, seqlen_k - 1, seqlen_k + 3]
    for left in sorted({s for s in sides if s >= -1}):
        for right in sorted({s for s in sides if s >= -1}):
            want = window_mask(seqlen_q, seqlen_k, (left, right), causal)
            kind = interface._mask_kind(causal, (left, right), 0.0, None, seqlen_q, seqlen_k)
            if kind == "none":
                assert want.all(), (left, right)
            elif kind == "causal":
                assert torch.equal(want, causal_mask(seqlen_q, seqlen_k)), (left, right)
            fa_causal, fa_window = fai._window("f", (left, right), causal, seqlen_q, seqlen_k)
            assert torch.equal(window_mask(seqlen_q, seqlen_k, fa_window, fa_causal), want), (left, right)


def test_flash_attn_interface_window_normalisation():
    w = fai._window
    assert w("f", (-1, -1), False, 17, 33) == (False, (-1, -1))
    assert w("f", (-1, 0), False, 17, 33) == (True, (-1, -1))
    assert w("f", (32, 16), False, 17, 33) == (False, (-1, -1))
    assert w("f", (32, 0), False, 17, 33) == (True, (-1, -1))
    assert w("f", (31, 0), False, 17, 33) == (False, (31, 0))
    assert w("f", (8, 5), True, 17, 33) == (True, (8, 0))
    assert w("f", (-7, -3), False, 17, 33) == (False, (-1, -1))  # FlashAttention-3: negative is unbounded
    assert w("f", torch.tensor([4, 2]), False, None, None) == (False, (4, 2))
    with pytest.raises(TypeError, match=r"^f: window_size\[0\] is bool; supported: an int"):
        w("f", (True, 0), False, 17, 33)
    with pytest.raises(TypeError, match=r"^f: window_size is 3; supported: a pair"):
        w("f", 3, False, 17, 33)


# ----------------------------------------------------------------------------------------
# The build check
# ----------------------------------------------------------------------------------------


@pytest.fixture
def fake_build(monkeypatch):
    """A build of bf16 hdim 128: none and causal for both passes, local for the forward only."""
    built = frozenset({("fwd", "bf16", 128, 128, "none"), ("fwd", "bf16", 128, 128, "causal"),
                       ("bwd", "bf16", 128, 128, "none"), ("bwd", "bf16", 128, 128, "causal"),
                       ("fwd", "bf16", 128, 128, "local"), ("fwd", "bf16", 192, 128, "causal")})
    monkeypatch.setattr(interface, "_BUILT", built)


def test_is_supported_with_mask(fake_build):
    assert flash3.is_supported("fwd", torch.bfloat16, 128, False)
    assert flash3.is_supported("bwd", "bf16", 128, True)
    assert flash3.is_supported("fwd", "bf16", 128, False, mask="local")
    assert not flash3.is_supported("bwd", "bf16", 128, False, mask="local")
    assert flash3.is_supported("bwd", "bf16", 128, False, mask="causal")  # mask overrides causal
    assert not flash3.is_supported("fwd", "fp16", 128, False, mask="local")
    assert flash3.is_supported("fwd", "bf16", 192, True, hdim_v=128)
    assert not flash3.is_supported("fwd", "bf16", 192, True)


def test_check_built_names_the_local_kernel(fake_build):
    q, _, _ = _qkv(d=128)
    interface._check_built("fwd", q, False, "local")
    with pytest.raises(flash3.KernelNotBuiltError,
                       match=r"^flash3\.attention: the backward kernel for dtype bf16, headdim 128, mask local was "
                             r"not built .*this build holds: bf16/hdim128/causal, bf16/hdim128/none$"):
        interface._check_built("bwd", q, False, "local")
    with pytest.raises(flash3.KernelNotBuiltError, match=r"^flash3\.attention_varlen: the forward kernel for dtype "
                                                         r"fp16, headdim 128, mask local"):
        interface._check_built("fwd", q.half(), True, "local", "flash3.attention_varlen")
    q, _, v = _qkv(d=192)
    interface._check_built("fwd", q, True, v=v[..., :128])
    with pytest.raises(flash3.KernelNotBuiltError, match=r"the backward kernel for dtype bf16, headdim 192, "
                                                         r"headdim_v 128, mask causal was not built"):
        interface._check_built("bwd", q, True, v=v[..., :128])
    assert issubclass(flash3.KernelNotBuiltError, ValueError)


# ----------------------------------------------------------------------------------------
# The ops (with the compiled extension only)
# ----------------------------------------------------------------------------------------

needs_ext = pytest.mark.skipif(interface._C is None, reason="extension not built")


@needs_ext
def test_schemas_take_the_options():
    for op in ("fwd", "bwd", "fwd_varlen", "bwd_varlen"):
        schema = str(getattr(torch.ops.flash3, op).default._schema)
        for text in ("int window_left=-1", "int window_right=-1", "float softcap=0.", "Tensor? sinks=None"):
            assert text in schema, (op, text)
        if op.startswith("bwd"):
            assert "Tensor dsinks" in schema


@needs_ext
@pytest.mark.parametrize("with_sinks", [False, True])
def test_fake_impls_with_options_on_meta(with_sinks):
    q, k, v = _qkv(device="meta")
    sinks = torch.zeros(4, device="meta") if with_sinks else None
    out, lse = torch.ops.flash3.fwd(q, k, v, 0.125, True, False, 31, 0, 15.0, sinks)
    assert out.shape == q.shape and lse.shape == (2, 4, 17) and lse.dtype == torch.float32
    dq, dk, dv, dsinks = torch.ops.flash3.bwd(out, q, k, v, out, lse, None, 0.125, True, False, 31, 0, 15.0, sinks)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dsinks.dtype == torch.float32 and dsinks.shape == ((4,) if with_sinks else (0,))
    qp, kp, vp = (t.flatten(0, 1).to("meta") for t in _qkv())
    cu_q = torch.tensor([0, 17, 34], dtype=torch.int32, device="meta")
    cu_k = torch.tensor([0, 33, 66], dtype=torch.int32, device="meta")
    out, lse = torch.ops.flash3.fwd_varlen(qp, kp, vp, cu_q, cu_k, None, None, 17, 33, 0.125, False, False, 5, 5,
                                           0.0, sinks)
    assert out.shape == qp.shape and lse.shape == (4, 34)
    grads = torch.ops.flash3.bwd_varlen(out, qp, kp, vp, out, lse, None, cu_q, cu_k, None, None, 17, 33, 0.125,
                                        False, False, 5, 5, 0.0, sinks)
    assert grads[3].shape == ((4,) if with_sinks else (0,))


# ----------------------------------------------------------------------------------------
# FlashAttention-3's interface
# ----------------------------------------------------------------------------------------

FA3_INVALID = [
    (dict(window_size=7), TypeError, r"window_size is 7; supported: a pair \(left, right\)"),
    (dict(window_size=(False, 0)), TypeError, r"window_size\[0\] is bool; supported: an int"),
    (dict(window_size=(2, 0.5)), TypeError, r"window_size\[1\] is float; supported: an int"),
    (dict(softcap="1"), TypeError, r"softcap is str; supported: a float >= 0"),
    (dict(softcap=-3.0), ValueError, r"softcap is -3\.0; supported: a finite float >= 0"),
    (dict(softcap=math.inf), ValueError, r"softcap is inf; supported: a finite float >= 0"),
    (dict(learnable_sink=[1.0] * 4), TypeError, r"learnable_sink is list; supported: None or a torch\.Tensor"),
    (dict(learnable_sink=torch.zeros(4, dtype=torch.int64)), TypeError,
     r"learnable_sink\.dtype is torch\.int64; supported: a floating dtype"),
    (dict(learnable_sink=torch.zeros(2)), ValueError,
     r"learnable_sink\.shape is \(2,\); supported: \(nheads,\) = \(4,\)"),
]
FA3_INVALID_IDS = ["window-int", "window-bool", "window-float", "softcap-str", "softcap-negative", "softcap-inf",
                   "sink-list", "sink-int", "sink-shape"]


def _fa3_func(**kwargs):
    q, k, v = _qkv()
    return fai.flash_attn_func(q, k, v, **kwargs)


def _fa3_varlen(**kwargs):
    q, k, v, cu_q, cu_k = _packed()
    return fai.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 33, **kwargs)


def _fa3_qkvpacked(**kwargs):
    return fai.flash_attn_qkvpacked_func(torch.randn(2, 33, 3, 4, 64, dtype=torch.bfloat16), **kwargs)


FA3_CALLS = {"flash_attn_func": _fa3_func, "flash_attn_varlen_func": _fa3_varlen,
             "flash_attn_qkvpacked_func": _fa3_qkvpacked}


@pytest.mark.parametrize("fn", sorted(FA3_CALLS))
@pytest.mark.parametrize("kwargs, exc, pattern", FA3_INVALID, ids=FA3_INVALID_IDS)
def test_flash_attn_interface_invalid_options(fn, kwargs, exc, pattern):
    with pytest.raises(exc, match="^" + fn + ": " + pattern):
        FA3_CALLS[fn](**kwargs)


@pytest.mark.parametrize("fn", sorted(FA3_CALLS))
@pytest.mark.parametrize("kwargs", [dict(window_size=(4, 0)), dict(softcap=30.0), dict(softcap=None),
                                    dict(learnable_sink=torch.zeros(4)), dict(causal=True, window_size=(100, 100)),
                                    dict(window_size=(3, 3), softcap=2.0, learnable_sink=torch.zeros(4))],
                         ids=["window", "softcap", "softcap-none", "sink", "window-covers-all", "all"])
def test_flash_attn_interface_valid_options_reach_flash3(fn, kwargs):
    name = "flash3.attention_varlen" if fn == "flash_attn_varlen_func" else "flash3.attention"
    with pytest.raises(TypeError, match="^" + name.replace(".", r"\.") + r": q\.device is cpu"):
        FA3_CALLS[fn](**kwargs)


def test_flash_attn_interface_learnable_sink_is_keyword_only():
    for fn in (fai.flash_attn_func, fai.flash_attn_varlen_func, fai.flash_attn_qkvpacked_func):
        param = inspect.signature(fn).parameters["learnable_sink"]
        assert param.kind == param.KEYWORD_ONLY and param.default is None


@pytest.mark.parametrize("kwargs, name", [(dict(window_size=(4, 0)), "window_size"), (dict(softcap=5.0), "softcap"),
                                          (dict(learnable_sink=torch.zeros(4)), "learnable_sink")])
def test_flash_attn_interface_fp8_takes_options(kwargs, name):
    """float8 inputs with a window, softcap or sinks pass the option checks (FP8's local
    kernel takes them) and, on CPU tensors, stop at the device check."""
    q, k, v = (t.to(torch.float8_e4m3fn) for t in _qkv())
    with pytest.raises(TypeError, match="q.device is cpu"):
        fai.flash_attn_func(q, k, v, **kwargs)


def test_flash_attn_with_kvcache_takes_windows_and_softcap():
    q, k, v = _qkv()  # CPU tensors: the options pass their checks and reach the device check
    seqlens = torch.full((q.shape[0],), 3, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"q\.device"):
        fai.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, window_size=(4, 0), softcap=5.0)
    assert "window" in fai.flash_attn_with_kvcache.__doc__


def test_flash_attn_func_docstring_window_drawing():
    """The window drawn in flash_attn_func's docstring (4 x 4, window_size (1, 0)) is the
    reference's."""
    doc = fai.flash_attn_func.__doc__
    block = doc[doc.index("window_size = (1, 0)"):]
    rows = re.findall(r"^\s+((?:[01] ){3}[01])\s*$", block, flags=re.M)[:4]
    drawn = torch.tensor([[int(c) for c in r.split()] for r in rows], dtype=torch.bool)
    assert torch.equal(drawn, window_mask(4, 4, (1, 0)))
