"""The arguments of FlashAttention-3's signatures, checked and normalised for flash3
(flash_attn_interface.py): what flash3 does not run (NotImplementedError naming the
argument), FlashAttention-3's window semantics, the options passed on to flash3's calls,
and the head dims padded to one with kernels. No tensor is touched here but by padding."""
from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from .interface import SUPPORTED_HEADDIM_PAIRS

_E4M3 = torch.float8_e4m3fn


def _not_implemented(fname: str, name: str, value, what: str):
    shown = f"<tensor of shape {tuple(value.shape)}>" if isinstance(value, torch.Tensor) else repr(value)
    raise NotImplementedError(f"{fname}: {name}={shown}: {what} is not implemented in flash3 yet")


def _as_int(x, fname, name):
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_floating_point():
        return int(x.item())
    if isinstance(x, bool):
        raise TypeError(f"{fname}: {name} is bool; supported: an int")
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"{fname}: {name} is {type(x).__name__}; supported: an int") from None


def _window(fname, window_size, causal, seqlen_q, seqlen_k):
    """FlashAttention-3's window semantics: returns (causal, (left, right)).

    As in FlashAttention-3 (hopper/flash_api.cpp), a left window of at least seqlen_k - 1
    and a right window of at least seqlen_q - 1 are no window, causal forces the right
    window to 0, and (-1, 0) is the causal mask; what is left is a sliding window, which
    flash3.attention runs (the window (-1, -1) when there is none)."""
    if not isinstance(causal, bool):
        raise TypeError(f"{fname}: causal is {type(causal).__name__}; supported: bool")
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"{fname}: window_size is {window_size!r}; supported: a pair (left, right)") from None
    left = _as_int(left, fname, "window_size[0]")
    right = _as_int(right, fname, "window_size[1]")
    if seqlen_k is not None and left >= seqlen_k - 1:
        left = -1
    if seqlen_q is not None and right >= seqlen_q - 1:
        right = -1
    left = -1 if left < 0 else left
    right = -1 if right < 0 else right
    if causal:
        right = 0
    if left == -1 and right in (-1, 0):
        return right == 0, (-1, -1)
    return causal, (left, right)


def _options(fname, window, softcap, learnable_sink):
    """flash3.attention's (and flash3.fp8.attention_fp8's) keyword arguments for the
    window, softcap and sinks, only those that are not their defaults."""
    options = {}
    if window != (-1, -1):
        options["window_size"] = window
    if softcap is not None and softcap != 0:
        options["softcap"] = softcap
    if learnable_sink is not None:
        options["sinks"] = learnable_sink
    return options


def _check_common(fname, *, qv=None, softcap=0.0, attention_chunk=0, num_splits=1):
    if qv is not None:
        _not_implemented(fname, "qv", qv, "the extra qv operand (q k^T + qv v^T scores)")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))):
        raise TypeError(f"{fname}: softcap is {type(softcap).__name__}; supported: a float >= 0 (0: off)")
    if softcap is not None and not (softcap >= 0 and math.isfinite(softcap)):
        raise ValueError(f"{fname}: softcap is {softcap}; supported: a finite float >= 0 (0: off)")
    if isinstance(attention_chunk, bool) or not isinstance(attention_chunk, int) or attention_chunk != 0:
        _not_implemented(fname, "attention_chunk", attention_chunk, "chunked attention")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits not in (0, 1):
        _not_implemented(fname, "num_splits", num_splits, "split-KV")


def _check_learnable_sink(fname, learnable_sink, q):
    """learnable_sink: None or a floating tensor of shape (nheads,) (q's heads)."""
    if learnable_sink is None:
        return
    if not isinstance(learnable_sink, torch.Tensor):
        raise TypeError(f"{fname}: learnable_sink is {type(learnable_sink).__name__}; supported: None or a "
                        "torch.Tensor of shape (nheads,)")
    if not learnable_sink.is_floating_point():
        raise TypeError(f"{fname}: learnable_sink.dtype is {learnable_sink.dtype}; supported: a floating dtype "
                        "(float32 is used)")
    if isinstance(q, torch.Tensor) and q.dim() >= 2 and tuple(learnable_sink.shape) != (q.shape[-2],):
        raise ValueError(f"{fname}: learnable_sink.shape is {tuple(learnable_sink.shape)}; supported: (nheads,) = "
                         f"({q.shape[-2]},)")


def _check_v_headdim(fname, q, k, v):
    """v's head dim: q's, or one of the pairs with kernels of their own (192 with 128), in 16 bits."""
    if not (all(isinstance(t, torch.Tensor) for t in (q, k, v)) and k.shape[-1] == q.shape[-1] != v.shape[-1]):
        return
    if (q.shape[-1], v.shape[-1]) not in SUPPORTED_HEADDIM_PAIRS or q.dtype == _E4M3:
        pairs = ", ".join(f"{d} with {dv}" for d, dv in SUPPORTED_HEADDIM_PAIRS)
        _not_implemented(fname, "v.shape[-1]", v.shape[-1],
                         f"a V head dim different from the Q/K head dim ({q.shape[-1]}) other than "
                         f"{pairs} in bf16/fp16")


def _padded_headdim(d: int, supported) -> int:
    """The head dim flash3 runs for d: d itself if built, else the next supported one for
    multiples of 8 up to the largest (zero padding); other values are left to the
    argument checks of the kernel functions."""
    if d in supported or d <= 0 or d % 8 or d > max(supported):
        return d
    return min(s for s in supported if s >= d)


def _pad_last(t: torch.Tensor, width: int) -> torch.Tensor:
    pad = width - t.shape[-1]
    if pad == 0:
        return t
    if t.dtype == _E4M3:  # constant padding is not defined for float8: zero bytes are +0.0
        return F.pad(t.view(torch.uint8), (0, pad)).view(_E4M3)
    return F.pad(t, (0, pad))


def _is_tensor(*ts):
    return all(isinstance(t, torch.Tensor) for t in ts)
