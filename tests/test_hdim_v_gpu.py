"""GPU tests of a V head dim of its own: q and k of head dim 192, v (and the output) of
128, as DeepSeek-V3-style attention has them. Forward and backward against the float64
reference, dense and packed, with every mask kind (none, causal, windows, softcap,
sinks), GQA/MQA, odd sizes and the lse's gradient; the same tolerances as
test_masks_gpu.py and test_masks_varlen_gpu.py, whose checks these reuse."""
import pytest
import torch

import flash3
from test_masks_gpu import _check, _inputs, _run_flash3
from test_masks_varlen_gpu import check_varlen_options
from test_varlen_gpu import _cu

pytestmark = pytest.mark.gpu

D, DV = 192, 128

# (seqlen_q, seqlen_k, causal, window_size, softcap, sinks)
CASES = [
    (1, 1, False, (-1, -1), 0.0, False),
    (77, 300, True, (-1, -1), 0.0, False),
    (300, 77, True, (-1, -1), 0.0, False),  # rows that see no key
    (1000, 1000, False, (-1, -1), 0.0, False),
    (513, 1500, True, (-1, -1), 0.0, False),
    (2100, 2100, True, (-1, -1), 0.0, False),
    (640, 640, True, (127, 0), 0.0, True),
    (257, 1000, False, (17, 3), 0.0, False),
    (333, 700, False, (-1, -1), 5.0, False),
    (400, 100, True, (40, -1), 20.0, True),
]
CASE_IDS = [f"{sq}x{sk}-{'c' if c else 'f'}-w{w[0]}_{w[1]}-sc{int(sc)}-{'sink' if s else 'nosink'}"
            for sq, sk, c, w, sc, s in CASES]


def _mask(causal, window, softcap, sinks):
    if window != (-1, -1) or softcap or sinks:
        return "local"
    return "causal" if causal else "none"


def _skip_unless_built(dtype, mask):
    for kind in ("fwd", "bwd"):
        if not flash3.is_supported(kind, dtype, D, False, mask=mask, hdim_v=DV):
            pytest.skip(f"{kind} {dtype} hdim {D} with v's {DV}, mask {mask}: not in this build")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dense_matches_reference(seed, dtype, case):
    sq, sk, causal, window, softcap, with_sinks = case
    _skip_unless_built(dtype, _mask(causal, window, softcap, with_sinks))
    q, k, v, dout, sinks = _inputs(seed, 2, sq, sk, 4, 4, D, dtype, with_sinks, dv=DV)
    _check(q, k, v, dout, sinks, dict(causal=causal, window_size=window, softcap=softcap))


@pytest.mark.parametrize("hk", [1, 2], ids=["mqa", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_and_lse_gradient(seed, causal, hk):
    _skip_unless_built(torch.bfloat16, "causal" if causal else "none")
    q, k, v, dout, _ = _inputs(seed, 2, 601, 733, 6, hk, D, torch.bfloat16, False, dv=DV)
    _check(q, k, v, dout, None, dict(causal=causal), with_lse=True)


def test_deterministic_backward(seed):
    _skip_unless_built(torch.bfloat16, "causal")
    q, k, v, dout, _ = _inputs(seed, 2, 900, 900, 4, 2, D, torch.bfloat16, False, dv=DV)
    opts = dict(causal=True, deterministic=True)
    runs = [_run_flash3(q, k, v, dout, None, opts, False)[2] for _ in range(2)]
    for a, b in zip(*runs):
        if a is not None:
            assert torch.equal(a, b)
    _check(q, k, v, dout, None, opts)


OPTIONS = [
    dict(causal=False, window_size=(-1, -1), softcap=0.0, sinks=False),
    dict(causal=True, window_size=(-1, -1), softcap=0.0, sinks=False),
    dict(causal=True, window_size=(127, 0), softcap=0.0, sinks=True),
    dict(causal=False, window_size=(-1, -1), softcap=8.0, sinks=True),
]
OPTION_IDS = ["full", "causal", "causal-w127-sinks", "softcap-sinks"]


@pytest.mark.parametrize("lengths", ["short", "long"])
@pytest.mark.parametrize("opts", OPTIONS, ids=OPTION_IDS)
def test_varlen_matches_reference(seed, opts, lengths):
    _skip_unless_built(torch.bfloat16, _mask(opts["causal"], opts["window_size"], opts["softcap"], opts["sinks"]))
    check_varlen_options(seed, torch.bfloat16, D, DV, opts, lengths)


def test_output_shapes_compile_and_opcheck():
    """The output has v's head dim in the eager call, under torch.compile and in the ops'
    fake implementations."""
    _skip_unless_built(torch.bfloat16, "causal")
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(2, 130, 4, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, 150, 2, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, 150, 2, DV, device="cuda", dtype=torch.bfloat16, generator=g)
    out = flash3.attention(q, k, v, causal=True)
    assert out.shape == (2, 130, 4, DV)
    compiled = torch.compile(lambda q, k, v: flash3.attention(q, k, v, causal=True), fullgraph=True)
    assert torch.equal(compiled(q, k, v), out)
    args = (q, k, v, D ** -0.5, True)
    torch.library.opcheck(torch.ops.flash3.fwd.default, args, test_utils=("test_schema", "test_faketensor"))
    out, lse = torch.ops.flash3.fwd(*args)
    torch.library.opcheck(torch.ops.flash3.bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, None, D ** -0.5, True, False),
                          test_utils=("test_schema", "test_faketensor"))
    lens = [5, 130, 77]
    cu = _cu(lens)
    qp, kp, vp = (t[0, :1].expand(sum(lens), -1, -1).contiguous() for t in (q, k, v))
    args = (qp, kp, vp, cu, cu, None, None, 130, 130, D ** -0.5, False)
    torch.library.opcheck(torch.ops.flash3.fwd_varlen.default, args, test_utils=("test_schema", "test_faketensor"))
    assert torch.ops.flash3.fwd_varlen(*args)[0].shape == (sum(lens), 4, DV)
