"""Tests of flash3.flash_attn_interface, FlashAttention-3's Python interface on flash3.

CPU tests (run everywhere): the signatures against FlashAttention-3's, NotImplementedError
for what flash3 does not run yet (reported before any type or device check), and the
wrapper's own work (return conventions, head-dim padding with its gradients, the
variable-length call) with the kernels replaced by the float64 reference.

The GPU tests are in test_flash_attn_interface_gpu.py.
"""
import inspect

import pytest
import torch

import flash3
from flash3 import flash_attn_interface as fai
from flash3.flash_attn_interface import (
    flash_attn_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    get_scheduler_metadata,
)
from flash3.reference import attention_ref

has_varlen = hasattr(flash3, "attention_varlen")
needs_varlen = pytest.mark.skipif(not has_varlen, reason="flash3.attention_varlen is not in this flash3")


def _qkv(b=2, sq=17, sk=33, h=4, hk=2, d=64, dtype=torch.bfloat16, device="cpu", seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(b, s, n, d, generator=g).to(device=device, dtype=dtype) for s, n in ((sq, h), (sk, hk), (sk, hk))]
    return [t.requires_grad_(requires_grad) for t in ts]


# ----------------------------------------------------------------------------------------
# CPU: signatures
# ----------------------------------------------------------------------------------------

# FlashAttention-3's parameters and defaults (hopper/flash_attn_interface.py).
FA3_SIGNATURES = {
    "flash_attn_func": [
        ("q", None), ("k", None), ("v", None), ("softmax_scale", None), ("causal", False), ("qv", None),
        ("q_descale", None), ("k_descale", None), ("v_descale", None), ("window_size", (-1, -1)),
        ("attention_chunk", 0), ("softcap", 0.0), ("num_splits", 1), ("pack_gqa", None),
        ("deterministic", False), ("sm_margin", 0), ("return_attn_probs", False),
    ],
    "flash_attn_varlen_func": [
        ("q", None), ("k", None), ("v", None), ("cu_seqlens_q", None), ("cu_seqlens_k", None),
        ("max_seqlen_q", None), ("max_seqlen_k", None), ("seqused_q", None), ("seqused_k", None),
        ("softmax_scale", None), ("causal", False), ("qv", None), ("q_descale", None), ("k_descale", None),
        ("v_descale", None), ("window_size", (-1, -1)), ("attention_chunk", 0), ("softcap", 0.0),
        ("num_splits", 1), ("pack_gqa", None), ("deterministic", False), ("sm_margin", 0),
        ("return_attn_probs", False),
    ],
    "flash_attn_qkvpacked_func": [
        ("qkv", None), ("softmax_scale", None), ("causal", False), ("q_descale", None), ("k_descale", None),
        ("v_descale", None), ("window_size", (-1, -1)), ("attention_chunk", 0), ("softcap", 0.0),
        ("deterministic", False), ("num_heads_q", None), ("sm_margin", 0), ("return_attn_probs", False),
    ],
    "flash_attn_combine": [("out_partial", None), ("lse_partial", None), ("out", None), ("out_dtype", None)],
}
REQUIRED = {"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "qkv",
            "out_partial", "lse_partial", "k_cache", "v_cache"}


# Keyword-only additions after FlashAttention-3's parameters: attention sinks, under the
# name FlashAttention uses for them.
EXTRA_KEYWORDS = {"flash_attn_func": ["learnable_sink"], "flash_attn_varlen_func": ["learnable_sink"],
                  "flash_attn_qkvpacked_func": ["learnable_sink"]}


@pytest.mark.parametrize("name", sorted(FA3_SIGNATURES))
def test_signature_matches_flash_attention_3(name):
    params = list(inspect.signature(getattr(fai, name)).parameters.values())
    extra = EXTRA_KEYWORDS.get(name, [])
    if extra:
        assert [p.name for p in params[-len(extra):]] == extra
        assert all(p.kind == p.KEYWORD_ONLY and p.default is None for p in params[-len(extra):])
        params = params[:-len(extra)]
    assert [p.name for p in params] == [n for n, _ in FA3_SIGNATURES[name]]
    for p, (n, default) in zip(params, FA3_SIGNATURES[name]):
        assert p.kind == p.POSITIONAL_OR_KEYWORD, n
        if n in REQUIRED:
            assert p.default is p.empty, n
        else:
            assert p.default == default, n


def test_kvcache_signature_matches_flash_attention_3():
    names = list(inspect.signature(flash_attn_with_kvcache).parameters)
    assert names == [
        "q", "k_cache", "v_cache", "k", "v", "qv", "rotary_cos", "rotary_sin", "cache_seqlens",
        "cache_batch_idx", "cache_leftpad", "page_table", "cu_seqlens_q", "cu_seqlens_k_new", "max_seqlen_q",
        "rotary_seqlens", "q_descale", "k_descale", "v_descale", "softmax_scale", "causal", "window_size",
        "attention_chunk", "softcap", "rotary_interleaved", "scheduler_metadata", "num_splits", "pack_gqa",
        "sm_margin", "return_softmax_lse", "learnable_sink",
    ]
    assert inspect.signature(flash_attn_with_kvcache).parameters["num_splits"].default == 0
    assert inspect.signature(flash_attn_with_kvcache).parameters["rotary_interleaved"].default is True
    assert inspect.signature(flash_attn_with_kvcache).parameters["learnable_sink"].kind == inspect.Parameter.KEYWORD_ONLY


def test_package_exports_the_interface():
    assert flash3.flash_attn_interface is fai
    assert "flash_attn_interface" in flash3.__all__


# ----------------------------------------------------------------------------------------
# CPU: NotImplementedError, before any other check
# ----------------------------------------------------------------------------------------

UNSUPPORTED = [
    (dict(attention_chunk=8), r"attention_chunk=8: chunked attention"),
    (dict(num_splits=3), r"num_splits=3: split-KV"),
    (dict(qv="QV"), r"qv=.*: the extra qv operand"),
]
UNSUPPORTED_IDS = ["chunk", "num_splits", "qv"]


def _resolve(kwargs, q):
    return {key: (torch.zeros_like(q) if val == "QV" else val) for key, val in kwargs.items()}


@pytest.mark.parametrize("kwargs, pattern", UNSUPPORTED, ids=UNSUPPORTED_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float32"])
def test_func_unsupported_arguments_raise_first(kwargs, pattern, dtype):
    # CPU tensors (and float32, which flash3 does not take): the unsupported argument is
    # what gets reported, not the device or the dtype.
    q, k, v = _qkv(dtype=dtype)
    with pytest.raises(NotImplementedError, match=r"^flash_attn_func: " + pattern + ".* not implemented in flash3 yet"):
        flash_attn_func(q, k, v, **_resolve(kwargs, q))


@pytest.mark.parametrize("kwargs, pattern", UNSUPPORTED, ids=UNSUPPORTED_IDS)
def test_varlen_unsupported_arguments_raise_first(kwargs, pattern):
    q, k, v = (t[0] for t in _qkv())
    cu_q = torch.tensor([0, 5, 17], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 33], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=r"^flash_attn_varlen_func: " + pattern):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 20, **_resolve(kwargs, q))


@pytest.mark.parametrize("kwargs, pattern", [u for u in UNSUPPORTED if "qv" not in u[0] and "num_splits" not in u[0]])
def test_qkvpacked_unsupported_arguments_raise_first(kwargs, pattern):
    qkv = torch.randn(2, 33, 3, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"^flash_attn_qkvpacked_func: " + pattern):
        flash_attn_qkvpacked_func(qkv, **kwargs)


def test_different_v_headdim_not_implemented():
    q, k, v = _qkv(d=128)
    with pytest.raises(NotImplementedError, match=r"v\.shape\[-1\]=64: a V head dim different from the Q/K head dim \(128\)"):
        flash_attn_func(q, k, v[..., :64])


def test_fp8_varlen_not_implemented():
    q, k, v = (t[0].to(torch.float8_e4m3fn) for t in _qkv())
    cu = torch.tensor([0, 17], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="FP8 variable-length attention"):
        flash_attn_varlen_func(q, k, v, cu, cu, 17, 17)


def test_kvcache_unsupported_arguments_and_scheduler_metadata():
    q, k, v = _qkv()
    seqlens = torch.full((q.shape[0],), 3, dtype=torch.int32)
    for name in ("cache_batch_idx", "cache_leftpad", "cu_seqlens_k_new", "rotary_seqlens"):
        with pytest.raises(NotImplementedError, match=f"^flash_attn_with_kvcache: {name}="):
            flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, **{name: seqlens})
    with pytest.raises(NotImplementedError, match="^flash_attn_with_kvcache: qv="):
        flash_attn_with_kvcache(q, k, v, qv=q, cache_seqlens=seqlens)
    assert get_scheduler_metadata(2, 1, 128, 4, 2, 64, torch.zeros(2, dtype=torch.int32)) is None


def test_kvcache_argument_errors_name_the_argument():
    q, k, v = _qkv()  # CPU tensors: argument errors come before the device check
    seqlens = torch.full((q.shape[0],), 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_seqlens.shape"):
        flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens[:1])
    with pytest.raises(TypeError, match="page_table.dtype"):
        flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, page_table=torch.zeros(q.shape[0], 2))
    with pytest.raises(TypeError, match="the device of q|CUDA"):
        flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens)


@pytest.mark.parametrize("kwargs", [
    dict(), dict(window_size=(-1, -1)), dict(window_size=[-1, 0]), dict(causal=True, window_size=(-1, 0)),
    dict(window_size=(32, 16)), dict(window_size=(100, 100)), dict(causal=True, window_size=(-1, 7)),
    dict(num_splits=0), dict(pack_gqa=True), dict(sm_margin=8), dict(softcap=0), dict(attention_chunk=0),
    dict(window_size=(4, 4)), dict(window_size=torch.tensor([3, 0])), dict(causal=True, window_size=(8, 0)),
    dict(softcap=30.0), dict(learnable_sink=torch.zeros(4)),
], ids=["default", "no-window", "causal-window", "causal+window", "window-covers-all", "window-beyond", "causal-right",
        "num_splits0", "pack_gqa", "sm_margin", "softcap0", "chunk0", "window44", "window-tensor", "causal-window8",
        "softcap30", "sinks"])
def test_supported_arguments_reach_the_device_check(kwargs):
    # (32, 16) covers the whole 17 x 33 score matrix: no window, as in FlashAttention-3.
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"flash3\.attention: q\.device is cpu"):
        flash_attn_func(q, k, v, **kwargs)


# ----------------------------------------------------------------------------------------
# CPU: the wrapper's work, with the kernels replaced by the float64 reference
# ----------------------------------------------------------------------------------------


def _reference_attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, deterministic=False,
                         window_size=(-1, -1), softcap=0.0, sinks=None):
    """flash3.attention's contract on CPU: only built head dims, output in q's dtype."""
    assert q.shape[-1] in flash3.SUPPORTED_HEADDIMS, q.shape
    out, lse = attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale, upcast=True,
                             window_size=window_size, softcap=softcap, sinks=sinks)
    out = out.to(q.dtype).contiguous()
    return (out, lse) if return_lse else out


def _reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqused_q=None,
                      seqused_k=None, causal=False, softmax_scale=None, return_lse=False, deterministic=False,
                      validate=False, window_size=(-1, -1), softcap=0.0, sinks=None):
    assert q.shape[-1] in flash3.SUPPORTED_HEADDIMS, q.shape
    assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
    for i in range(cu_seqlens_q.numel() - 1):
        q0, q1 = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        k0, k1 = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        if seqused_q is not None:
            q1 = q0 + int(seqused_q[i])
        if seqused_k is not None:
            k1 = k0 + int(seqused_k[i])
        o, l = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=causal,
                             softmax_scale=softmax_scale, upcast=True, window_size=window_size, softcap=softcap,
                             sinks=sinks)
        out[q0:q1] = o[0].to(q.dtype)
        lse[:, q0:q1] = l[0]
    return (out, lse) if return_lse else out


@pytest.fixture
def cpu_kernels(monkeypatch):
    monkeypatch.setattr(fai, "_attention", _reference_attention)
    monkeypatch.setattr(fai, "_attention_varlen", _reference_varlen)


@pytest.mark.parametrize("d", [64, 80, 112, 160, 40, 248])
@pytest.mark.parametrize("causal", [False, True])
def test_func_return_conventions_and_headdim_padding_cpu(cpu_kernels, d, causal):
    q, k, v = _qkv(d=d, dtype=torch.float64, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=causal)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.is_contiguous()
    out2, lse = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal)  # scale 1/sqrt(d) of the unpadded head dim
    assert lse.shape == (2, 4, 17) and lse.dtype == torch.float32
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out2, out_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-6, atol=1e-6)
    # gradients flow back through the zero padding, shaped like the inputs
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out * dout).sum() + lse.sum(), (q, k, v))
    grads_ref = torch.autograd.grad((out_ref * dout).sum() + lse_ref.sum(), (q, k, v))
    for g, g_ref in zip(grads, grads_ref):
        assert g.shape == g_ref.shape
        torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-6)


def test_custom_softmax_scale_is_kept_with_padding_cpu(cpu_kernels):
    q, k, v = _qkv(d=80, dtype=torch.float64)
    out = flash_attn_func(q, k, v, softmax_scale=0.3)
    torch.testing.assert_close(out, attention_ref(q, k, v, softmax_scale=0.3)[0])


@pytest.mark.parametrize("d", [64, 80])
def test_window_softcap_sinks_reach_attention_cpu(cpu_kernels, d):
    """window_size, softcap and learnable_sink arrive at flash3.attention as its
    window_size, softcap and sinks (FlashAttention-3's window normalisation first), head
    dim padding included."""
    q, k, v = _qkv(d=d, dtype=torch.float64)
    sinks = torch.randn(4, dtype=torch.float64)
    out, lse = flash_attn_func(q, k, v, causal=True, window_size=(5, 3), softcap=7.0, learnable_sink=sinks,
                               return_attn_probs=True)
    out_ref, lse_ref = attention_ref(q, k, v, causal=True, window_size=(5, 0), softcap=7.0, sinks=sinks)
    torch.testing.assert_close(out, out_ref.to(q.dtype))
    torch.testing.assert_close(lse, lse_ref)
    qkv = torch.stack([q, q, q], dim=2)
    out = flash_attn_qkvpacked_func(qkv, window_size=(2, 1), softcap=3.0)
    torch.testing.assert_close(out, attention_ref(q, q, q, window_size=(2, 1), softcap=3.0)[0].to(q.dtype))
    qv, kv, vv = (t[0] for t in (q, k, v))
    cu_q = torch.tensor([0, 17], dtype=torch.int32)
    cu_k = torch.tensor([0, 33], dtype=torch.int32)
    out = flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 17, 33, window_size=(4, 2), learnable_sink=sinks)
    ref = attention_ref(q[:1], k[:1], v[:1], window_size=(4, 2), sinks=sinks)[0][0]
    torch.testing.assert_close(out, ref.to(q.dtype))


def test_fp8_window_softcap_and_sinks_reach_flash3_fp8(monkeypatch):
    """float8 inputs pass the window, softcap and learnable_sink on to flash3.fp8.attention_fp8
    under flash3's names."""
    q, k, v = (t.to(torch.float8_e4m3fn) for t in _qkv())
    seen = {}

    def fake_attention_fp8(q8, k8, v8, *descales, **kwargs):
        seen.update(kwargs)
        return torch.zeros(q8.shape, dtype=torch.bfloat16), torch.zeros(q8.shape[0], q8.shape[2], q8.shape[1])

    monkeypatch.setattr(flash3.fp8, "attention_fp8", fake_attention_fp8)
    sinks = torch.zeros(q.shape[2])
    flash_attn_func(q, k, v, window_size=(4, 0), softcap=5.0, learnable_sink=sinks)
    assert seen["window_size"] == (4, 0) and seen["softcap"] == 5.0 and seen["sinks"] is sinks


def test_window_minus_one_zero_is_causal_cpu(cpu_kernels):
    q, k, v = _qkv(dtype=torch.float64)
    causal = flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(flash_attn_func(q, k, v, window_size=(-1, 0)), causal, rtol=0, atol=0)
    torch.testing.assert_close(flash_attn_func(q, k, v, window_size=(32, 16)), flash_attn_func(q, k, v), rtol=0, atol=0)


@pytest.mark.parametrize("packed", ["5d", "4d-gqa"])
def test_qkvpacked_cpu(cpu_kernels, packed):
    g = torch.Generator().manual_seed(1)
    if packed == "5d":
        qkv = torch.randn(2, 19, 3, 4, 80, generator=g, dtype=torch.float64, requires_grad=True)
        q, k, v = qkv.unbind(2)
        out = flash_attn_qkvpacked_func(qkv, causal=True)
    else:
        qkv = torch.randn(2, 19, 4 + 2 * 2, 64, generator=g, dtype=torch.float64, requires_grad=True)
        q, k, v = qkv.split([4, 2, 2], dim=2)
        out = flash_attn_qkvpacked_func(qkv, causal=True, num_heads_q=4)
    out_ref, _ = attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(out, out_ref)
    (dqkv,) = torch.autograd.grad(out.sum(), qkv)
    (dqkv_ref,) = torch.autograd.grad(out_ref.sum(), qkv)
    assert dqkv.shape == qkv.shape
    torch.testing.assert_close(dqkv, dqkv_ref)


def _random_cu_seqlens(g, batch, max_len, min_len=0):
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=g)
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32), int(lengths.max())


@pytest.mark.parametrize("d", [64, 112])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_calls_attention_varlen_cpu(cpu_kernels, d, causal):
    g = torch.Generator().manual_seed(d + causal)
    cu_q, max_q = _random_cu_seqlens(g, 3, 20, 1)
    cu_k, max_k = _random_cu_seqlens(g, 3, 30, 1)
    q = torch.randn(int(cu_q[-1]), 4, d, generator=g, dtype=torch.float64)
    k = torch.randn(int(cu_k[-1]), 2, d, generator=g, dtype=torch.float64)
    v = torch.randn(int(cu_k[-1]), 2, d, generator=g, dtype=torch.float64)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    out2, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, None, None, causal=causal, return_attn_probs=True)
    assert lse.shape == (4, q.shape[0])
    for i in range(3):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        o_ref, l_ref = attention_ref(q[None, qs], k[None, ks], v[None, ks], causal=causal)
        torch.testing.assert_close(out[qs], o_ref[0])
        torch.testing.assert_close(out2[qs], o_ref[0])
        torch.testing.assert_close(lse[:, qs], l_ref[0])


def test_causal_must_be_bool():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"flash_attn_func: causal is str; supported: bool"):
        flash_attn_func(q, k, v, causal="yes")
