"""torch.compile(fullgraph=True) traces every public entry point without a graph break,
checked without a GPU: the inputs are fake CUDA tensors (FakeTensorMode), the ops run
their fake kernels, and the captured graph runs on fake tensors too (backend "eager").
Needs the compiled extension (the ops' schemas); the GPU tests run the same calls for real
(test_compile_entry_points_gpu.py and the compile tests of each family)."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flash3
from flash3 import interface
from flash3.flash_attn_interface import (
    flash_attn_combine,
    flash_attn_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)

DT = torch.bfloat16
D = 128

pytestmark = pytest.mark.skipif(interface._C is None, reason="extension not built")


@pytest.fixture(autouse=True)
def hopper(monkeypatch):
    """A Hopper device as far as the Python checks can tell, with hdim 128 bf16 built."""
    if not all(flash3.is_supported("fwd", DT, D, False, mask=m) for m in ("none", "causal", "local")):
        pytest.skip("bf16 hdim 128 forward kernels not in this build")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *args, **kwargs: _Props())
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _Props:
    multi_processor_count = 132
    major, minor = 9, 0


def _randn(*shape, dtype=DT):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _dense():
    q, k, v = _randn(2, 300, 8, D), _randn(2, 300, 2, D), _randn(2, 300, 2, D)
    sinks = _randn(8, dtype=torch.float32)
    return [
        ("attention", lambda q, k, v: flash3.attention(q, k, v, causal=True, return_lse=True), (q, k, v)),
        ("attention window softcap sinks",
         lambda q, k, v, s: flash3.attention(q, k, v, causal=True, window_size=(63, 0), softcap=20.0, sinks=s),
         (q, k, v, sinks)),
        ("flash_attn_func", lambda q, k, v: flash_attn_func(q, k, v, causal=True, return_attn_probs=True), (q, k, v)),
        ("flash_attn_qkvpacked_func", lambda qkv: flash_attn_qkvpacked_func(qkv, causal=True),
         (_randn(2, 300, 3, 8, D),)),
    ]


def _varlen():
    cu = torch.tensor([0, 7, 300, 301], dtype=torch.int32, device="cuda")
    q, k, v = _randn(301, 8, D), _randn(301, 2, D), _randn(301, 2, D)
    return [
        ("attention_varlen", lambda q, k, v, cu: flash3.attention_varlen(q, k, v, cu, cu, 293, 293, causal=True),
         (q, k, v, cu)),
        ("flash_attn_varlen_func", lambda q, k, v, cu: flash_attn_varlen_func(q, k, v, cu, cu, 293, 293, causal=True),
         (q, k, v, cu)),
    ]


def _kvcache():
    cases = []
    seqlens = torch.tensor([1000, 1, 333], dtype=torch.int32, device="cuda")
    for page in (None, 16, 128):
        if page is None:
            kc, vc, table = _randn(3, 1024, 2, D), _randn(3, 1024, 2, D), None
        else:
            kc, vc = _randn(3 * 1024 // page, page, 2, D), _randn(3 * 1024 // page, page, 2, D)
            table = torch.arange(3 * 1024 // page, device="cuda", dtype=torch.int32).view(3, -1)
        for sq in (1, 4):
            q = _randn(3, sq, 8, D)
            cases.append((f"attention_with_kvcache page={page} sq={sq}",
                          lambda q, kc, vc, s, t: flash3.attention_with_kvcache(
                              q, kc, vc, cache_seqlens=s, page_table=t, causal=True, return_lse=True),
                          (q, kc, vc, seqlens, table)))
            cases.append((f"flash_attn_with_kvcache page={page} sq={sq}",
                          lambda q, kc, vc, s, t: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=s, page_table=t,
                                                                          causal=True),
                          (q, kc, vc, seqlens, table)))
    kc, vc = _randn(2, 512, 2, D), _randn(2, 512, 2, D)
    q, k, v = _randn(2, 1, 8, D), _randn(2, 1, 2, D), _randn(2, 1, 2, D)
    cases.append(("attention_with_kvcache append",
                  lambda q, kc, vc, k, v, s: flash3.attention_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=s,
                                                                          causal=True),
                  (q, kc, vc, k, v, torch.tensor([100, 300], dtype=torch.int32, device="cuda"))))
    return cases


def _combine():
    return [("flash_attn_combine", lambda o, l: flash_attn_combine(o, l),
             (_randn(4, 2, 300, 8, D, dtype=torch.float32), _randn(4, 2, 300, 8, dtype=torch.float32)))]


def _hdim_v():
    """q and k of head dim 192, v of 128: the output has v's head dim."""
    if not all(flash3.is_supported(kind, DT, 192, True, hdim_v=128) for kind in ("fwd", "bwd")):
        pytest.skip("bf16 (192, 128) kernels not in this build")
    cu = torch.tensor([0, 7, 300, 301], dtype=torch.int32, device="cuda")

    def dense(q, k, v):
        out = flash3.attention(q, k, v, causal=True)
        assert out.shape == (*q.shape[:-1], 128)
        return out

    return [
        ("attention (192, 128)", dense, (_randn(2, 300, 8, 192), _randn(2, 300, 2, 192), _randn(2, 300, 2, 128))),
        ("flash_attn_varlen_func (192, 128)",
         lambda q, k, v, cu: flash_attn_varlen_func(q, k, v, cu, cu, 293, 293, causal=True),
         (_randn(301, 8, 192), _randn(301, 2, 192), _randn(301, 2, 128), cu)),
    ]


FAMILIES = {"dense": _dense, "varlen": _varlen, "kvcache": _kvcache, "combine": _combine, "hdim_v": _hdim_v}


@pytest.mark.parametrize("family", FAMILIES)
def test_fullgraph_trace(family):
    with FakeTensorMode():
        for name, fn, args in FAMILIES[family]():
            torch._dynamo.reset()
            try:
                torch.compile(fn, fullgraph=True, backend="eager")(*args)
            except Exception as exc:  # noqa: BLE001 (report which entry point broke the graph)
                pytest.fail(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
