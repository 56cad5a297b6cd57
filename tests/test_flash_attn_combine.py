"""flash3.flash_attn_interface.flash_attn_combine: split-KV partial results merged into the
attention over all keys, against the float64 reference on the whole key range."""
import pytest
import torch

from flash3.flash_attn_interface import flash_attn_combine
from flash3.reference import attention_ref


def _splits(q, k, v, bounds):
    """Per key range [a, b): the reference's output and lse, in FlashAttention-3's partial
    layouts (num_splits, batch, seqlen, nheads, d) and (num_splits, batch, seqlen, nheads)."""
    outs, lses = [], []
    for a, b in bounds:
        o, lse = attention_ref(q, k[:, a:b], v[:, a:b], upcast=True)
        outs.append(o.float())
        lses.append(lse.float().transpose(1, 2))
    return torch.stack(outs), torch.stack(lses)


def _inputs(seed, b=2, sq=9, sk=70, h=3, d=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, h, d, generator=g, dtype=torch.float64) for n in (sq, sk, sk)]


@pytest.mark.parametrize("bounds", [[(0, 70)], [(0, 30), (30, 70)], [(0, 1), (1, 2), (2, 69), (69, 70)],
                                    [(0, 35), (35, 35), (35, 70)]])
def test_combine_matches_attention_over_all_keys(seed, bounds):
    q, k, v = _inputs(seed)
    out_partial, lse_partial = _splits(q, k, v, bounds)
    out, lse = flash_attn_combine(out_partial, lse_partial)
    out_ref, lse_ref = attention_ref(q, k, v, upcast=True)
    assert out.dtype == torch.float32 and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (2, 9, 3)
    torch.testing.assert_close(out.double(), out_ref, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lse.double(), lse_ref.double().transpose(1, 2), atol=2e-6, rtol=2e-6)


def test_combine_rows_without_keys(seed):
    """Causal with seqlen_q > seqlen_k: the first rows see no key in any split (0, -inf);
    later rows see keys in some splits only."""
    q, k, v = _inputs(seed, sq=12, sk=8)
    bounds = [(0, 3), (3, 8)]
    # Each split keeps the whole sequence's causal alignment: row i sees key j iff
    # j <= i + sk - sq, so rows 0..3 see nothing.
    out_partial, lse_partial = [], []
    for a, b in bounds:
        mask_rows = torch.arange(12)[:, None] + 8 - 12 >= torch.arange(a, b)[None, :]
        s = torch.einsum("bqhd,bkhd->bhqk", q, k[:, a:b]) / 4.0
        s = s.masked_fill(~mask_rows, float("-inf"))
        lse_s = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse_s[..., None]).nan_to_num(0.0)
        out_partial.append(torch.einsum("bhqk,bkhd->bqhd", p, v[:, a:b]).float())
        lse_partial.append(lse_s.float().transpose(1, 2))
    out, lse = flash_attn_combine(torch.stack(out_partial), torch.stack(lse_partial))
    out_ref, lse_ref = attention_ref(q, k, v, causal=True, softmax_scale=0.25, upcast=True)
    assert not torch.isnan(out).any()
    assert (out[:, :4] == 0).all() and (lse[:, :4] == float("-inf")).all()
    torch.testing.assert_close(out.double(), out_ref, atol=2e-6, rtol=2e-6)
    finite = torch.isfinite(lse_ref.transpose(1, 2))
    torch.testing.assert_close(lse.double()[finite], lse_ref.double().transpose(1, 2)[finite], atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_combine_out_dtype_and_out(seed, out_dtype):
    q, k, v = _inputs(seed)
    out_partial, lse_partial = _splits(q, k, v, [(0, 20), (20, 70)])
    out, _ = flash_attn_combine(out_partial, lse_partial, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    buffer = torch.full(q.shape, float("nan"), dtype=out_dtype)
    written, _ = flash_attn_combine(out_partial, lse_partial, out=buffer)
    assert written is buffer and torch.equal(buffer, out)
    out_ref, _ = attention_ref(q, k, v, upcast=True)
    torch.testing.assert_close(out.double(), out_ref, atol=2e-2, rtol=2e-2)


def test_combine_argument_errors():
    out_partial = torch.randn(2, 1, 4, 3, 16)
    lse_partial = torch.randn(2, 1, 4, 3)
    with pytest.raises(TypeError, match="out_partial.dtype"):
        flash_attn_combine(out_partial.half(), lse_partial)
    with pytest.raises(TypeError, match="lse_partial.dtype"):
        flash_attn_combine(out_partial, lse_partial.double())
    with pytest.raises(ValueError, match="out_partial.dim"):
        flash_attn_combine(out_partial[0], lse_partial)
    with pytest.raises(ValueError, match="lse_partial.shape"):
        flash_attn_combine(out_partial, lse_partial[:, :, :3])
    with pytest.raises(TypeError, match="out_dtype"):
        flash_attn_combine(out_partial, lse_partial, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="out must be"):
        flash_attn_combine(out_partial, lse_partial, out=torch.empty(1, 4, 3, 8))


@pytest.mark.gpu
def test_combine_of_flash3_splits_on_gpu(seed):
    """Split-KV from flash3's own pieces: flash3.attention over each key range with its lse,
    combined, against flash3.attention over all keys (bf16 rounding of the partial outputs)."""
    import flash3

    if not flash3.is_supported("fwd", "bf16", 128, False):
        pytest.skip("fwd bf16 hdim128 non-causal not in this build")
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(2, n, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g) for n in (64, 3000, 3000))
    outs, lses = [], []
    for a, b in [(0, 1000), (1000, 2100), (2100, 3000)]:
        o, lse = flash3.attention(q, k[:, a:b], v[:, a:b], return_lse=True)
        outs.append(o.float())
        lses.append(lse.transpose(1, 2))
    out, lse = flash_attn_combine(torch.stack(outs), torch.stack(lses), out_dtype=torch.bfloat16)
    out_all, lse_all = flash3.attention(q, k, v, return_lse=True)
    torch.testing.assert_close(lse, lse_all.transpose(1, 2), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.float(), out_all.float(), atol=2e-2, rtol=2e-2)
