"""CPU tests of the pure-PyTorch attention references in flash3.reference.

The two references are computed by different algorithms (full softmax vs the
kernel's tiled online softmax), so their agreement checks the online-softmax
design (rescaling, exp2 with folded scale, causal tile skipping, tail masks)
before any CUDA code runs.
"""

import math
import re

import pytest
import torch

from flash3.reference import attention_blockwise, attention_ref, causal_mask


@pytest.fixture
def gen(seed):
    """A generator seeded from the test id (conftest.seed): fresh, reproducible inputs per test."""
    return torch.Generator().manual_seed(seed)


def make_qkv(gen, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype=torch.float64):
    q = torch.randn(batch, seqlen_q, nheads, headdim, generator=gen, dtype=dtype)
    k = torch.randn(batch, seqlen_k, nheads_kv, headdim, generator=gen, dtype=dtype)
    v = torch.randn(batch, seqlen_k, nheads_kv, headdim, generator=gen, dtype=dtype)
    return q, k, v


def masked_scaled_scores(q, k, causal, scale):
    """Scores written independently of the module: explicit loop over heads for GQA."""
    nheads, nheads_kv = q.shape[2], k.shape[2]
    group = nheads // nheads_kv
    sq, sk = q.shape[1], k.shape[1]
    per_head = [
        torch.einsum("bqd,bkd->bqk", q[:, :, head].double(), k[:, :, head // group].double()) * scale
        for head in range(nheads)
    ]
    scores = torch.stack(per_head, dim=1)
    if causal:
        row = torch.arange(sq).unsqueeze(1)
        col = torch.arange(sk).unsqueeze(0)
        scores = scores.masked_fill(col > row + sk - sq, float("-inf"))
    return scores


SEQLENS = [(1, 1), (113, 203), (203, 113), (239, 1), (1, 239), (65, 64), (64, 65), (128, 128)]
HEADS = [(4, 4), (4, 2), (4, 1)]
BLOCKS = [(128, 128), (64, 48), (32, 80)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", SEQLENS)
@pytest.mark.parametrize("nheads, nheads_kv", HEADS)
@pytest.mark.parametrize("headdim", [64, 128])
def test_ref_matches_blockwise_float64(gen, causal, seqlen_q, seqlen_k, nheads, nheads_kv, headdim):
    q, k, v = make_qkv(gen, 1, seqlen_q, seqlen_k, nheads, nheads_kv, headdim)
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal)
    out_blk, lse_blk = attention_blockwise(q, k, v, causal=causal, block_m=64, block_n=48)
    assert out_ref.dtype == torch.float64 and out_blk.dtype == torch.float64
    assert lse_ref.dtype == torch.float32 and lse_blk.dtype == torch.float32
    assert out_ref.shape == out_blk.shape == q.shape
    assert lse_ref.shape == lse_blk.shape == (1, nheads, seqlen_q)
    torch.testing.assert_close(out_blk, out_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse_blk, lse_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", SEQLENS)
@pytest.mark.parametrize("block_m, block_n", BLOCKS)
def test_blockwise_float32_matches_float64_ref(gen, causal, seqlen_q, seqlen_k, block_m, block_n):
    q, k, v = make_qkv(gen, 2, seqlen_q, seqlen_k, 2, 1, 64)
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal)
    out_blk, lse_blk = attention_blockwise(
        q.float(), k.float(), v.float(), causal=causal, block_m=block_m, block_n=block_n
    )
    assert out_blk.dtype == torch.float32
    torch.testing.assert_close(out_blk.double(), out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_blk, lse_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(113, 203), (203, 113), (65, 64)])
@pytest.mark.parametrize("nheads, nheads_kv", HEADS)
def test_lse_is_logsumexp_of_masked_scaled_scores(gen, causal, seqlen_q, seqlen_k, nheads, nheads_kv):
    q, k, v = make_qkv(gen, 2, seqlen_q, seqlen_k, nheads, nheads_kv, 64)
    expected = torch.logsumexp(masked_scaled_scores(q, k, causal, 1 / math.sqrt(64)), dim=-1).float()
    _, lse_ref = attention_ref(q, k, v, causal=causal)
    _, lse_blk = attention_blockwise(q, k, v, causal=causal, block_m=64, block_n=48)
    torch.testing.assert_close(lse_ref, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse_blk, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_output_is_softmax_times_v(gen, causal):
    q, k, v = make_qkv(gen, 1, 37, 53, 4, 2, 64)
    probs = torch.softmax(masked_scaled_scores(q, k, causal, 1 / math.sqrt(64)), dim=-1)
    v_expanded = v.repeat_interleave(2, dim=2)
    expected = torch.einsum("bhqk,bkhd->bqhd", probs, v_expanded)
    out, _ = attention_ref(q, k, v, causal=causal)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(5, 3), (239, 1), (203, 113), (130, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fully_masked_rows_give_zero_output_and_neg_inf_lse(gen, seqlen_q, seqlen_k, dtype):
    q, k, v = make_qkv(gen, 1, seqlen_q, seqlen_k, 4, 2, 64, dtype=dtype)
    masked_rows = seqlen_q - seqlen_k
    results = [
        attention_ref(q, k, v, causal=True),
        attention_ref(q, k, v, causal=True, upcast=False),
        attention_blockwise(q, k, v, causal=True, block_m=64, block_n=48),
    ]
    for out, lse in results:
        assert not out.isnan().any() and not lse.isnan().any()
        assert (out[:, :masked_rows] == 0).all()
        assert (lse[:, :, :masked_rows] == float("-inf")).all()
        assert lse[:, :, masked_rows:].isfinite().all()
        assert (out[:, masked_rows:] != 0).any(dim=-1).all()


@pytest.mark.parametrize("causal", [False, True])
def test_empty_keys_give_zero_output_and_neg_inf_lse(gen, causal):
    q, k, v = make_qkv(gen, 1, 7, 0, 2, 1, 64)
    for out, lse in (attention_ref(q, k, v, causal=causal), attention_blockwise(q, k, v, causal=causal)):
        assert out.shape == q.shape and lse.shape == (1, 2, 7)
        assert (out == 0).all()
        assert (lse == float("-inf")).all()


def parse_drawn_masks(docstring):
    """Extract every ``sq=.., sk=..`` example drawn as rows of ``x`` / ``.``."""
    examples = []
    for block in re.split(r"\n(?=\s*sq=)", docstring):
        header = re.match(r"\s*sq=(\d+), sk=(\d+)", block)
        if header is None:
            continue
        rows = re.findall(r"^\s*q\d+\s+\[([x. ]+)\]", block, flags=re.MULTILINE)
        mask = torch.tensor([[cell == "x" for cell in row.split()] for row in rows], dtype=torch.bool)
        examples.append((int(header.group(1)), int(header.group(2)), mask))
    return examples


def test_docstring_mask_drawings_match_causal_mask():
    examples = parse_drawn_masks(causal_mask.__doc__)
    assert {(sq, sk) for sq, sk, _ in examples} == {(3, 5), (5, 3)}
    for sq, sk, drawn in examples:
        assert drawn.shape == (sq, sk)
        assert torch.equal(causal_mask(sq, sk, device="cpu"), drawn)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (4, 4), (3, 7), (7, 3)])
def test_causal_mask_is_bottom_right_aligned(seqlen_q, seqlen_k):
    mask = causal_mask(seqlen_q, seqlen_k, device="cpu")
    assert mask.dtype == torch.bool and mask.shape == (seqlen_q, seqlen_k)
    for i in range(seqlen_q):
        for j in range(seqlen_k):
            assert bool(mask[i, j]) == (j <= i + seqlen_k - seqlen_q)
    assert mask[-1].all()


@pytest.mark.parametrize("headdim", [64, 128])
def test_default_scale_is_inverse_sqrt_headdim(gen, headdim):
    q, k, v = make_qkv(gen, 1, 33, 47, 2, 2, headdim)
    explicit = 1 / math.sqrt(headdim)
    for fn in (attention_ref, attention_blockwise):
        out_default, lse_default = fn(q, k, v, causal=True)
        out_explicit, lse_explicit = fn(q, k, v, causal=True, softmax_scale=explicit)
        torch.testing.assert_close(out_default, out_explicit, rtol=0, atol=0)
        torch.testing.assert_close(lse_default, lse_explicit, rtol=0, atol=0)


@pytest.mark.parametrize("softmax_scale", [0.3, 1.0])
def test_explicit_scale_is_honoured(gen, softmax_scale):
    q, k, v = make_qkv(gen, 1, 33, 47, 2, 1, 64)
    expected_lse = torch.logsumexp(masked_scaled_scores(q, k, False, softmax_scale), dim=-1).float()
    out_ref, lse_ref = attention_ref(q, k, v, softmax_scale=softmax_scale)
    out_blk, lse_blk = attention_blockwise(q, k, v, softmax_scale=softmax_scale, block_m=16, block_n=16)
    torch.testing.assert_close(lse_ref, expected_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse_blk, expected_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_blk, out_ref, rtol=1e-10, atol=1e-10)
    out_default, _ = attention_ref(q, k, v)
    assert not torch.allclose(out_ref, out_default)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_precision_ref_keeps_dtype_and_is_close(gen, causal, dtype):
    q, k, v = make_qkv(gen, 1, 65, 129, 4, 2, 64)
    out_truth, lse_truth = attention_ref(q, k, v, causal=causal)
    out, lse = attention_ref(q.to(dtype), k.to(dtype), v.to(dtype), causal=causal, upcast=False)
    assert out.dtype == dtype and lse.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), out_truth, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, lse_truth, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_blockwise_low_precision_inputs_return_input_dtype(gen, dtype):
    q, k, v = make_qkv(gen, 1, 65, 129, 4, 2, 64)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out_truth, lse_truth = attention_ref(q, k, v, causal=True)
    out, lse = attention_blockwise(q, k, v, causal=True, block_m=64, block_n=48)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), out_truth, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, lse_truth, rtol=1e-5, atol=1e-5)
