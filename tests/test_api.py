"""CPU tests of the Python API: argument validation, build information, the fake (meta)
registration of the op. They run everywhere, CI included."""
import re

import pytest
import torch

import flash3
from flash3 import interface


def _qkv(b=2, sq=17, sk=33, h=4, hk=2, d=64, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(b, sk, hk, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(b, sk, hk, d, generator=g).to(device=device, dtype=dtype)
    return q, k, v


def test_import_and_version():
    assert isinstance(flash3.__version__, str)
    assert callable(flash3.attention)
    assert flash3.SUPPORTED_HEADDIMS == (64, 96, 128, 192, 256)


def test_build_info_lists_kernels():
    info = flash3.build_info()
    assert isinstance(info["kernels"], list)
    if interface._C is None:
        pytest.skip(f"extension not built: {info['error']}")
    assert info["arch"] == "sm_90a"
    assert len(info["kernels"]) > 0
    for k in info["kernels"]:
        assert k["kind"] in ("fwd", "bwd")
        assert k["dtype"] in ("bf16", "fp16")
        assert k["hdim"] in flash3.SUPPORTED_HEADDIMS
        assert k["hdim_v"] == k["hdim"] or (k["hdim"], k["hdim_v"]) in flash3.SUPPORTED_HEADDIM_PAIRS
        assert isinstance(k["causal"], bool)
        assert flash3.is_supported(k["kind"], k["dtype"], k["hdim"], k["causal"], mask=k["mask"], hdim_v=k["hdim_v"])
    assert not flash3.is_supported("fwd", "bf16", 80, False)
    assert not flash3.is_supported("bwd", "bf16", 80, False)


def test_cpu_tensors_raise_type_error_naming_device():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"q\.device is cpu; supported: CUDA tensors on a Hopper GPU"):
        flash3.attention(q, k, v)


@pytest.mark.parametrize(
    "mutate, exc, pattern",
    [
        (lambda q, k, v: (q.float(), k.float(), v.float()), TypeError, r"q\.dtype is torch\.float32; supported: torch\.bfloat16, torch\.float16"),
        (lambda q, k, v: (q, k.half(), v), TypeError, r"k\.dtype is torch\.float16; supported: the dtype of q"),
        (lambda q, k, v: (q[0], k, v), ValueError, r"q\.dim\(\) is 3; supported: 4"),
        (lambda q, k, v: (q, k, v[:, :5]), ValueError, r"v\.shape is .*; supported: the shape of k .* but for the head dim"),
        (lambda q, k, v: (q, k, v[..., :32]), ValueError,
         r"v\.shape\[3\] \(headdim_v\) is 32; supported: the headdim of q \(64\), or .*: 192 with 128"),
        (lambda q, k, v: (q, k[:1], v[:1]), ValueError, r"k\.shape\[0\] \(batch\) is 1; supported: the batch of q \(2\)"),
        (lambda q, k, v: (q[..., :48], k[..., :48], v[..., :48]), ValueError, r"headdim is 48; supported: 64, 96, 128, 192, 256"),
        (lambda q, k, v: (q[:, :, :3], k, v), ValueError, r"nheads_k is 2; supported: a divisor of nheads \(3\)"),
        (lambda q, k, v: ("q", k, v), TypeError, r"q is str; supported: a torch\.Tensor"),
    ],
    ids=["float32", "mixed-dtype", "rank3", "kv-shape", "v-headdim", "batch", "headdim48", "gqa-divisor",
         "not-a-tensor"],
)
def test_validation_messages(mutate, exc, pattern):
    q, k, v = mutate(*_qkv())
    with pytest.raises(exc, match=pattern):
        flash3.attention(q, k, v)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_softmax_scale_must_be_positive(scale):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"softmax_scale is .*; supported: a positive finite float"):
        flash3.attention(q, k, v, softmax_scale=scale)


def test_causal_must_be_bool():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"causal is str; supported: bool"):
        flash3.attention(q, k, v, causal="yes")


def test_arguments_after_the_tensors_are_keyword_only():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="positional"):
        flash3.attention(q, k, v, True)


def test_docstring_mask_matches_reference():
    """The drawn masks in attention()'s docstring are the reference's: causal for
    seqlen_q = 3, seqlen_k = 5, then the window (2, 0) for 5 x 5."""
    doc = flash3.attention.__doc__
    rows = re.findall(r"^\s+((?:[01] ){4}[01])\s*$", doc, flags=re.M)
    drawn = torch.tensor([[int(c) for c in r.split()] for r in rows], dtype=torch.bool)
    assert drawn.shape == (8, 5)
    assert torch.equal(drawn[:3], flash3.reference.causal_mask(3, 5))
    assert torch.equal(drawn[3:], flash3.reference.window_mask(5, 5, (2, 0)))


needs_ext = pytest.mark.skipif(interface._C is None, reason="extension not built")


@needs_ext
@pytest.mark.parametrize("causal", [False, True])
def test_fake_impl_shapes_on_meta(causal):
    q, k, v = _qkv(device="meta")
    out, lse = torch.ops.flash3.fwd(q, k, v, 0.125, causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32


@needs_ext
def test_op_schema_and_fake_registration():
    op = torch.ops.flash3.fwd.default
    assert "softmax_scale" in str(op._schema)
    q, k, v = _qkv(device="meta")
    torch.library.opcheck(op, (q, k, v, 0.125, False), test_utils=("test_schema", "test_faketensor"))
