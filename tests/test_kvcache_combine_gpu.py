"""GPU tests of the split-KV merge (torch.ops.flash3.kvcache_combine, csrc/kvcache.cu)
against a float64 reference, on both of its kernels: a warp per row (at most 8 splits) and
a CTA per row (more). Partial results are random, some splits saw no key (lse -inf, as the
forward kernels write them) and some rows none at all; sinks join the denominator."""
import pytest
import torch

import flash3  # noqa: F401  (loads the extension)

pytestmark = pytest.mark.gpu


def _reference(out_partial, lse_partial, sinks, group):
    """out (batch, seqlen_q, nheads, d) and lse (batch, nheads, seqlen_q), in float64."""
    batch, splits, rows, nheads_k, d = out_partial.shape
    lse = lse_partial.double().permute(1, 2, 3, 0)  # (batch, splits, rows, nheads_k)
    terms = lse
    if sinks is not None:  # row r of K/V head kvh is query head kvh * group + r % group
        sink = sinks.double().view(nheads_k, group).t().repeat(rows // group, 1)
        terms = torch.cat((lse, sink.expand(batch, 1, rows, nheads_k)), dim=1)
    total = torch.logsumexp(terms, dim=1)  # (batch, rows, nheads_k)
    finite = torch.where(total == float("-inf"), torch.zeros_like(total), total)
    weights = torch.exp(lse - finite.unsqueeze(1))
    out = (weights.unsqueeze(-1) * out_partial.double()).sum(dim=1)
    sq = rows // group
    out = out.view(batch, sq, group, nheads_k, d).permute(0, 1, 3, 2, 4).reshape(batch, sq, nheads_k * group, d)
    total = total.view(batch, sq, group, nheads_k).permute(0, 3, 2, 1).reshape(batch, nheads_k * group, sq)
    return out, total


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("splits", [1, 2, 5, 8, 9, 40])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_combine_against_float64(dtype, d, splits, with_sinks):
    gen = torch.Generator(device="cuda").manual_seed(1000 * splits + d + with_sinks)
    batch, seqlen_q, group, nheads_k = 3, 3, 4, 5
    rows = seqlen_q * group
    out_partial = torch.randn(batch, splits, rows, nheads_k, d, device="cuda", dtype=dtype, generator=gen)
    lse_partial = 3 * torch.randn(nheads_k, batch, splits, rows, device="cuda", generator=gen)
    # Splits that saw no key: their partial output is 0 and their lse -inf.
    empty = torch.rand(nheads_k, batch, splits, rows, device="cuda", generator=gen) < 0.25
    lse_partial[empty] = float("-inf")
    lse_partial[:, 1, :, 5] = float("-inf")  # a row no split saw
    out_partial.masked_fill_(lse_partial.permute(1, 2, 3, 0).unsqueeze(-1) == float("-inf"), 0.0)
    sinks = torch.randn(nheads_k * group, device="cuda", generator=gen) if with_sinks else None

    out, lse = torch.ops.flash3.kvcache_combine(out_partial, lse_partial, sinks, group)
    ref_out, ref_lse = _reference(out_partial, lse_partial, sinks, group)

    assert out.shape == (batch, seqlen_q, nheads_k * group, d) and out.dtype == dtype
    assert lse.shape == (batch, nheads_k * group, seqlen_q) and lse.dtype == torch.float32
    eps = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    err = (out.double() - ref_out).abs()
    bound = eps * ref_out.abs() + 1e-5
    assert bool((err <= bound).all()), f"worst {(err / bound).max().item():.3f}x the bound"
    assert torch.equal(lse == float("-inf"), ref_lse == float("-inf"))
    finite = ref_lse != float("-inf")
    assert torch.allclose(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=2e-5)
    # The row no split saw: 0, and lse -inf (or the sink's logit alone).
    t, j = divmod(5, group)
    unseen = out[1, t, j::group]
    assert bool((unseen == 0).all())
    if sinks is None:
        assert bool((lse[1, j::group, t] == float("-inf")).all())
    if splits == 1 and sinks is None:  # one split: its partial, bit for bit
        assert torch.equal(out, out_partial[:, 0].view(batch, seqlen_q, group, nheads_k, d)
                           .permute(0, 1, 3, 2, 4).reshape(batch, seqlen_q, nheads_k * group, d))
