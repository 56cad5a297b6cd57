"""Argument handling, dispatch checks, autograd and torch.compile registration.

The compiled ops, registered with the PyTorch dispatcher by ``flash3._C``, are::

    fwd(q, k, v, softmax_scale, causal, deterministic=False, window_left=-1, window_right=-1,
        softcap=0.0, sinks=None) -> (out, lse)
    bwd(dout, q, k, v, out, lse, dlse, softmax_scale, causal, deterministic, window_left=-1,
        window_right=-1, softcap=0.0, sinks=None) -> (dq, dk, dv, dsinks)

(``sinks`` float32 ``(nheads,)``; ``dsinks`` float32 ``(nheads,)``, or ``(0,)`` without
sinks). This module validates arguments before any launch, gives the ops fake (meta)
implementations so that ``torch.compile(fullgraph=True)`` traces a call as one node, and
wires autograd (gradients to q, k, v, and to the sinks).
"""
from __future__ import annotations

import math

import torch

try:
    from . import _C  # noqa: F401  (loading it registers torch.ops.flash3)

    _C_IMPORT_ERROR = None
except ImportError as exc:  # no compiled extension: the reference still works
    _C = None
    _C_IMPORT_ERROR = exc

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_HEADDIMS = (64, 96, 128, 192, 256)
# (headdim of q and k, headdim of v) pairs besides the equal ones (DeepSeek-V3-style 192 / 128).
SUPPORTED_HEADDIM_PAIRS = ((192, 128),)
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class KernelNotBuiltError(ValueError):
    """The requested kernel exists in flash3 but was left out of this build."""


def build_info() -> dict:
    """What this installation holds: its kernels, CUDA and CUTLASS versions.

    ``kernels`` lists dicts ``{"kind", "dtype", "hdim", "hdim_v", "mask", "causal"}``:
    ``hdim`` is the head dim of q and k, ``hdim_v`` that of v and the output, ``mask`` is
    "none", "causal" or "local" (the kernel of sliding windows, softcap and attention
    sinks), ``causal`` is True for the "causal" mask only. Without the compiled extension
    the list is empty and ``error`` says why.
    """
    if _C is None:
        return {"kernels": [], "error": f"flash3._C failed to import: {_C_IMPORT_ERROR}"}
    return dict(_C.build_info())


_BUILT = None


def _built_kernels() -> frozenset:
    """(kind, dtype, hdim, hdim_v, mask) of every kernel in this build; mask is "none",
    "causal" or "local" (sliding windows, softcap and sinks)."""
    global _BUILT
    if _BUILT is None:
        _BUILT = frozenset(
            (k["kind"], k["dtype"], k["hdim"], k.get("hdim_v", k["hdim"]),
             k.get("mask", "causal" if k["causal"] else "none"))
            for k in build_info()["kernels"]
        )
    return _BUILT


def is_supported(kind: str, dtype, hdim: int, causal: bool, *, mask=None, hdim_v=None) -> bool:
    """True when this build holds the ``kind`` ("fwd" or "bwd") kernel for the arguments.

    ``dtype`` is a torch dtype or its short name ("bf16", "fp16"). ``mask`` ("none",
    "causal", "local") overrides ``causal``: "local" is the kernel that runs sliding
    windows, softcap and attention sinks. ``hdim_v``: the head dim of v (default ``hdim``).
    """
    name = _DTYPE_NAMES.get(dtype, dtype)
    if mask is None:
        mask = "causal" if causal else "none"
    hdim_v = hdim if hdim_v is None else hdim_v
    return (kind, name, int(hdim), int(hdim_v), mask) in _built_kernels()


def _fail(exc_type, name, value, supported, fn="flash3.attention"):
    raise exc_type(f"{fn}: {name} is {value}; supported: {supported}")


def _check_tensors(fn, q, k, v):
    """Types, dtypes and shapes of q, k, v: (batch, seqlen, nheads, headdim) for
    flash3.attention, (total, nheads, headdim) for a packed batch (3-D q)."""
    packed = fn != "flash3.attention"
    dims, layout = (3, "(total_tokens, nheads, headdim)") if packed else (4, "(batch, seqlen, nheads, headdim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, name, type(t).__name__, "a torch.Tensor", fn)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in SUPPORTED_DTYPES:
            _fail(TypeError, f"{name}.dtype", t.dtype, "torch.bfloat16, torch.float16", fn)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            _fail(TypeError, f"{name}.dtype", t.dtype, f"the dtype of q ({q.dtype})", fn)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != dims:
            _fail(ValueError, f"{name}.dim()", t.dim(), f"{dims}: {layout}", fn)
    nheads, headdim = q.shape[-2], q.shape[-1]
    if k.shape[:-1] != v.shape[:-1]:
        _fail(ValueError, "v.shape", tuple(v.shape), f"the shape of k {tuple(k.shape)} but for the head dim", fn)
    if not packed and k.shape[0] != q.shape[0]:
        _fail(ValueError, "k.shape[0] (batch)", k.shape[0], f"the batch of q ({q.shape[0]})", fn)
    if k.shape[-1] != headdim:
        _fail(ValueError, f"k.shape[{dims - 1}] (headdim)", k.shape[-1], f"the headdim of q ({headdim})", fn)
    if headdim not in SUPPORTED_HEADDIMS:
        _fail(ValueError, "headdim", headdim, ", ".join(map(str, SUPPORTED_HEADDIMS)), fn)
    headdim_v = v.shape[-1]
    if headdim_v != headdim and (headdim, headdim_v) not in SUPPORTED_HEADDIM_PAIRS:
        pairs = ", ".join(f"{d} with {dv}" for d, dv in SUPPORTED_HEADDIM_PAIRS)
        _fail(ValueError, f"v.shape[{dims - 1}] (headdim_v)", headdim_v,
              f"the headdim of q ({headdim}), or for q and k of one head dim, v of another: {pairs}", fn)
    nheads_k = k.shape[-2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        _fail(ValueError, "nheads_k", nheads_k, f"a divisor of nheads ({nheads}) (GQA/MQA)", fn)


def _check_flags(fn, causal, softmax_scale, deterministic=False):
    if not isinstance(causal, bool):
        _fail(TypeError, "causal", type(causal).__name__, "bool", fn)
    if not isinstance(deterministic, bool):
        _fail(TypeError, "deterministic", type(deterministic).__name__, "bool", fn)
    if softmax_scale is not None:
        if (
            isinstance(softmax_scale, bool)
            or not isinstance(softmax_scale, (int, float))
            or not math.isfinite(softmax_scale)
            or softmax_scale <= 0
        ):
            _fail(ValueError, "softmax_scale", softmax_scale, "a positive finite float, or None for 1/sqrt(headdim)",
                  fn)


def _check_devices(fn, q, others):
    """q on a Hopper GPU, the (name, tensor) pairs of others on its device, the extension loaded."""
    for name, t in (("q", q), *others[:2]):
        if t.device.type != "cuda":
            _fail(TypeError, f"{name}.device", t.device, "CUDA tensors on a Hopper GPU (sm_90)", fn)
    for name, t in others:
        if t.device != q.device:
            _fail(TypeError, f"{name}.device", t.device, f"the device of q ({q.device})", fn)
    if _C is None:
        raise RuntimeError(f"{fn}: the compiled extension flash3._C is missing ({_C_IMPORT_ERROR})")
    major, minor = torch.cuda.get_device_capability(q.device)
    if (major, minor) != (9, 0):
        _fail(TypeError, "q.device", f"{q.device} (sm_{major}{minor})", "Hopper GPUs (sm_90: H100, H200)", fn)


_WINDOW_CAP = 2**31 - 1


def _check_options(fn, q, window_size, softcap, sinks):
    """window_size a pair of ints >= -1, softcap a finite real >= 0, sinks None or a
    floating tensor of shape (nheads,)."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        _fail(TypeError, "window_size", repr(window_size), "a pair (left, right) of ints >= -1 (-1: unbounded)", fn)
    for name, value in (("window_size[0]", left), ("window_size[1]", right)):
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(TypeError, name, repr(value), "an int >= -1 (-1: unbounded)", fn)
        if value < -1:
            _fail(ValueError, name, value, "an int >= -1 (-1: unbounded)", fn)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        _fail(TypeError, "softcap", type(softcap).__name__, "a float >= 0 (0: off)", fn)
    if not math.isfinite(softcap) or softcap < 0:
        _fail(ValueError, "softcap", softcap, "a finite float >= 0 (0: off)", fn)
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            _fail(TypeError, "sinks", type(sinks).__name__, "None or a torch.Tensor of shape (nheads,)", fn)
        if not sinks.is_floating_point():
            _fail(TypeError, "sinks.dtype", sinks.dtype, "a floating dtype (cast to float32)", fn)
        nheads = q.shape[-2]
        if tuple(sinks.shape) != (nheads,):
            _fail(ValueError, "sinks.shape", tuple(sinks.shape), f"(nheads,) = ({nheads},)", fn)
    # A side reaching past every sequence is unbounded whatever its size; the cap keeps
    # Python ints of any size within the op's int64.
    return min(int(left), _WINDOW_CAP), min(int(right), _WINDOW_CAP), float(softcap)


def _mask_kind(causal, window, softcap, sinks, max_seqlen_q, max_seqlen_k):
    """The kernel a call runs, by FlashAttention-3's rules (as the binding applies them): a
    left window reaching past max_seqlen_k - 1 or a right one past max_seqlen_q - 1 is no
    window; causal is the window (-1, 0); any other window, softcap or sinks: "local"."""
    left, right = window
    left = -1 if left >= max_seqlen_k - 1 else left
    right = -1 if right >= max_seqlen_q - 1 else right
    if causal:
        right = 0
    is_causal = left < 0 and right == 0
    if (left >= 0 or right >= 0) and not is_causal or softcap > 0 or sinks is not None:
        return "local"
    return "causal" if is_causal else "none"


def _check_inputs(q, k, v, causal, softmax_scale, deterministic=False, window_size=(-1, -1), softcap=0.0,
                  sinks=None):
    """Every argument of flash3.attention; returns the options as the op takes them:
    (window_left, window_right, softcap)."""
    # Types, shapes and values first, devices last: every argument error is reported the
    # same way on a machine without a GPU.
    fn = "flash3.attention"
    _check_tensors(fn, q, k, v)
    _check_flags(fn, causal, softmax_scale, deterministic)
    options = _check_options(fn, q, window_size, softcap, sinks)
    _check_devices(fn, q, [("k", k), ("v", v)] + ([("sinks", sinks)] if sinks is not None else []))
    return options


def _hdims_name(hdim, hdim_v):
    return f"hdim{hdim}" if hdim == hdim_v else f"hdim{hdim}v{hdim_v}"


def _check_built(kind, q, causal, mask=None, fn="flash3.attention", v=None):
    dtype_name = _DTYPE_NAMES[q.dtype]
    headdim = q.shape[-1]
    headdim_v = headdim if v is None else v.shape[-1]
    mask = mask or ("causal" if causal else "none")
    if not is_supported(kind, dtype_name, headdim, causal, mask=mask, hdim_v=headdim_v):
        built = sorted(f"{d}/{_hdims_name(h, hv)}/{m}" for k, d, h, hv, m in _built_kernels() if k == kind)
        pass_name = {"fwd": "forward", "bwd": "backward"}[kind]
        what = f"headdim {headdim}" + (f", headdim_v {headdim_v}" if headdim_v != headdim else "")
        raise KernelNotBuiltError(
            f"{fn}: the {pass_name} kernel for dtype {dtype_name}, {what}, "
            f"mask {mask} was not built (FLASH3_HDIMS / FLASH3_DTYPES / FLASH3_KINDS at build time); "
            f"this build holds: {', '.join(built) or 'none'}"
        )


if _C is not None:

    @torch.library.register_fake("flash3::fwd")
    def _fwd_fake(q, k, v, softmax_scale, causal, deterministic=False, window_left=-1, window_right=-1,
                  softcap=0.0, sinks=None):
        batch, seqlen_q, nheads, _ = q.shape
        out = q.new_empty((batch, seqlen_q, nheads, v.shape[-1]))
        lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
        return out, lse

    def dsinks_like(q, sinks):
        """The sinks' gradient as the backward ops return it: float32 (nheads,), or (0,)."""
        return q.new_empty((0,) if sinks is None else tuple(sinks.shape), dtype=torch.float32)

    @torch.library.register_fake("flash3::bwd")
    def _bwd_fake(dout, q, k, v, out, lse, dlse, softmax_scale, causal, deterministic, window_left=-1,
                  window_right=-1, softcap=0.0, sinks=None):
        return (
            torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            dsinks_like(q, sinks),
        )

    # The gradient of flash3::fwd is registered in C++ (csrc/autograd.cpp).


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, sinks=None,
              return_lse=False, deterministic=False):
    """softmax(q k^T * softmax_scale) v, fused, on a Hopper GPU.

    Args:
        q: (batch, seqlen_q, nheads, headdim), torch.bfloat16 or torch.float16, CUDA.
        k, v: (batch, seqlen_k, nheads_k, headdim), same dtype and device. With
            nheads_k < nheads (GQA/MQA; nheads % nheads_k == 0) query head i uses K/V head
            i // (nheads // nheads_k), without copying K or V. v may have a head dim of
            its own where a kernel exists for the pair: headdim 192 with v's 128
            (DeepSeek-V3-style attention); the output then has v's head dim.
        causal: mask keys after the query, bottom-right aligned as in FlashAttention-2/3:
            query row i sees key j iff j <= i + seqlen_k - seqlen_q. For seqlen_q = 3,
            seqlen_k = 5 (1 = visible)::

                1 1 1 0 0
                1 1 1 1 0
                1 1 1 1 1

            With seqlen_q > seqlen_k the first rows see no key: their output is 0 and
            their lse -inf.
        softmax_scale: defaults to 1/sqrt(headdim); must be positive.
        window_size: (left, right) ints >= -1, sliding-window (local) attention as in
            FlashAttention, bottom-right aligned like ``causal``: query row i sees key j
            iff ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``;
            -1 leaves a side unbounded, (-1, -1) is no window, and ``causal`` sets the
            right side to 0 (so ``causal=True, window_size=(w, -1)`` is a causal sliding
            window: each row sees itself and the w keys before it). For
            seqlen_q = seqlen_k = 5 and window_size (2, 0) (1 = visible)::

                1 0 0 0 0
                1 1 0 0 0
                1 1 1 0 0
                0 1 1 1 0
                0 0 1 1 1

            A side reaching past the sequence (left >= seqlen_k - 1, right >=
            seqlen_q - 1) is unbounded, as in FlashAttention-3. Key tiles outside every
            row's window are skipped, so the cost follows the window. Rows whose window
            holds no key give output 0 and lse -inf.
        softcap: a float >= 0; if > 0, the scores become
            ``softcap * tanh(softmax_scale * q.k / softcap)`` before the softmax (Gemma 2);
            the lse is taken over those. 0 (the default) is off.
        sinks: None or a floating tensor of shape (nheads,) on q's device (used as
            float32): one logit per query head, in natural-log units, that joins every
            row's softmax denominator with no value (gpt-oss's attention sinks):
            ``out_i = sum_j exp(z_ij) v_j / (exp(sink) + sum_j exp(z_ij))``. The lse
            includes it (a row that sees no key then has lse = sink and output 0), and
            gradients flow to it.
        return_lse: also return the logsumexp, float32 (batch, nheads, seqlen_q), natural log.
            Gradients flow through it too.
        deterministic: make the backward pass bitwise reproducible (dq's partial sums
            are added in a fixed order; a little slower, see benchmarks/). The forward
            pass is deterministic either way.

    Returns:
        out (batch, seqlen_q, nheads, v's headdim), contiguous, or (out, lse) when
        return_lse.

    head dims 64, 96, 128, 192, 256 are supported, and 192 for q and k with 128 for v (see
    ``build_info()`` for what this build holds). A window (other than causal's), softcap or sinks run the "local"
    kernels, bf16 and fp16, forward and backward. Inputs whose layout TMA cannot read
    (last dim not contiguous, strides not multiples of 16 bytes) are copied to
    contiguous tensors first.
    """
    left, right, softcap = _check_inputs(q, k, v, causal, softmax_scale, deterministic, window_size, softcap, sinks)
    mask = _mask_kind(causal, (left, right), softcap, sinks, q.shape[1], k.shape[1])
    _check_built("fwd", q, causal, mask, v=v)
    grads = torch.is_grad_enabled() and (any(t.requires_grad for t in (q, k, v)) or
                                        (sinks is not None and sinks.requires_grad))
    if grads:
        _check_built("bwd", q, causal, mask, v=v)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if sinks is not None:
        sinks = sinks.float().contiguous()
    out, lse = torch.ops.flash3.fwd(q, k, v, float(softmax_scale), causal, deterministic, left, right, softcap,
                                    sinks)
    return (out, lse) if return_lse else out
