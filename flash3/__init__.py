"""flash3: FlashAttention-3-class fused attention kernels for NVIDIA Hopper (H100, H200).

    import flash3
    out = flash3.attention(q, k, v, causal=True)   # q, k, v: (batch, seqlen, nheads, headdim)
    out = flash3.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
                                                   # packed: (total_tokens, nheads, headdim)
    out = flash3.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens)
                                                   # decoding: append to a (paged) KV cache, attend

``flash3.fp8`` is the FP8 (e4m3) path: ``flash3.fp8.attention(q, k, v, causal=True)`` on bf16
tensors (fused quantiser with block scales and incoherent processing, then the FP8 kernel).

``flash3.reference`` holds PyTorch references (a float64 softmax(QK^T)V and the kernel's
blockwise running-softmax loop) that run anywhere.

``flash3.flash_attn_interface`` is FlashAttention-3's Python interface (``flash_attn_func``,
``flash_attn_varlen_func``, ...) on these kernels: code written for FlashAttention-3 switches
with ``from flash3.flash_attn_interface import flash_attn_func``.

``flash3.integrations.transformers.register()`` makes flash3 an attention backend of Hugging
Face transformers (imported on first use; transformers is optional).
"""
from . import flash_attn_interface, fp8, reference
from ._version import __version__
from .interface import (
    SUPPORTED_DTYPES,
    SUPPORTED_HEADDIM_PAIRS,
    SUPPORTED_HEADDIMS,
    KernelNotBuiltError,
    attention,
    build_info,
    is_supported,
)
from .kvcache import attention_with_kvcache
from .varlen import attention_varlen


def __getattr__(name):
    # flash3.integrations is imported on first use only (its modules import optional packages
    # lazily, but there is no reason to pay for them at `import flash3`).
    if name == "integrations":
        import importlib

        return importlib.import_module(".integrations", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "fp8",
    "flash_attn_interface",
    "build_info",
    "is_supported",
    "reference",
    "KernelNotBuiltError",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEADDIM_PAIRS",
    "SUPPORTED_HEADDIMS",
    "__version__",
]
