"""flash3.attention_with_kvcache's argument checks (CPU: every error names its argument
before any device is needed)."""
import pytest
import torch

import flash3

B, SQ, H, HK, D, S = 2, 1, 8, 2, 64, 40


def _args(**over):
    g = torch.Generator().manual_seed(0)
    args = dict(
        q=torch.randn(B, SQ, H, D, generator=g).bfloat16(),
        k_cache=torch.randn(B, S, HK, D, generator=g).bfloat16(),
        v_cache=torch.randn(B, S, HK, D, generator=g).bfloat16(),
        cache_seqlens=torch.tensor([3, 17], dtype=torch.int32),
    )
    args.update(over)
    return args


def _call(**over):
    a = _args(**over)
    return flash3.attention_with_kvcache(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), **a)


def _paged(page_size=8, pages=12):
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(pages, page_size, HK, D, generator=g).bfloat16()
    table = torch.arange(B * 5, dtype=torch.int32).view(B, 5)
    return dict(k_cache=cache, v_cache=cache.clone(), page_table=table)


@pytest.mark.parametrize("over, exc, name", [
    (dict(q=torch.randn(B, H, D).bfloat16()), ValueError, "q.dim()"),
    (dict(q=torch.randn(B, SQ, H, D)), TypeError, "q.dtype"),
    (dict(k_cache=torch.randn(B, S, HK, D)), TypeError, "k_cache.dtype"),
    (dict(v_cache=torch.randn(B, S + 1, HK, D).bfloat16()), ValueError, "v_cache.shape"),
    (dict(k_cache=torch.randn(B, S, 3, D).bfloat16(), v_cache=torch.randn(B, S, 3, D).bfloat16()), ValueError,
     "k_cache.shape[2]"),
    (dict(k_cache=torch.randn(B + 1, S, HK, D).bfloat16(), v_cache=torch.randn(B + 1, S, HK, D).bfloat16()),
     ValueError, "k_cache.shape[0]"),
    (dict(cache_seqlens=None), TypeError, "cache_seqlens"),
    (dict(cache_seqlens=S + 1), ValueError, "cache_seqlens"),
    (dict(cache_seqlens=torch.tensor([1, 2])), TypeError, "cache_seqlens.dtype"),
    (dict(cache_seqlens=torch.tensor([1], dtype=torch.int32)), ValueError, "cache_seqlens.shape[0]"),
    (dict(k=torch.randn(B, 1, HK, D).bfloat16()), ValueError, "v"),
    (dict(k=torch.randn(B, 1, H, D).bfloat16(), v=torch.randn(B, 1, H, D).bfloat16()), ValueError, "k.shape"),
    (dict(k=torch.randn(B, S + 1, HK, D).bfloat16(), v=torch.randn(B, S + 1, HK, D).bfloat16()), ValueError,
     "k.shape[1]"),
    (dict(rotary_cos=torch.randn(S, 16)), ValueError, "rotary_sin"),
    (dict(rotary_cos=torch.randn(S, 16), rotary_sin=torch.randn(S, 16)), ValueError, "rotary_cos"),
    (dict(k=torch.randn(B, 1, HK, D).bfloat16(), v=torch.randn(B, 1, HK, D).bfloat16(),
          rotary_cos=torch.randn(S, D), rotary_sin=torch.randn(S, D)), ValueError, "rotary_cos.shape[1]"),
    (dict(num_splits=-1), ValueError, "num_splits"),
    (dict(split_size=0), ValueError, "split_size"),
    (dict(split_size=64, num_splits=4), ValueError, "num_splits"),
    (dict(window_size=(-2, 0)), ValueError, "window_size[0]"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(sinks=torch.zeros(HK)), ValueError, "sinks.shape"),
    (dict(max_seqlen_q=1), ValueError, "max_seqlen_q"),
    (dict(page_table=torch.zeros(B, 3)), TypeError, "page_table.dtype"),
    (dict(page_table=torch.zeros(B + 1, 3, dtype=torch.int32)), ValueError, "page_table.shape[0]"),
    (dict(q=torch.randn(3, H, D).bfloat16(), cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32)), TypeError,
     "max_seqlen_q"),
    (dict(q=torch.randn(3, H, D).bfloat16(), cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32),
          max_seqlen_q=2, k=torch.randn(B, 1, HK, D).bfloat16(), v=torch.randn(B, 1, HK, D).bfloat16()),
     ValueError, "k is"),
])
def test_errors_name_the_argument(over, exc, name):
    with pytest.raises(exc, match=r"^flash3\.attention_with_kvcache: " + __import__("re").escape(name)):
        _call(**over)


def test_paged_cache_shapes_pass_to_the_device_check():
    # Valid paged arguments get as far as the device check (CPU tensors).
    with pytest.raises(TypeError, match=r"q\.device"):
        _call(**_paged())


def test_valid_dense_arguments_reach_the_device_check():
    with pytest.raises(TypeError, match=r"q\.device"):
        _call(k=torch.randn(B, 2, HK, D).bfloat16(), v=torch.randn(B, 2, HK, D).bfloat16(),
              rotary_cos=torch.randn(S + 2, 16), rotary_sin=torch.randn(S + 2, 16), window_size=(8, 0),
              softcap=3.0, sinks=torch.zeros(H), split_size=16)
