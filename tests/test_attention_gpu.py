"""GPU tests of the forward kernels against float64 references.

Tolerance (FlashAttention's rule): the kernel's max error against a float64 reference is
at most twice the error of a same-precision PyTorch implementation, plus a rounding floor
of one unit in the last place of the output's dtype at the output's magnitude.
Every check draws fresh random inputs and poisons the memory the output will occupy.
"""
import math

import pytest
import torch

import flash3
from flash3.reference import attention_ref

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
HDIMS = [64, 96, 128, 192, 256]
# (seqlen_q, seqlen_k): single rows, tails that are not multiples of any tile,
# seqlen_q != seqlen_k both ways, and a long square one.
# (1537, 1281): the short-sequence kernels of hdim 64 / 128 causal and hdim 128 non-causal
# (both lengths <= 2048; traits.h kShortSeqMaxSeqlen) with 13 query tiles per head
# (test_many_tiles_per_cta has more tiles than SMs).
SEQLENS = [(1, 1), (113, 203), (239, 1), (799, 3), (1023, 1024), (1537, 1281), (4224, 4224)]


def _make_qkv(seed, b, sq, sk, h, hk, d, dtype):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, generator=g)
    return q, k, v


def _poison_allocator(*shapes_dtypes):
    """Fill, then free, blocks of the sizes the op will allocate: the caching allocator
    hands the same memory back, so an element the kernel fails to write reads NaN."""
    blocks = [torch.full(shape, float("nan"), device="cuda", dtype=dtype) for shape, dtype in shapes_dtypes]
    del blocks


def _run(q, k, v, causal, scale=None):
    b, sq, h, d = q.shape
    _poison_allocator(((b, sq, h, d), q.dtype), ((b, h, sq), torch.float32))
    return flash3.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)


def _skip_unless_built(dtype, d, causal):
    if not flash3.is_supported("fwd", dtype, d, causal):
        pytest.skip(f"fwd {dtype} hdim{d} causal={causal} not in this build")


def _check_against_reference(q, k, v, causal, out, lse, scale=None):
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal, softmax_scale=scale, upcast=True)
    out_pt, _ = attention_ref(q, k, v, causal=causal, softmax_scale=scale, upcast=False)
    assert not torch.isnan(out).any(), "output has NaN (unwritten or invalid)"
    err = (out.double() - out_ref).abs().max().item()
    err_pt = (out_pt.double() - out_ref).abs().max().item()
    ulp = torch.finfo(q.dtype).eps * max(out_ref.abs().max().item(), 1e-3)
    assert err <= 2 * err_pt + ulp, f"max error {err:.3e} > 2 * {err_pt:.3e} (same-precision PyTorch) + {ulp:.1e}"
    # lse: the same -inf rows (no visible key), and float32 accuracy elsewhere.
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref)), "lse -inf pattern differs"
    finite = torch.isfinite(lse_ref)
    if finite.any():
        lse_err = (lse[finite].double() - lse_ref[finite].double()).abs().max().item()
        assert lse_err <= 1e-3, f"lse max error {lse_err:.3e}"


@pytest.mark.parametrize("seqlens", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HDIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_forward_matches_reference(seed, dtype, d, causal, seqlens):
    _skip_unless_built(dtype, d, causal)
    sq, sk = seqlens
    big = sq * sk > 1_000_000
    b, h = (1, 2) if big else (2, 3)
    q, k, v = _make_qkv(seed, b, sq, sk, h, h, d, dtype)
    out, lse = _run(q, k, v, causal)
    _check_against_reference(q, k, v, causal, out, lse)


# More query tiles than the GPU has SMs, so that each CTA of a persistent kernel runs
# several tiles: the next tile's Q and K/V loads overlap the current one's math, and O's
# staging buffer and sQ are handed from tile to tile. The short-sequence kernels (traits.h
# kShortSeqMaxSeqlen): (500, 500) all of them (hdim 64 / 128 / 256, both masks), (1000,
# 1000) all but hdim 256 non-causal; (2500, 2300): the general kernels, persistent for
# non-causal hdim 64-128. (1000, 400), causal: the first 600 rows see no key, so half of
# each head's query tiles have no keys, which the producer skips, and a CTA's tiles with
# keys come between them.
MANY_TILES_SEQLENS = [(500, 500), (1000, 1000), (1000, 400), (2500, 2300)]


@pytest.mark.parametrize("seqlens", MANY_TILES_SEQLENS, ids=[f"{a}x{b}" for a, b in MANY_TILES_SEQLENS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HDIMS)
def test_many_tiles_per_cta(seed, d, causal, seqlens):
    _skip_unless_built(torch.bfloat16, d, causal)
    sq, sk = seqlens
    b, h = 2, 16 if sq > 512 else 64
    assert b * h * (sq // 192) > torch.cuda.get_device_properties(0).multi_processor_count
    q, k, v = _make_qkv(seed, b, sq, sk, h, h, d, torch.bfloat16)
    out, lse = _run(q, k, v, causal)
    _check_against_reference(q, k, v, causal, out, lse)


def _check_each_batch_alone(q, k, v, out, lse):
    """Each batch run alone (another grid, another tile order) gives the same rows, bit for bit."""
    for b in range(q.shape[0]):
        out_b, lse_b = _run(q[b : b + 1], k[b : b + 1], v[b : b + 1], True)
        assert torch.equal(out[b : b + 1], out_b) and torch.equal(lse[b : b + 1], lse_b), (
            f"batch {b}: the tile order changed the output"
        )


# The persistent causal short-sequence kernels take their last rounds of tiles from a
# table dealt out on the host, longest first to the least loaded CTAs (scheduler_tail.h).
# 8 x 16 heads of 1000 rows are 1024 query tiles of 128 rows, 7.8 rounds of 132 CTAs: the
# host deals out the last two and a bit at hdim 64 and 128 (both shapes) and 256 (1000 x
# 1000; at 1000 x 400 its model keeps the plain paired order); hdim 96 and 192 run their general
# kernels. At 1000 x 400 the first 600 rows see no key: their tiles, which the producer
# skips, sit in the table too.
# The deal must not change a bit of the output: each batch alone (16 heads of 8 query
# tiles, 128 tiles for 132 CTAs: one tile per CTA, no table) gives the same rows.
@pytest.mark.parametrize("seqlens", [(1000, 1000), (1000, 400)], ids=["1000x1000", "1000x400"])
@pytest.mark.parametrize("d", HDIMS)
def test_tail_balanced_tile_schedule(seed, d, seqlens):
    _skip_unless_built(torch.bfloat16, d, True)
    sq, sk = seqlens
    q, k, v = _make_qkv(seed, 8, sq, sk, 16, 16, d, torch.bfloat16)
    out, lse = _run(q, k, v, True)
    _check_against_reference(q, k, v, True, out, lse)
    _check_each_batch_alone(q, k, v, out, lse)


# The persistent causal kernels walk their tiles in the snake or in pairs of equal work
# (a head's longest tile with its shortest; scheduler.h), whichever the host's model of
# the makespan prefers (scheduler_tail.h), then a dealt tail. 2 batches of: 1243 rows x 8
# heads, 160 tiles of 128 rows, pairs (the snake would leave 28 CTAs a second tile), one
# pair per CTA; 1115 x 12, 9 tiles per head: pairs, some spanning two heads; 1000 x 16,
# 128 tiles: one tile per CTA; 2100 x 40, 17 tiles per head: the snake with a dealt tail;
# 2395 x 48, 1824 tiles: pairs with a dealt tail. Every tile is computed once and the
# order does not change a bit: each batch alone (another order) gives the same rows.
@pytest.mark.parametrize("shape", [(1243, 8), (1115, 12), (1000, 16), (2100, 40), (2395, 48)],
                         ids=["1243x8h", "1115x12h", "1000x16h", "2100x40h", "2395x48h"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_balanced_tile_orders(seed, d, shape):
    _skip_unless_built(torch.bfloat16, d, True)
    s, h = shape
    q, k, v = _make_qkv(seed, 2, s, s, h, h, d, torch.bfloat16)
    out, lse = _run(q, k, v, True)
    _check_against_reference(q, k, v, True, out, lse)
    _check_each_batch_alone(q, k, v, out, lse)


# The kernels take each row's max on the scores' bits as integers (utils.h row_max_bits),
# exact where a thread's part of a row holds a score >= 0; a warp with a part whose scores
# are all negative (or masked) takes the float max. Head 0: every score negative (q <= 0,
# k >= 0). Head 1: scores negative against the second half of the keys, which the kernels
# walk first, and positive against the first half, so both paths meet in one row. Head 2:
# random signs.
def _signed_heads(q, k):
    q, k = q.abs(), k.abs()
    q[:, :, 0] = -q[:, :, 0]
    k[:, k.shape[1] // 2 :, 1] = -k[:, k.shape[1] // 2 :, 1]
    q[:, :, 2] *= torch.randn_like(q[:, :, 2]).sign()
    return q, k


@pytest.mark.parametrize("seqlens", [(700, 1300), (2500, 2300)], ids=["700x1300", "2500x2300"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", HDIMS)
def test_rows_with_negative_scores(seed, d, causal, seqlens):
    _skip_unless_built(torch.bfloat16, d, causal)
    sq, sk = seqlens
    q, k, v = _make_qkv(seed, 1, sq, sk, 3, 3, d, torch.bfloat16)
    q, k = _signed_heads(q, k)
    out, lse = _run(q, k, v, causal, scale=0.3 / math.sqrt(d))
    _check_against_reference(q, k, v, causal, out, lse, scale=0.3 / math.sqrt(d))


# The causal kernels with one CTA per tile (at 2500 x 2300 all four head dims here: the
# lengths are above the short-sequence kernels' limits) take their tiles in sections of
# (batch, head) pairs, longest first across a section (scheduler.h section_size). On 132
# SMs a section holds 4 pairs (20 query tiles per head) or, at hdim 64 (192-row tiles, 14
# per head), 8: 10 pairs leave a partial last section. Under MQA all pairs read one K/V
# head. The order must not change a bit of the output: each tile's math is the same
# wherever it runs, so each (batch, head) pair alone (a section of one: head by head)
# gives the same rows.
@pytest.mark.parametrize("hk", [5, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_sectioned_tile_order(seed, d, hk):
    _skip_unless_built(torch.bfloat16, d, True)
    b, h = 2, 5
    q, k, v = _make_qkv(seed, b, 2500, 2300, h, hk, d, torch.bfloat16)
    out, lse = _run(q, k, v, True)
    _check_against_reference(q, k, v, True, out, lse)
    for bi in range(b):
        for hi in range(h):
            hki = hi // (h // hk)
            out_1, lse_1 = _run(q[bi : bi + 1, :, hi : hi + 1], k[bi : bi + 1, :, hki : hki + 1],
                                v[bi : bi + 1, :, hki : hki + 1], True)
            assert torch.equal(out[bi : bi + 1, :, hi : hi + 1], out_1), f"({bi}, {hi}): tile order changed the output"
            assert torch.equal(lse[bi : bi + 1, hi : hi + 1], lse_1), f"({bi}, {hi}): tile order changed the lse"


@pytest.mark.parametrize("hk", [1, 2], ids=["mqa", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gqa_mqa(seed, d, causal, hk):
    _skip_unless_built(torch.bfloat16, d, causal)
    q, k, v = _make_qkv(seed, 2, 300, 517, 6, hk, d, torch.bfloat16)
    out, lse = _run(q, k, v, causal)
    _check_against_reference(q, k, v, causal, out, lse)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softmax_scale_is_honoured(seed, causal):
    _skip_unless_built(torch.bfloat16, 128, causal)
    q, k, v = _make_qkv(seed, 2, 257, 385, 4, 4, 128, torch.bfloat16)
    out, lse = _run(q, k, v, causal, scale=0.3)
    _check_against_reference(q, k, v, causal, out, lse, scale=0.3)


def test_strided_inputs_from_bhsd_views(seed):
    """(batch, nheads, seqlen, headdim) tensors transposed to (b, s, h, d) are read in place."""
    _skip_unless_built(torch.bfloat16, 128, False)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(2, 4, 333, 128, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
               for _ in range(3))
    out, lse = _run(q, k, v, False)
    _check_against_reference(q, k, v, False, out, lse)


def test_unaligned_strides_are_copied(seed):
    """A head dim slice of a wider tensor has strides TMA cannot read: it is copied first."""
    _skip_unless_built(torch.bfloat16, 64, False)
    g = torch.Generator(device="cuda").manual_seed(seed)
    wide = torch.randn(2, 200, 3, 3, 68, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = (wide[:, :, :, i, 1:65] for i in range(3))
    out, lse = _run(q, k, v, False)
    _check_against_reference(q, k, v, False, out, lse)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_repeated_runs_are_bitwise_identical(seed, causal):
    _skip_unless_built(torch.bfloat16, 128, causal)
    q, k, v = _make_qkv(seed, 2, 1000, 1000, 4, 4, 128, torch.bfloat16)
    first = flash3.attention(q, k, v, causal=causal, return_lse=True)
    for _ in range(3):
        again = flash3.attention(q, k, v, causal=causal, return_lse=True)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.parametrize("sq, sk", [(0, 16), (16, 0), (0, 0)])
def test_empty_sequences(sq, sk):
    _skip_unless_built(torch.bfloat16, 128, False)
    q, k, v = _make_qkv(0, 2, sq, sk, 2, 2, 128, torch.bfloat16)
    out, lse = flash3.attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 2, sq)
    if sq:
        assert torch.all(out == 0) and torch.all(lse == -math.inf)


def test_torch_compile_fullgraph(seed):
    _skip_unless_built(torch.bfloat16, 128, True)
    q, k, v = _make_qkv(seed, 2, 300, 300, 4, 4, 128, torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: flash3.attention(q, k, v, causal=True) * 2, fullgraph=True)
    out = compiled(q, k, v)
    assert torch.equal(out, flash3.attention(q, k, v, causal=True) * 2)


def test_opcheck(seed):
    _skip_unless_built(torch.bfloat16, 128, False)
    q, k, v = _make_qkv(seed, 2, 130, 250, 4, 2, 128, torch.bfloat16)
    torch.library.opcheck(torch.ops.flash3.fwd.default, (q, k, v, 0.125, False))


def test_non_hopper_message_mentions_sm90(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    q, k, v = _make_qkv(0, 1, 8, 8, 2, 2, 128, torch.bfloat16)
    with pytest.raises(TypeError, match=r"sm_80.*supported: Hopper GPUs \(sm_90"):
        flash3.attention(q, k, v)
