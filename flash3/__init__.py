"""flash3: FlashAttention-3-class fused attention kernels for NVIDIA Hopper (H100, H200).

    import flash3
    out = flash3.attention(q, k, v, causal=True)   # q, k, v: (batch, seqlen, nheads, headdim)
    out = flash3.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
                                                   # packed: (total_tokens, nheads, headdim)

``flash3.fp8`` is the FP8 (e4m3) path: ``flash3.fp8.attention(q, k, v, causal=True)`` on bf16
tensors (fused quantiser with block scales and incoherent processing, then the FP8 kernel).

``flash3.reference`` holds PyTorch references (a float64 softmax(QK^T)V and the kernel's
blockwise running-softmax loop) that run anywhere.
"""
from . import fp8, reference
from .interface import (
    SUPPORTED_DTYPES,
    SUPPORTED_HEADDIMS,
    KernelNotBuiltError,
    attention,
    build_info,
    is_supported,
)
from .varlen import attention_varlen

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_varlen",
    "fp8",
    "build_info",
    "is_supported",
    "reference",
    "KernelNotBuiltError",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEADDIMS",
    "__version__",
]
