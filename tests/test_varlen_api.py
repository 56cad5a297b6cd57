"""Argument checks of flash3.attention_varlen and of the length validation (CPU)."""
import pytest
import torch

import flash3
from flash3.varlen import validate_seqlens


def _args(**over):
    q = torch.randn(10, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(12, 2, 64, dtype=torch.bfloat16)
    args = dict(q=q, k=k, v=k.clone(), cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 5, 12], dtype=torch.int32), max_seqlen_q=6, max_seqlen_k=7)
    args.update(over)
    return args


def _call(**over):
    a = _args(**over)
    extra = {n: a.pop(n) for n in list(a) if n not in
             ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")}
    return flash3.attention_varlen(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                                   a["max_seqlen_q"], a["max_seqlen_k"], **extra)


@pytest.mark.parametrize("over, exc, words", [
    (dict(cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int64)), TypeError, "cu_seqlens_q.dtype"),
    (dict(cu_seqlens_k=[0, 5, 12]), TypeError, "cu_seqlens_k is list"),
    (dict(cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32)), ValueError, "cu_seqlens_k.shape[0]"),
    (dict(cu_seqlens_q=torch.zeros(2, 2, dtype=torch.int32)), ValueError, "cu_seqlens_q.dim()"),
    (dict(seqused_q=torch.tensor([1, 2, 3], dtype=torch.int32)), ValueError, "seqused_q.shape[0]"),
    (dict(seqused_k=torch.tensor([1.0, 2.0])), TypeError, "seqused_k.dtype"),
    (dict(max_seqlen_q=6.0), TypeError, "max_seqlen_q is float"),
    (dict(max_seqlen_k=True), TypeError, "max_seqlen_k is bool"),
    (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k is -1"),
    (dict(q=torch.randn(2, 10, 4, 64, dtype=torch.bfloat16)), ValueError, "q.dim()"),
    (dict(q=torch.randn(10, 4, 64)), TypeError, "q.dtype"),
    (dict(q=torch.randn(10, 3, 64, dtype=torch.bfloat16)), ValueError, "nheads_k"),
    (dict(causal=1), TypeError, "causal"),
    (dict(), TypeError, "q.device"),  # valid arguments on the CPU: the device is what is wrong
])
def test_argument_errors(over, exc, words):
    with pytest.raises(exc, match=None) as info:
        _call(**over)
    assert words in str(info.value), str(info.value)
    assert str(info.value).startswith("flash3.attention_varlen:")


def test_arguments_after_max_seqlen_are_keyword_only():
    a = _args()
    with pytest.raises(TypeError):
        flash3.attention_varlen(*a.values(), None)


@pytest.mark.parametrize("cu_q, used_q, max_q, words", [
    ([1, 4, 10], None, 6, "cu_seqlens_q[0]"),
    ([0, 6, 4, 10], None, 6, "non-decreasing"),
    ([0, 4, 9], None, 6, "cu_seqlens_q[-1]"),
    ([0, 4, 10], None, 5, "max_seqlen_q"),
    ([0, 4, 10], [5, 1], 6, "seqused_q[0]"),
])
def test_validate_seqlens(cu_q, used_q, max_q, words):
    cu_q = torch.tensor(cu_q, dtype=torch.int32)
    cu_k = torch.zeros(cu_q.shape[0], dtype=torch.int32)
    used = None if used_q is None else torch.tensor(used_q, dtype=torch.int32)
    with pytest.raises(ValueError) as info:
        validate_seqlens(10, 0, cu_q, cu_k, max_q, 0, seqused_q=used)
    assert words in str(info.value), str(info.value)


def test_validate_seqlens_accepts_valid():
    cu = torch.tensor([0, 0, 3, 10], dtype=torch.int32)
    validate_seqlens(10, 10, cu, cu, 7, 7, seqused_q=torch.tensor([0, 2, 7], dtype=torch.int32))


def _meta_varlen():
    q = torch.empty(10, 4, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(12, 2, 64, dtype=torch.bfloat16, device="meta")
    cu_q = torch.empty(3, dtype=torch.int32, device="meta")
    cu_k = torch.empty(3, dtype=torch.int32, device="meta")
    return q, k, k.clone(), cu_q, cu_k


@pytest.mark.skipif(not hasattr(torch.ops.flash3, "fwd_varlen"), reason="the compiled extension is not loaded")
def test_varlen_fake_impls_on_meta():
    q, k, v, cu_q, cu_k = _meta_varlen()
    out, lse = torch.ops.flash3.fwd_varlen(q, k, v, cu_q, cu_k, None, None, 6, 7, 0.125, True, False)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (4, 10) and lse.dtype == torch.float32
    torch.library.opcheck(torch.ops.flash3.fwd_varlen.default,
                          (q, k, v, cu_q, cu_k, None, None, 6, 7, 0.125, True, False),
                          test_utils=("test_schema", "test_faketensor"))
    dq, dk, dv, dsinks = torch.ops.flash3.bwd_varlen(out, q, k, v, out, lse, None, cu_q, cu_k, None, None, 6, 7, 0.125,
                                             True, False)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
