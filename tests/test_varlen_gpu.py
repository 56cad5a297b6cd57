"""GPU tests of flash3.attention_varlen (packed batches of sequences of different lengths).

Each sequence is compared with the float64 reference on that sequence alone, under the
tolerance rule of test_attention_gpu.py. The memory the outputs will occupy is poisoned
first: rows that belong to no sequence must stay untouched, valid rows must be written.
"""
import math

import pytest
import torch

import flash3
from flash3.reference import attention_ref

pytestmark = pytest.mark.gpu

HDIMS = [64, 96, 128, 192, 256]
MIX = [1, 7, 128, 129, 1000, 4097]


def _skip_unless_built(kind, dtype, d, causal):
    if not flash3.is_supported(kind, dtype, d, causal):
        pytest.skip(f"{kind} {dtype} hdim{d} causal={causal} not in this build")


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device="cuda")


def _packed(seed, lens_q, lens_k, h, hk, d, dtype, slack_q=None, slack_k=None):
    """q (sum of slots, h, d) etc., where slot b holds lens[b] + slack[b] rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    slots_q = [n + (slack_q[i] if slack_q else 0) for i, n in enumerate(lens_q)]
    slots_k = [n + (slack_k[i] if slack_k else 0) for i, n in enumerate(lens_k)]
    q = torch.randn(sum(slots_q), h, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(sum(slots_k), hk, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(sum(slots_k), hk, d, device="cuda", dtype=dtype, generator=g)
    return q, k, v, _cu(slots_q), _cu(slots_k)


def _poisoned_run(fn, shape, dtype, lse_shape):
    """Runs fn with the allocator primed with NaN blocks of the outputs' sizes. Returns the
    outputs and whether they landed on the poisoned blocks (then unwritten rows read NaN)."""
    blocks = [torch.full(shape, float("nan"), device="cuda", dtype=dtype),
              torch.full(lse_shape, float("nan"), device="cuda", dtype=torch.float32)]
    ptrs = [b.data_ptr() for b in blocks]
    del blocks
    out, lse = fn()
    return out, lse, out.data_ptr() == ptrs[0] and lse.data_ptr() == ptrs[1]


def _check_sequence(q, k, v, out, lse, causal, scale=None):
    """q (1, sq, h, d) etc.: one sequence against the float64 reference."""
    out_ref, lse_ref = attention_ref(q, k, v, causal=causal, softmax_scale=scale, upcast=True)
    out_pt, _ = attention_ref(q, k, v, causal=causal, softmax_scale=scale, upcast=False)
    assert not torch.isnan(out).any(), "valid output rows hold NaN (unwritten)"
    err = (out.double() - out_ref).abs().max().item() if out.numel() else 0.0
    err_pt = (out_pt.double() - out_ref).abs().max().item() if out.numel() else 0.0
    ulp = torch.finfo(q.dtype).eps * max(out_ref.abs().max().item() if out.numel() else 0.0, 1e-3)
    assert err <= 2 * err_pt + ulp, f"out error {err:.3e} > 2 x {err_pt:.3e} + {ulp:.1e}"
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite), "lse: -inf where the reference is finite, or back"
    if finite.any():
        lse_err = (lse.double() - lse_ref)[finite].abs().max().item()
        assert lse_err <= 1e-3 * max(1.0, lse_ref[finite].abs().max().item()), f"lse error {lse_err:.3e}"


def _check_packed(q, k, v, cu_q, cu_k, lens_q, lens_k, out, lse, causal, poisoned, scale=None):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    written = torch.zeros(q.shape[0], dtype=torch.bool, device="cuda")
    for b in range(len(lens_q)):
        rq = slice(cq[b], cq[b] + lens_q[b])
        rk = slice(ck[b], ck[b] + lens_k[b])
        written[rq] = True
        _check_sequence(q[None, rq], k[None, rk], v[None, rk], out[None, rq],
                        lse[None, :, rq], causal, scale)
    if poisoned and not written.all():
        assert torch.isnan(out[~written]).all(), "rows outside the sequences were written"
        assert torch.isnan(lse[:, ~written]).all(), "lse of rows outside the sequences was written"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", HDIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_mix(dtype, d, causal):
    _skip_unless_built("fwd", dtype, d, causal)
    lens_q = MIX
    lens_k = [n if i % 2 == 0 else n + 37 for i, n in enumerate(MIX)]  # seqlen_q != seqlen_k in some
    q, k, v, cu_q, cu_k = _packed(d + causal, lens_q, lens_k, 4, 2, d, dtype)

    def run():
        return flash3.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                       return_lse=True)

    out, lse, poisoned = _poisoned_run(run, q.shape, dtype, (q.shape[1], q.shape[0]))
    _check_packed(q, k, v, cu_q, cu_k, lens_q, lens_k, out, lse, causal, poisoned)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_empty_and_unequal(d, causal):
    """Zero-length sequences (queries, keys or both), more queries than keys and back."""
    dtype = torch.bfloat16
    _skip_unless_built("fwd", dtype, d, causal)
    lens_q = [0, 5, 300, 0, 64, 1, 777]
    lens_k = [3, 0, 17, 0, 200, 1, 777]
    q, k, v, cu_q, cu_k = _packed(7 + d, lens_q, lens_k, 6, 3, d, dtype)
    out, lse, poisoned = _poisoned_run(
        lambda: flash3.attention_varlen(q, k, v, cu_q, cu_k, 777, 777, causal=causal, return_lse=True),
        q.shape, dtype, (q.shape[1], q.shape[0]))
    _check_packed(q, k, v, cu_q, cu_k, lens_q, lens_k, out, lse, causal, poisoned)


@pytest.mark.parametrize("batch", [1024, 1025, 2600])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_many_sequences(batch, causal):
    """Many sequences: the tile table (csrc/packed_tiles.cu) sorts up to 1024 sequences by
    length and walks larger batches in chunks of 1024, in batch order."""
    d, dtype = 64, torch.bfloat16
    _skip_unless_built("fwd", dtype, d, causal)
    g = torch.Generator().manual_seed(batch + causal)
    choices = [0, 1, 17, 64, 65, 129, 200]  # longer than one tile: the table, not one tile per sequence
    lens_q = [choices[i] for i in torch.randint(0, len(choices), (batch,), generator=g).tolist()]
    lens_k = [n + i % 3 for i, n in enumerate(lens_q)]
    q, k, v, cu_q, cu_k = _packed(batch + 5 * causal, lens_q, lens_k, 4, 2, d, dtype)
    out, lse, poisoned = _poisoned_run(
        lambda: flash3.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                        return_lse=True),
        q.shape, dtype, (q.shape[1], q.shape[0]))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "rows left unwritten"
    # The sequences of one (length, keys) pair against the float64 reference at once.
    cq, ck = cu_q.tolist(), cu_k.tolist()
    groups = {}
    for b, pair in enumerate(zip(lens_q, lens_k)):
        groups.setdefault(pair, []).append(b)
    for (nq, nk), members in groups.items():
        if nq == 0:
            continue
        rows_q = torch.tensor([cq[b] + i for b in members for i in range(nq)], device="cuda")
        rows_k = torch.tensor([ck[b] + i for b in members for i in range(nk)], device="cuda").long()
        shape_q, shape_k = (len(members), nq, *q.shape[1:]), (len(members), nk, *k.shape[1:])
        got = out[rows_q].view(shape_q)
        got_lse = lse[:, rows_q].view(q.shape[1], len(members), nq).transpose(0, 1)
        _check_sequence(q[rows_q].view(shape_q), k[rows_k].view(shape_k), v[rows_k].view(shape_k), got, got_lse,
                        causal)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_forward_long_causal_mix(d):
    """Causal sequences of up to 9000 tokens with at least two query tiles per SM: the
    lengths at which the persistent short tile serves dense causal calls (traits.h)."""
    dtype = torch.bfloat16
    _skip_unless_built("fwd", dtype, d, True)
    lens = [4096, 1, 129, 3001, 77, 2500] if d == 64 else [9000, 1, 129, 3001, 77, 5000]
    h = 8 if d == 64 else 4
    q, k, v, cu_q, cu_k = _packed(31 + d, lens, lens, h, h // 2, d, dtype)
    out, lse, poisoned = _poisoned_run(
        lambda: flash3.attention_varlen(q, k, v, cu_q, cu_k, max(lens), max(lens), causal=True, return_lse=True),
        q.shape, dtype, (q.shape[1], q.shape[0]))
    _check_packed(q, k, v, cu_q, cu_k, lens, lens, out, lse, True, poisoned)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_short_mix_claimed_tiles(d, causal):
    """Sequences short enough for the persistent short tiles, with many more query tiles
    than SMs: each CTA claims its next tile from a counter the table kernel zeroes
    (scheduler_packed.h). Every tile written once, whichever CTA runs it: the first call,
    a second one (the counter zeroed again) and a replay in a CUDA graph agree bitwise."""
    dtype = torch.bfloat16
    _skip_unless_built("fwd", dtype, d, causal)
    g = torch.Generator().manual_seed(d + causal)
    lens = [int(math.exp(x)) for x in (torch.rand(90, generator=g) * math.log(1500 / 20) + math.log(20)).tolist()]
    lens[3], lens[40] = 0, 1
    lens_k = [n + (i % 3) * 5 for i, n in enumerate(lens)]  # seqlen_k > seqlen_q in some
    q, k, v, cu_q, cu_k = _packed(71 + d, lens, lens_k, 8, 2, d, dtype)

    def run():
        return flash3.attention_varlen(q, k, v, cu_q, cu_k, max(lens), max(lens_k), causal=causal, return_lse=True)

    out, lse, poisoned = _poisoned_run(run, q.shape, dtype, (q.shape[1], q.shape[0]))
    _check_packed(q, k, v, cu_q, cu_k, lens, lens_k, out, lse, causal, poisoned)
    out2, lse2 = run()
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out3, lse3 = run()
    for _ in range(2):
        out3.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, out3) and torch.equal(lse, lse3)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_seqused(d, causal):
    """seqused shorter than the slot: the rest of the slot is neither read nor written."""
    dtype = torch.bfloat16
    _skip_unless_built("fwd", dtype, d, causal)
    lens_q = [100, 1, 513, 0, 250]
    lens_k = [90, 40, 600, 5, 250]
    slack_q = [28, 63, 0, 9, 200]
    slack_k = [10, 0, 77, 3, 1]
    q, k, v, cu_q, cu_k = _packed(11 + d, lens_q, lens_k, 4, 4, d, dtype, slack_q, slack_k)
    used_q = torch.tensor(lens_q, dtype=torch.int32, device="cuda")
    used_k = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    max_q = max(n + s for n, s in zip(lens_q, slack_q))
    max_k = max(n + s for n, s in zip(lens_k, slack_k))
    out, lse, poisoned = _poisoned_run(
        lambda: flash3.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, seqused_q=used_q, seqused_k=used_k,
                                        causal=causal, return_lse=True, validate=True),
        q.shape, dtype, (q.shape[1], q.shape[0]))
    _check_packed(q, k, v, cu_q, cu_k, lens_q, lens_k, out, lse, causal, poisoned)


def _grads_reference(q, k, v, cu_q, cu_k, lens_q, lens_k, causal, dout, dlse):
    """Per-sequence float64 gradients of (out, lse) . (dout, dlse), packed like q, k, v."""
    dq = torch.zeros_like(q, dtype=torch.float64)
    dk = torch.zeros_like(k, dtype=torch.float64)
    dv = torch.zeros_like(v, dtype=torch.float64)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lens_q)):
        rq = slice(cq[b], cq[b] + lens_q[b])
        rk = slice(ck[b], ck[b] + lens_k[b])
        qs = q[None, rq].double().requires_grad_()
        ks = k[None, rk].double().requires_grad_()
        vs = v[None, rk].double().requires_grad_()
        o, l = attention_ref(qs, ks, vs, causal=causal, upcast=True)
        l = torch.where(torch.isfinite(l), l, torch.zeros_like(l))
        loss = (o * dout[None, rq].double()).sum() + (l * dlse[None, :, rq].double()).sum()
        if loss.requires_grad:
            gq, gk, gv = torch.autograd.grad(loss, (qs, ks, vs), allow_unused=True)
            for dst, g, r in ((dq, gq, rq), (dk, gk, rk), (dv, gv, rk)):
                if g is not None:
                    dst[r] = g[0]
    return dq, dk, dv


# GQA (float32 dK and dV per query head, summed by the binding) and one K/V head per
# query head (16-bit dK and dV; a sequence's partial last key tile is written row by row,
# so that it does not reach the next sequence's rows).
@pytest.mark.parametrize("hk", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", HDIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_mix(dtype, d, causal, hk):
    _skip_unless_built("bwd", dtype, d, causal)
    lens_q = [1, 7, 128, 129, 1000, 0, 333]
    lens_k = [1, 70, 128, 200, 1000, 9, 0]
    q, k, v, cu_q, cu_k = _packed(100 + d, lens_q, lens_k, 4, hk, d, dtype)
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    out, lse = flash3.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                       return_lse=True)
    g = torch.Generator(device="cuda").manual_seed(d)
    dout = torch.randn(out.shape, device="cuda", dtype=dtype, generator=g)
    dlse = torch.randn(lse.shape, device="cuda", dtype=torch.float32, generator=g)
    dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    ref = _grads_reference(q.detach(), k.detach(), v.detach(), cu_q, cu_k, lens_q, lens_k, causal, dout, dlse)
    for name, got, want in (("dq", dq, ref[0]), ("dk", dk, ref[1]), ("dv", dv, ref[2])):
        assert torch.isfinite(got).all(), f"{name} has NaN/inf"
        err = (got.double() - want).abs().max().item()
        scale = max(want.abs().max().item(), 1e-3)
        assert err <= 2e-2 * scale, f"{name}: max error {err:.3e} at scale {scale:.3e}"


@pytest.mark.parametrize("causal", [False, True])
def test_backward_mix_deterministic(causal):
    """deterministic=True on unequal lengths: each head's key tiles listed from the last
    (the dQ sums wait on higher key tiles), the same bits on every run."""
    d, dtype = 128, torch.bfloat16
    _skip_unless_built("bwd", dtype, d, causal)
    lens_q = [1, 7, 3000, 129, 1000, 0, 333]
    lens_k = [1, 70, 2900, 200, 1000, 9, 0]
    q, k, v, cu_q, cu_k = _packed(7 + causal, lens_q, lens_k, 4, 2, d, dtype)
    g = torch.Generator(device="cuda").manual_seed(8)
    dout = torch.randn(q.shape, device="cuda", dtype=dtype, generator=g)
    runs = []
    for _ in range(2):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out = flash3.attention_varlen(qg, kg, vg, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                      deterministic=True)
        runs.append(torch.autograd.grad(out, (qg, kg, vg), dout))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    ref = _grads_reference(q, k, v, cu_q, cu_k, lens_q, lens_k, causal, dout,
                           torch.zeros(q.shape[1], q.shape[0], device="cuda"))
    for name, got, want in zip(("dq", "dk", "dv"), runs[0], ref):
        err = (got.double() - want).abs().max().item()
        assert err <= 2e-2 * max(want.abs().max().item(), 1e-3), f"{name}: max error {err:.3e}"


def test_backward_seqused_zero_grads():
    d, dtype = 128, torch.bfloat16
    _skip_unless_built("bwd", dtype, d, True)
    lens_q, lens_k = [50, 200, 3], [60, 100, 7]
    slack_q, slack_k = [14, 56, 61], [4, 28, 1]
    q, k, v, cu_q, cu_k = _packed(5, lens_q, lens_k, 4, 2, d, dtype, slack_q, slack_k)
    used_q = torch.tensor(lens_q, dtype=torch.int32, device="cuda")
    used_k = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    for t in (q, k, v):
        t.requires_grad_()
    out = flash3.attention_varlen(q, k, v, cu_q, cu_k, 256, 128, seqused_q=used_q, seqused_k=used_k, causal=True)
    dout = torch.randn_like(out)
    cq = cu_q.tolist()
    valid_q = torch.zeros(q.shape[0], dtype=torch.bool, device="cuda")
    for b, n in enumerate(lens_q):
        valid_q[cq[b]:cq[b] + n] = True
    dout[~valid_q] = 0  # the loss sees only the valid rows
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref = _grads_reference(q.detach(), k.detach(), v.detach(), cu_q, cu_k, lens_q, lens_k, True, dout,
                           torch.zeros(q.shape[1], q.shape[0], device="cuda"))
    for name, got, want in (("dq", dq, ref[0]), ("dk", dk, ref[1]), ("dv", dv, ref[2])):
        err = (got.double() - want).abs().max().item()
        assert err <= 2e-2 * max(want.abs().max().item(), 1e-3), f"{name}: max error {err:.3e}"
    assert (dq[~valid_q] == 0).all()


@pytest.mark.parametrize("d", HDIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_dense_and_varlen_agree_bitwise(d, causal):
    """Equal lengths: the varlen call runs the dense call's kernels on the same tiles."""
    dtype = torch.bfloat16
    _skip_unless_built("bwd", dtype, d, causal)
    b, s, h = 3, 1000, 4
    g = torch.Generator(device="cuda").manual_seed(d)
    q = torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g, requires_grad=True)
    cu = _cu([s] * b)
    out_d, lse_d = flash3.attention(q, k, v, causal=causal, return_lse=True, deterministic=True)
    out_v, lse_v = flash3.attention_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, s, s,
                                           causal=causal, return_lse=True, deterministic=True)
    assert torch.equal(out_d.flatten(0, 1), out_v)
    assert torch.equal(lse_d.transpose(0, 1).flatten(1, 2), lse_v)
    dout = torch.randn_like(out_d)
    grads_d = torch.autograd.grad(out_d, (q, k, v), dout)
    grads_v = torch.autograd.grad(out_v, (q, k, v), dout.flatten(0, 1))
    for gd, gv in zip(grads_d, grads_v):
        assert torch.equal(gd, gv)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_dense_and_varlen_agree_bitwise_long_causal(d):
    """Equal causal lengths with enough query tiles for the persistent short tile's longer
    ranges (traits.h kDenseCausalShortMaxSeqlen): the same kernel tiles in the same order."""
    dtype = torch.bfloat16
    _skip_unless_built("fwd", dtype, d, True)
    b, s, h = 2, 3000, 8
    g = torch.Generator(device="cuda").manual_seed(d + 1)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    cu = _cu([s] * b)
    out_d, lse_d = flash3.attention(q, k, v, causal=True, return_lse=True)
    out_v, lse_v = flash3.attention_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, s, s,
                                           causal=True, return_lse=True)
    assert torch.equal(out_d.flatten(0, 1), out_v)
    assert torch.equal(lse_d.transpose(0, 1).flatten(1, 2), lse_v)


def test_compile_fullgraph_and_opcheck():
    d, dtype = 128, torch.bfloat16
    _skip_unless_built("bwd", dtype, d, True)
    lens = [5, 300, 77]
    q, k, v, cu_q, cu_k = _packed(3, lens, lens, 4, 2, d, dtype)

    def f(q, k, v, cu_q, cu_k):
        return flash3.attention_varlen(q, k, v, cu_q, cu_k, 300, 300, causal=True)

    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(q, k, v, cu_q, cu_k), f(q, k, v, cu_q, cu_k))
    torch.library.opcheck(torch.ops.flash3.fwd_varlen.default,
                          (q, k, v, cu_q, cu_k, None, None, 300, 300, 1 / math.sqrt(d), True, False))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    compiled(qg, kg, vg, cu_q, cu_k).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (qg, kg, vg))


def test_cuda_graph_replay_new_lengths():
    """Captured once, replayed with other lengths of the same totals and maxima."""
    d, dtype = 128, torch.bfloat16
    _skip_unless_built("fwd", dtype, d, True)
    lens_a, lens_b = [100, 400, 12], [400, 12, 100]
    q, k, v, cu_q, cu_k = _packed(9, lens_a, lens_a, 4, 4, d, dtype)
    static_cu = cu_q.clone()
    flash3.attention_varlen(q, k, v, static_cu, static_cu, 400, 400, causal=True)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash3.attention_varlen(q, k, v, static_cu, static_cu, 400, 400, causal=True)
    for lens in (lens_b, lens_a):
        static_cu.copy_(_cu(lens))
        graph.replay()
        torch.cuda.synchronize()
        want = flash3.attention_varlen(q, k, v, static_cu.clone(), static_cu.clone(), 400, 400, causal=True)
        assert torch.equal(out, want)
