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

from flash3.reference import attention_blockwise, attention_ref, causal_mask, window_mask


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


# ----------------------------------------------------------------------------------------
# Sliding windows, softcap and attention sinks
# ----------------------------------------------------------------------------------------

WINDOWS = [(-1, -1), (-1, 0), (0, 0), (1, 0), (17, 3), (-1, 5), (64, -1), (3, 3), (0, -1), (500, 500)]
WINDOW_SHAPES = [(1, 1), (7, 7), (37, 53), (53, 37), (1, 40), (40, 1), (5, 0)]


def brute_force_window(sq, sk, window_size, causal):
    """The window by the definition, element by element."""
    left, right = window_size
    if causal:
        right = 0
    mask = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            diag = i + sk - sq
            mask[i, j] = (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right)
    return mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window_size", WINDOWS)
@pytest.mark.parametrize("seqlen_q, seqlen_k", WINDOW_SHAPES)
def test_window_mask_matches_definition(seqlen_q, seqlen_k, window_size, causal):
    mask = window_mask(seqlen_q, seqlen_k, window_size, causal)
    assert mask.dtype == torch.bool and mask.shape == (seqlen_q, seqlen_k)
    assert torch.equal(mask, brute_force_window(seqlen_q, seqlen_k, window_size, causal))


@pytest.mark.parametrize("seqlen_q, seqlen_k", WINDOW_SHAPES)
def test_window_mask_special_windows(seqlen_q, seqlen_k):
    everything = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    causal = causal_mask(seqlen_q, seqlen_k)
    assert torch.equal(window_mask(seqlen_q, seqlen_k), everything)
    assert torch.equal(window_mask(seqlen_q, seqlen_k, (-1, -1), causal=True), causal)
    assert torch.equal(window_mask(seqlen_q, seqlen_k, (-1, 0)), causal)
    # causal sets the right side to 0, whatever it was
    for right in (-1, 0, 3, 1000):
        assert torch.equal(window_mask(seqlen_q, seqlen_k, (2, right), causal=True),
                           window_mask(seqlen_q, seqlen_k, (2, 0)))
    # sides reaching past the sequences (FlashAttention-3's normalisation) mask nothing
    far = (max(seqlen_k - 1, 0), max(seqlen_q - 1, 0))
    assert torch.equal(window_mask(seqlen_q, seqlen_k, far), everything)


def test_window_mask_docstring_drawings():
    examples = parse_drawn_masks(window_mask.__doc__)
    headers = re.findall(r"sq=\d+, sk=\d+, window_size=\((-?\d+), (-?\d+)\)", window_mask.__doc__)
    windows = [tuple(map(int, w)) for w in headers]
    assert [(sq, sk) for sq, sk, _ in examples] == [(5, 5), (3, 6)] and windows == [(1, 1), (1, 0)]
    for (sq, sk, drawn), window in zip(examples, windows):
        assert torch.equal(window_mask(sq, sk, window), drawn)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(37, 53), (53, 37), (64, 64)])
@pytest.mark.parametrize("window_size", [(-1, -1), (-1, 0), (5, 2), (0, 0), (-1, 3), (9, -1)])
def test_window_equals_masked_scores(gen, seqlen_q, seqlen_k, window_size):
    """The windowed reference is the softmax of the scores with the window's keys only."""
    q, k, v = make_qkv(gen, 2, seqlen_q, seqlen_k, 4, 2, 64)
    out, lse = attention_ref(q, k, v, window_size=window_size)
    scores = masked_scaled_scores(q, k, False, 1 / 8)
    visible = brute_force_window(seqlen_q, seqlen_k, window_size, False)
    scores = scores.masked_fill(~visible, float("-inf"))
    empty = ~visible.any(dim=-1)
    expected_lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    expected = torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(2, dim=2))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse.float(), rtol=1e-6, atol=1e-6)
    assert (out[:, empty] == 0).all() and (lse[:, :, empty] == float("-inf")).all()


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(37, 53), (53, 37)])
def test_window_minus_one_is_no_mask_and_minus_one_zero_is_causal(gen, seqlen_q, seqlen_k):
    q, k, v = make_qkv(gen, 1, seqlen_q, seqlen_k, 4, 1, 64)
    for a, b in (
        (attention_ref(q, k, v, window_size=(-1, -1)), attention_ref(q, k, v)),
        (attention_ref(q, k, v, window_size=(-1, 0)), attention_ref(q, k, v, causal=True)),
        (attention_ref(q, k, v, window_size=(seqlen_k - 1, seqlen_q - 1)), attention_ref(q, k, v)),
        (attention_ref(q, k, v, causal=True, window_size=(7, 7)), attention_ref(q, k, v, window_size=(7, 0))),
    ):
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
        torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)


def test_window_rows_without_keys(gen):
    """seqlen_q > seqlen_k with the right side 0: the first seqlen_q - seqlen_k rows see no
    key (output 0, lse -inf); a window right of every key (left 0, right 0, seqlen_k <
    seqlen_q) too. No NaN, in values or gradients."""
    q, k, v = make_qkv(gen, 1, 20, 6, 2, 1, 64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for upcast in (True, False):
        out, lse = attention_ref(q, k, v, window_size=(2, 0), upcast=upcast)
        assert (out[:, :14] == 0).all() and (lse[:, :, :14] == float("-inf")).all()
        assert lse[:, :, 14:].isfinite().all()
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads)
        assert (grads[0][:, :14] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_softcap_caps_the_scores(gen, causal):
    q, k, v = make_qkv(gen, 2, 29, 41, 4, 2, 64)
    q = q * 3  # scores of several units, so that the cap matters
    softcap = 2.5
    out, lse = attention_ref(q, k, v, causal=causal, softcap=softcap)
    scores = masked_scaled_scores(q, k, False, 1 / 8)
    scores = softcap * torch.tanh(scores / softcap)
    if causal:
        scores = scores.masked_fill(~causal_mask(29, 41), float("-inf"))
    expected = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v.repeat_interleave(2, dim=2))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1).float(), rtol=1e-6, atol=1e-6)
    assert (lse.double() <= softcap + math.log(41) + 1e-6).all()
    assert not torch.allclose(out, attention_ref(q, k, v, causal=causal)[0], rtol=1e-3, atol=1e-3)


def test_softcap_large_is_no_softcap(gen):
    q, k, v = make_qkv(gen, 1, 33, 47, 2, 1, 64)
    out, lse = attention_ref(q, k, v, causal=True, softcap=1e6)
    out0, lse0 = attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(out, out0, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse, lse0, rtol=1e-6, atol=1e-6)
    out_zero, _ = attention_ref(q, k, v, causal=True, softcap=0.0)
    torch.testing.assert_close(out_zero, out0, rtol=0, atol=0)


@pytest.mark.parametrize("window_size", [(-1, -1), (4, 1)])
def test_sinks_join_the_denominator(gen, window_size):
    """out = sum_j exp(z_j) v_j / (exp(sink) + sum_j exp(z_j)), lse = log(exp(sink) +
    sum_j exp(z_j)), written out from the scores."""
    q, k, v = make_qkv(gen, 2, 23, 31, 4, 2, 64)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64) * 2
    out, lse = attention_ref(q, k, v, window_size=window_size, sinks=sinks)
    scores = masked_scaled_scores(q, k, False, 1 / 8)
    scores = scores.masked_fill(~brute_force_window(23, 31, window_size, False), float("-inf"))
    weights = torch.exp(scores)  # the scores are a few units: no overflow
    denominator = torch.exp(sinks).view(1, 4, 1) + weights.sum(dim=-1)
    expected = torch.einsum("bhqk,bkhd->bqhd", weights / denominator.unsqueeze(-1), v.repeat_interleave(2, dim=2))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.log(denominator).float(), rtol=1e-6, atol=1e-6)
    out0, _ = attention_ref(q, k, v, window_size=window_size)
    assert not torch.allclose(out, out0, rtol=1e-3, atol=1e-3)


def test_sink_minus_inf_is_no_sink(gen):
    q, k, v = make_qkv(gen, 1, 19, 13, 4, 2, 64)
    sinks = torch.full((4,), float("-inf"), dtype=torch.float64)
    for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (3, 0))):
        out, lse = attention_ref(q, k, v, causal=causal, window_size=window, sinks=sinks)
        out0, lse0 = attention_ref(q, k, v, causal=causal, window_size=window)
        # rows 0..5 see no key when causal: no NaN there either
        assert not out.isnan().any() and not lse.isnan().any()
        torch.testing.assert_close(out, out0, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, lse0, rtol=0, atol=0)


def test_sinks_rows_without_keys_have_lse_sink(gen):
    q, k, v = make_qkv(gen, 1, 9, 4, 3, 3, 64)
    sinks = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    out, lse = attention_ref(q, k, v, causal=True, sinks=sinks)
    assert (out[:, :5] == 0).all()
    torch.testing.assert_close(lse[0, :, :5], sinks.float().view(3, 1).expand(3, 5))
    out, lse = attention_ref(q, k[:, :0], v[:, :0], sinks=sinks)  # no key at all
    assert (out == 0).all()
    torch.testing.assert_close(lse[0], sinks.float().view(3, 1).expand(3, 9))


@pytest.mark.parametrize("causal, window_size, softcap", [(False, (-1, -1), 0.0), (True, (5, 0), 0.0),
                                                          (False, (7, 2), 3.0), (True, (-1, -1), 4.0)])
def test_sink_gradient_closed_form(gen, causal, window_size, softcap):
    """d sink_h = -sum over (batch, rows) of exp(sink_h - lse_i) * (rowsum(dout_i * out_i) - dlse_i)."""
    q, k, v = make_qkv(gen, 2, 21, 17, 4, 2, 64)
    sinks = (torch.randn(4, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    out, lse = attention_ref(q, k, v, causal=causal, window_size=window_size, softcap=softcap, sinks=sinks)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=gen, dtype=torch.float64)
    (dsinks,) = torch.autograd.grad((out * dout).sum() + (lse.double() * dlse).sum(), sinks)
    lse64 = lse.double().detach()
    rowsum = (dout * out.detach()).sum(dim=-1).transpose(1, 2)  # (b, h, sq)
    share = torch.exp(sinks.detach().view(1, 4, 1) - lse64)
    expected = -(share * (rowsum - dlse)).sum(dim=(0, 2))
    torch.testing.assert_close(dsinks, expected, rtol=1e-5, atol=1e-6)


def test_options_in_same_precision_reference(gen):
    """upcast=False keeps the input dtype with windows, softcap and sinks, and stays close
    to the float64 truth."""
    q, k, v = make_qkv(gen, 1, 65, 129, 4, 2, 64)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    opts = dict(causal=True, window_size=(20, 0), softcap=5.0)
    out_truth, lse_truth = attention_ref(q, k, v, sinks=sinks, **opts)
    out, lse = attention_ref(q.bfloat16(), k.bfloat16(), v.bfloat16(), sinks=sinks.float(), upcast=False, **opts)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), out_truth, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(lse, lse_truth, rtol=3e-2, atol=3e-2)
