"""FP8 (e4m3) attention: quantisation and the FP8 forward kernel.

    import flash3.fp8
    out = flash3.fp8.attention(q, k, v, causal=True)          # bf16 in, bf16 out

    # or in two steps (e.g. to keep the quantised K/V of a cache):
    t = flash3.fp8.quantize(q, k, v)                         # fused CUDA kernel
    out = flash3.fp8.attention_fp8(t.q, t.k, t.v, t.q_scale, t.k_scale, t.v_scale, causal=True)

Three accuracy measures, all applied before the kernel sees the data and undone inside it:

* **Block quantisation.** One float32 scale per block of 64 query rows (``Q_BLOCK``) and per
  128 keys (``K_BLOCK``) of each head, ``x ~= x8 * scale`` with ``scale = amax / 448``. The
  kernel folds ``q_scale * k_scale`` of each key block into the softmax scale, and V's
  scale into the exponent (P carries it; cost: none per element), so that a key tile may
  span scale blocks.
* **Incoherent processing.** Q and K are both multiplied by ``M = diag(s) H / sqrt(d)``
  (``s`` random signs, ``H`` the Sylvester Hadamard matrix) along the head dim. ``M`` is
  orthogonal, so ``(Q M)(K M)^T = Q K^T``; the rotation spreads an outlier channel over all
  channels, so the block's amax (and the quantisation step) shrinks.
* **Per-tensor** scales (FlashAttention-3's ``descale``) are accepted for comparison and
  drop-in use: ``attention_fp8`` takes scale tensors of shape ``(batch, nheads_k)`` too.

The PyTorch functions here (``quantize_ref``, ``emulate``) run anywhere and are the
specification the CUDA kernels are tested against.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .interface import _C, _check_options, _fail, _mask_kind

E4M3_MAX = 448.0
Q_BLOCK = 64  # query rows per Q scale (csrc/flash3/params_fp8.h: kScaleBlockQ)
K_BLOCK = 128  # keys per K and V scale (kScaleBlockK)
SUPPORTED_HEADDIMS = (64, 128, 256)
# P is computed as 2**P_OFFSET times its value before the cast to e4m3 (see csrc/flash3/softmax_fp8.h).
P_OFFSET = 8


# The ops this build registered (a build without e4m3 has none of them), and its FP8
# kernels as (hdim, mask), looked up once: plain Python values, which torch.compile
# reads as constants when it traces attention().
_OPS = frozenset(
    name for name in ("fwd_fp8", "quantize_fp8", "fp8_kernels") if _C is not None and hasattr(torch.ops.flash3, name)
)
_BUILT = (
    tuple(zip(*torch.ops.flash3.fp8_kernels())) if "fp8_kernels" in _OPS else ()
)


def _has_op(name: str) -> bool:
    return name in _OPS


# Fake (meta) implementations: the ops' output shapes and dtypes (csrc/api_fp8.cpp), so that
# torch.compile(fullgraph=True) traces attention() and attention_fp8() without running them.
if "fwd_fp8" in _OPS:

    @torch.library.register_fake("flash3::fwd_fp8")
    def _fwd_fp8_fake(q, k, v, q_scale, k_scale, v_scale, softmax_scale, causal, window_left=-1, window_right=-1,
                      softcap=0.0, sinks=None):
        batch, seqlen_q, nheads, headdim = q.shape
        out = q.new_empty((batch, seqlen_q, nheads, headdim), dtype=torch.bfloat16)
        lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
        return out, lse


if "quantize_fp8" in _OPS:

    @torch.library.register_fake("flash3::quantize_fp8")
    def _quantize_fp8_fake(x, signs, block_rows):
        batch, seqlen, nheads, _ = x.shape
        out = x.new_empty(x.shape, dtype=torch.float8_e4m3fn)
        scale = x.new_empty((batch, nheads, (seqlen + block_rows - 1) // block_rows), dtype=torch.float32)
        return out, scale


def built_kernels() -> list[dict]:
    """The FP8 forward kernels this build holds: ``[{"hdim", "mask"}]``, mask "none",
    "causal" or "local" (sliding windows, softcap and sinks)."""
    return [{"hdim": hdim, "mask": mask} for hdim, mask in _BUILT]


def is_supported(hdim: int, causal: bool = False, mask: str | None = None) -> bool:
    """Whether this build holds the FP8 forward kernel for ``hdim`` and ``mask`` (default:
    "causal" if ``causal`` else "none")."""
    mask = mask or ("causal" if causal else "none")
    return (int(hdim), mask) in _BUILT


# ----------------------------------------------------------------------------------------
# Quantisation math (PyTorch)
# ----------------------------------------------------------------------------------------


def hadamard(d: int, *, dtype=torch.float32, device=None) -> torch.Tensor:
    """The Sylvester Hadamard matrix H_d (entries +-1, H[i, j] = (-1)^popcount(i & j)),
    unnormalised; ``H @ H.T == d * I``."""
    if d <= 0 or d & (d - 1):
        raise ValueError(f"hadamard: d is {d}; supported: a power of two")
    idx = torch.arange(d, device=device)
    bits = torch.bitwise_and(idx[:, None], idx[None, :])
    parity = torch.zeros_like(bits)
    while bool((bits > 0).any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(dtype)


def random_signs(d: int, seed: int = 0, *, device=None) -> torch.Tensor:
    """A float32 vector of ``d`` random +-1 (deterministic in ``seed``, device independent)."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (d,), generator=g).float() * 2 - 1
    return signs.to(device) if device is not None else signs


_device_signs: dict = {}


@torch.compiler.assume_constant_result
def _signs_values(d: int, seed: int) -> tuple:
    """``random_signs(d, seed)`` as Python floats: torch.compile runs this once, when it
    traces, and keeps the result as a constant (it cannot trace the torch.Generator)."""
    return tuple(random_signs(d, seed).tolist())


def _cached_signs(d: int, seed: int, device) -> torch.Tensor:
    """``random_signs(d, seed)`` on ``device``, built once per (d, seed, device) and never
    handed out. Building them on the host and copying them on every call stalled the
    stream (a copy from pageable memory waits for the stream's work): it cost 27-36 us
    per ``quantize`` call on the H200, a quarter of the quantiser's time. Under
    torch.compile they are a constant of the graph."""
    if torch.compiler.is_compiling():
        return torch.tensor(_signs_values(d, seed), dtype=torch.float32, device=device)
    key = (d, seed, torch.device(device))
    signs = _device_signs.get(key)
    if signs is None:
        signs = random_signs(d, seed, device=device)
        _device_signs[key] = signs
    return signs


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``x @ diag(signs) @ H / sqrt(d)`` along the last dim, in float32 (float64 input stays
    float64). Applied to both Q and K it leaves Q K^T unchanged."""
    d = x.shape[-1]
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = hadamard(d, dtype=dtype, device=x.device) / math.sqrt(d)
    return (x.to(dtype) * signs.to(x.device, dtype)) @ h


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    # An all-zero block gets scale 1 (the kernel divides neighbouring V scales).
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def _inv_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    # x8 = x * (448 / amax), as the CUDA quantiser computes it (a multiply, not a divide by
    # the scale: the two round differently for ~0.2% of bf16 inputs).
    return torch.where(amax > 0, E4M3_MAX / amax, torch.ones_like(amax))


def quantize_ref(x: torch.Tensor, block_rows: int, signs: torch.Tensor | None = None, *, per_tensor: bool = False):
    """Quantise ``x`` (batch, seqlen, nheads, headdim) to e4m3, PyTorch reference.

    Returns ``(x8, scale)``: ``x8`` float8_e4m3fn like ``x``; ``scale`` float32
    ``(batch, nheads, ceil(seqlen / block_rows))`` with ``x ~= x8 * scale`` per block
    (after the rotation when ``signs`` is given). ``per_tensor``: one scale for the whole
    tensor (returned expanded to the same shape, stride 0).
    """
    b, s, h, d = x.shape
    xf = rotate(x, signs) if signs is not None else x.float()
    nblk = -(-s // block_rows)
    if per_tensor:
        amax = xf.abs().amax().float()
        scales = _scale_from_amax(amax).reshape(1, 1, 1).expand(b, h, nblk)
        return (xf * _inv_scale_from_amax(amax)).to(torch.float8_e4m3fn), scales
    pad = nblk * block_rows - s
    xp = torch.nn.functional.pad(xf, (0, 0, 0, 0, 0, pad)) if pad else xf
    amax = xp.reshape(b, nblk, block_rows, h, d).abs().amax(dim=(2, 4))  # (b, nblk, h)
    amax = amax.float()
    scales = _scale_from_amax(amax).permute(0, 2, 1).contiguous()  # (b, h, nblk)
    inv = _inv_scale_from_amax(amax).repeat_interleave(block_rows, dim=1)[:, :s, :, None]  # (b, s, h, 1)
    return (xf * inv).to(torch.float8_e4m3fn), scales


def dequantize(x8: torch.Tensor, scale: torch.Tensor, block_rows: int) -> torch.Tensor:
    """float64 ``x8 * scale`` with ``scale`` (batch, nheads, blocks), any strides."""
    s = x8.shape[1]
    per_row = scale.permute(0, 2, 1).double().repeat_interleave(block_rows, dim=1)[:, :s, :, None]
    return x8.double() * per_row


class FP8Tensors(NamedTuple):
    """Quantised q, k, v (float8_e4m3fn, shapes of the inputs) and their float32 scales
    ``q_scale (batch, nheads, ceil(seqlen_q / 64))``, ``k_scale``/``v_scale``
    ``(batch, nheads_k, ceil(seqlen_k / 128))``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor


def quantize(q, k, v, *, incoherent: bool = True, per_tensor: bool = False, signs=None, seed: int = 0,
             use_kernel: bool | None = None) -> FP8Tensors:
    """Quantise bf16 q, k, v for :func:`attention_fp8`.

    Args:
        q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
        incoherent: rotate q and k by ``diag(signs) H / sqrt(d)`` first (v is not rotated).
        per_tensor: one scale per tensor (the FlashAttention-3 baseline) instead of blocks;
            PyTorch only.
        signs: the +-1 vector of the rotation (default ``random_signs(d, seed)``).
        use_kernel: the fused CUDA kernel (one pass: rotation, block amax, cast); default:
            when the inputs are bf16 CUDA tensors and the kernel is built.
    """
    d = q.shape[-1]
    if d not in SUPPORTED_HEADDIMS:
        raise ValueError(f"flash3.fp8.quantize: headdim is {d}; supported: 64, 128, 256")
    if incoherent and signs is None:
        signs = _cached_signs(d, seed, q.device)
    if not incoherent:
        signs = None
    if use_kernel is None:
        use_kernel = (not per_tensor and q.is_cuda and q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16
                      and v.dtype == torch.bfloat16 and _has_op("quantize_fp8"))
    if use_kernel:
        if per_tensor:
            raise ValueError("flash3.fp8.quantize: the CUDA quantiser does block scales only (per_tensor=False)")
        q8, qs = torch.ops.flash3.quantize_fp8(q, signs, Q_BLOCK)
        k8, ks = torch.ops.flash3.quantize_fp8(k, signs, K_BLOCK)
        v8, vs = torch.ops.flash3.quantize_fp8(v, None, K_BLOCK)
    else:
        q8, qs = quantize_ref(q, Q_BLOCK, signs, per_tensor=per_tensor)
        k8, ks = quantize_ref(k, K_BLOCK, signs, per_tensor=per_tensor)
        v8, vs = quantize_ref(v, K_BLOCK, None, per_tensor=per_tensor)
    return FP8Tensors(q8, k8, v8, qs, ks, vs)


def _expand_scale(scale, name, batch, heads, heads_k, seqlen, block_rows, device):
    """Accepts (batch, heads, blocks) block scales, FlashAttention-3 descales
    (batch, heads_k), a per-head (heads,) or a scalar; returns a (batch, heads, blocks)
    float32 view (zero strides where the scale repeats)."""
    nblk = -(-seqlen // block_rows)
    if scale is None:
        scale = torch.ones((), device=device)
    scale = torch.as_tensor(scale, dtype=torch.float32, device=device)
    if scale.dim() == 3:
        if tuple(scale.shape) != (batch, heads, nblk):
            raise ValueError(f"flash3.fp8: {name}.shape is {tuple(scale.shape)}; supported: "
                             f"({batch}, {heads}, {nblk}) block scales or ({batch}, {heads_k}) descales")
        return scale
    if scale.dim() == 2:
        if scale.shape[0] != batch or scale.shape[1] not in (heads, heads_k):
            raise ValueError(f"flash3.fp8: {name}.shape is {tuple(scale.shape)}; supported: ({batch}, {heads_k})")
        if scale.shape[1] != heads:
            scale = scale.repeat_interleave(heads // scale.shape[1], dim=1)
        return scale[:, :, None].expand(batch, heads, nblk)
    if scale.dim() <= 1 and scale.numel() == 1:
        return scale.reshape(1, 1, 1).expand(batch, heads, nblk)
    raise ValueError(f"flash3.fp8: {name}.shape is {tuple(scale.shape)}; supported: block scales "
                     f"({batch}, {heads}, {nblk}), descales ({batch}, {heads_k}) or a scalar")


def attention_fp8(q8, k8, v8, q_scale=None, k_scale=None, v_scale=None, *, causal: bool = False,
                  softmax_scale: float | None = None, window_size=(-1, -1), softcap: float = 0.0, sinks=None,
                  return_lse: bool = False):
    """softmax(Q K^T * softmax_scale) V with e4m3 q, k, v; bf16 output.

    ``Q = q8 * q_scale`` etc. Scales are block scales from :func:`quantize`
    (``(batch, nheads, ceil(seqlen_q / 64))`` for q, ``(batch, nheads_k, ceil(seqlen_k / 128))``
    for k and v), FlashAttention-3-style descales ``(batch, nheads_k)`` (the q descale is
    indexed by the K/V head of each query head, as in FlashAttention-3), or scalars.
    Causal masking is bottom-right aligned as in :func:`flash3.attention`; GQA when
    nheads % nheads_k == 0. ``window_size``, ``softcap`` and ``sinks`` are those of
    :func:`flash3.attention`, applied to the dequantised scores (softcap:
    ``softcap * tanh(softmax_scale * q.k / softcap)``); they run the "local" kernel. The
    FP8 forward has no backward: sinks that require a gradient are refused while
    autograd records. Returns ``out`` (bf16) or ``(out, lse)``.
    """
    fn = "flash3.fp8.attention_fp8"
    for name, t in (("q", q8), ("k", k8), ("v", v8)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float8_e4m3fn:
            raise TypeError(f"flash3.fp8.attention_fp8: {name} must be a torch.float8_e4m3fn tensor, "
                            f"got {getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() != 4:
            raise ValueError(f"flash3.fp8.attention_fp8: {name}.dim() is {t.dim()}; supported: 4")
    b, sq, h, d = q8.shape
    sk, hk = k8.shape[1], k8.shape[2]
    if d not in SUPPORTED_HEADDIMS:
        raise ValueError(f"flash3.fp8.attention_fp8: headdim is {d}; supported: 64, 128, 256")
    if hk == 0 or h % hk:
        raise ValueError(f"flash3.fp8.attention_fp8: nheads_k is {hk}; supported: a divisor of nheads ({h})")
    if not isinstance(causal, bool):
        raise TypeError(f"flash3.fp8.attention_fp8: causal is {type(causal).__name__}; supported: bool")
    left, right, softcap = _check_options(fn, q8, window_size, softcap, sinks)
    if sinks is not None and sinks.requires_grad and torch.is_grad_enabled():
        _fail(ValueError, "sinks.requires_grad", True,
              "False, or a call under torch.no_grad(): the FP8 forward has no backward", fn)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    if not q8.is_cuda:
        raise TypeError("flash3.fp8.attention_fp8: q.device is cpu; supported: CUDA tensors on a Hopper GPU")
    if not _has_op("fwd_fp8"):
        raise RuntimeError("flash3.fp8.attention_fp8: this build has no FP8 kernels (FLASH3_DTYPES without e4m3)")
    if sinks is not None:
        if sinks.device != q8.device:
            _fail(TypeError, "sinks.device", sinks.device, f"the device of q ({q8.device})", fn)
        sinks = sinks.float().contiguous()
    mask = _mask_kind(causal, (left, right), softcap, sinks, sq, sk)
    if not is_supported(d, mask=mask):
        raise ValueError(f"{fn}: the FP8 kernel for headdim {d}, mask {mask} was not "
                         f"built; this build holds {built_kernels()}")
    dev = q8.device
    if q_scale is not None and torch.as_tensor(q_scale).dim() == 2 and torch.as_tensor(q_scale).shape[1] == hk:
        # FlashAttention-3's q_descale is per K/V head.
        q_scale = torch.as_tensor(q_scale, dtype=torch.float32, device=dev).repeat_interleave(h // hk, dim=1)
    qs = _expand_scale(q_scale, "q_scale", b, h, hk, sq, Q_BLOCK, dev)
    ks = _expand_scale(k_scale, "k_scale", b, hk, hk, sk, K_BLOCK, dev)
    vs = _expand_scale(v_scale, "v_scale", b, hk, hk, sk, K_BLOCK, dev)
    out, lse = torch.ops.flash3.fwd_fp8(q8, k8, v8, qs, ks, vs, float(softmax_scale), causal, left, right, softcap,
                                        sinks)
    return (out, lse) if return_lse else out


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, window_size=(-1, -1),
              softcap: float = 0.0, sinks=None, incoherent: bool = True, seed: int = 0, return_lse: bool = False):
    """End-to-end FP8 attention on bf16 q, k, v: :func:`quantize` (fused kernel, block
    scales, incoherent processing unless ``incoherent=False``) then :func:`attention_fp8`."""
    t = quantize(q, k, v, incoherent=incoherent, seed=seed)
    return attention_fp8(t.q, t.k, t.v, t.q_scale, t.k_scale, t.v_scale, causal=causal,
                         softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, sinks=sinks,
                         return_lse=return_lse)


# ----------------------------------------------------------------------------------------
# Emulation (PyTorch, float64): what an exact FP8 kernel computes from the quantised inputs
# ----------------------------------------------------------------------------------------


def emulate(t: FP8Tensors, *, causal: bool = False, softmax_scale: float | None = None, window_size=(-1, -1),
            softcap: float = 0.0, sinks=None, round_p: bool = True, heads_per_chunk: int = 4) -> torch.Tensor:
    """float64 attention of the dequantised inputs, with P rounded to e4m3 as the kernel
    does: V's scale is folded into the exponent, ``P = exp(s - max_w) * v_scale * 2**8``
    with ``max_w`` the row max of ``s + log(v_scale)``, cast to e4m3 and multiplied by the
    raw e4m3 V; the row sum adds the unrounded ``P / v_scale`` (csrc/flash3/softmax_fp8.h). The
    row max is the whole row's, not the kernel's running one. ``window_size``, ``softcap``
    and ``sinks`` as in :func:`flash3.reference.attention_ref` (a sink joins the row sum
    with no value). Returns (b, sq, h, d)."""
    from .reference import window_mask

    q = dequantize(t.q, t.q_scale, Q_BLOCK)
    k = dequantize(t.k, t.k_scale, K_BLOCK)
    v8 = t.v.double()
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    # V's scale per key, (b, sk, hk); a zero scale is taken as 2^-64, as in the kernel.
    v_key = t.v_scale.permute(0, 2, 1).double().repeat_interleave(K_BLOCK, dim=1)[:, :sk].clamp_min(2.0**-64)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    if hk != h:
        k = k.repeat_interleave(h // hk, dim=2)
        v8 = v8.repeat_interleave(h // hk, dim=2)
        v_key = v_key.repeat_interleave(h // hk, dim=2)
    log_v = v_key.log().permute(0, 2, 1)[:, :, None, :]  # (b, h, 1, sk)
    windowed = causal or tuple(window_size) != (-1, -1)
    mask = window_mask(sq, sk, tuple(window_size), causal, device=q.device) if windowed else None
    sink = None if sinks is None else sinks.double().to(q.device).view(1, -1, 1, 1)
    out = torch.empty(b, sq, h, d, dtype=torch.float64, device=q.device)
    for h0 in range(0, h, heads_per_chunk):
        hs = slice(h0, min(h, h0 + heads_per_chunk))
        s = torch.einsum("bqhd,bkhd->bhqk", q[:, :, hs], k[:, :, hs]) * softmax_scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        w = s + log_v[:, hs]
        m = w.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(w - m) * 2.0**P_OFFSET
        denom = (p * torch.exp(-log_v[:, hs])).sum(dim=-1, keepdim=True)
        if sink is not None:
            denom = denom + torch.exp(sink[:, hs] - m) * 2.0**P_OFFSET
        if round_p:
            p = p.to(torch.float8_e4m3fn).double()
        o = torch.einsum("bhqk,bkhd->bqhd", p, v8[:, :, hs]) / denom.permute(0, 2, 1, 3).clamp_min(1e-300)
        out[:, :, hs] = o
    return out
