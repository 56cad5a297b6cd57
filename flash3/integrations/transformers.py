"""flash3 as an attention backend of Hugging Face transformers (5.x).

    import torch
    from transformers import AutoModelForCausalLM
    from flash3.integrations import transformers as flash3_hf

    name = flash3_hf.register()              # "hopper_attention"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                 attn_implementation=name).to("cuda")
    # or, on a loaded model: model.set_attn_implementation("hopper_attention")

transformers is optional: this module imports without it, and :func:`register` raises
ImportError saying what is missing.

**The name.** flash3 registers as ``"hopper_attention"``, not ``"flash3"``. transformers
treats every implementation whose name contains "flash" as one of its FlashAttention
flavours and loads it through its own FlashAttention loader (transformers 5.x):

* ``utils/generic.py``, ``is_flash_attention_requested``:
  ``return "flash" in checked_attention_implementation``;
* ``modeling_utils.py``, ``PreTrainedModel._check_and_adjust_attn_implementation``:
  ``if is_flash_attention_requested(requested_attention_implementation=applicable_attn_implementation):
  lazy_import_flash_attention(applicable_attn_implementation)``;
* ``modeling_flash_attention_utils.py``, ``_lazy_imports``: a name other than
  ``flash_attention_2/3/4`` is looked up as a Hub kernel repository
  (``load_and_register_attn_kernel``, which returns None for a name without "/"), so
  ``model.set_attn_implementation("flash3")`` fails with "Could not find the currently
  requested flash attention implementation at `flash3`".

transformers has no supported way to opt a registered function out of that loader (its
state lives in private module globals), so flash3 uses a name without "flash" (and
without "sdpa" or "flex_attention", which transformers also treats specially); the
attention function and its mask function are registered through the public
``AttentionInterface.register`` and ``AttentionMaskInterface.register``.

**What the attention function does.** It receives transformers' (batch, heads, seq,
head_dim) tensors and hands flash3 (batch, seq, heads, head_dim) views of them (a
transpose, no copy; the kernels read those strides directly), with GQA/MQA K/V as they
are (no ``repeat_kv``), causal from ``is_causal`` or ``module.is_causal`` (bottom-right
aligned, so decoding with a KV cache needs no offset):

* no padding: :func:`flash3.attention` (dense kernels; other head dims through
  :func:`flash3.flash_attn_interface.flash_attn_func`, which zero-pads them);
* a 2-D padding mask (from the registered mask function, which passes the model's
  ``attention_mask`` through when it holds padding, as transformers' FlashAttention mask
  does): the tokens are gathered into packed tensors with ``cu_seqlens`` and run by
  :func:`flash3.attention_varlen`, and the output is scattered back (padded rows are 0);
* packed sequences (batch 1, ``position_ids`` restarting, or ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` given): :func:`flash3.attention_varlen` on the packed tokens;
* static caches (keys longer than the tokens written so far): the unused slots are cut.

Sliding windows (``sliding_window``: a query sees itself and the ``sliding_window - 1``
keys before it, passed on as ``window_size=(sliding_window - 1, sliding_window - 1)`` with
causal masking, i.e. the window ``(sliding_window - 1, 0)``, as transformers' own
FlashAttention path does; nothing when the window covers every key), ``softcap`` (Gemma 2)
and attention sinks (``s_aux``, gpt-oss: one logit per query head) run flash3's local-mask
kernels, on every path above (dense, padded, packed; bf16 and fp16, forward and backward).

A V head dim of its own runs where flash3 has the pair (192 for Q/K with 128 for V,
DeepSeek-V3-style attention).

Not supported yet (``NotImplementedError``): dropout > 0, 4-D (custom) attention masks,
other V head dims different from Q/K's. Mask patterns that
transformers builds beyond causal, padding and packing (chunked attention, bidirectional
image-token blocks) are not seen by this backend, as by transformers' own FlashAttention
backends. ``output_attentions`` is not available (None is returned for the weights).
"""
from __future__ import annotations

import os
import weakref

import torch

from ..flash_attn_interface import flash_attn_func, flash_attn_varlen_func
from ..interface import SUPPORTED_HEADDIM_PAIRS, SUPPORTED_HEADDIMS, attention

NAME = "hopper_attention"

__all__ = ["NAME", "register", "attention_forward", "padding_mask"]

_HALF = (torch.bfloat16, torch.float16)


def _check_name(name):
    if not isinstance(name, str) or not name:
        raise TypeError(f"flash3 transformers integration: name is {name!r}; supported: a non-empty str")
    lowered = name.lower()
    for word in ("flash", "sdpa", "flex_attention", "eager", "paged"):
        if word in lowered:
            raise ValueError(
                f"flash3 transformers integration: name {name!r} contains {word!r}, which transformers reserves for "
                f"its own implementations (a name containing 'flash' is sent to its FlashAttention loader); "
                f"use a name without it, e.g. {NAME!r}"
            )
    if any(c in name for c in "/:@|"):
        raise ValueError(f"flash3 transformers integration: name {name!r} contains one of '/:@|', which "
                         "transformers reads as a Hub kernel repository or a prefix")


def register(name: str = NAME) -> str:
    """Register flash3 with transformers' ``AttentionInterface`` (the attention function)
    and ``AttentionMaskInterface`` (its mask function) under ``name``; returns ``name``,
    the value for ``attn_implementation=``. Registering again replaces the functions."""
    _check_name(name)
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as exc:
        raise ImportError(
            "flash3.integrations.transformers.register() needs Hugging Face transformers 5.x "
            "(transformers.AttentionInterface and transformers.AttentionMaskInterface), which could not be "
            f"imported ({exc}); install it with `pip install 'transformers>=5'` (or `pip install flash3[transformers]`)"
        ) from exc
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name


# ----------------------------------------------------------------------------------------
# The mask function (AttentionMaskInterface)
# ----------------------------------------------------------------------------------------


def padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, device=None, **kwargs):
    """The mask handed to :func:`attention_forward`: None when every key is a token, else a
    (batch, keys) bool padding mask.

    As transformers' FlashAttention mask function: the model's 2-D ``attention_mask`` is
    cut to its last ``kv_length`` columns and passed on when it holds padding (or is
    shorter than the keys), None when it is all ones. Without a mask, a static cache
    (``kv_length`` slots, ``q_offset + q_length`` of them written) gets an all-ones mask
    over the written slots, so that the attention function cuts the unwritten ones.
    """
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            return None
        return attention_mask
    if isinstance(q_offset, torch.Tensor) or q_offset + q_length < kv_length:
        used = int(q_offset) + q_length
        if used < kv_length:
            return torch.ones(batch_size, used, dtype=torch.bool, device=device)
    return None


# ----------------------------------------------------------------------------------------
# The attention function (AttentionInterface)
# ----------------------------------------------------------------------------------------


def _unsupported(name, value, what):
    raise NotImplementedError(f"flash3 transformers attention: {name}={value!r}: {what} is not implemented in "
                              "flash3 yet; use attn_implementation='sdpa' or 'eager' for this model")


def _target_dtype(query, module):
    """bf16/fp16 for float32 inputs (layer norms kept in float32, e.g. by PEFT): the autocast
    dtype, else the model's half-precision weights' dtype; None to leave the inputs."""
    if query.dtype != torch.float32:
        return None
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear) and layer.weight.dtype in _HALF:
            return layer.weight.dtype
    return None


def _cu_seqlens(lengths):
    return torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))


# The last position_ids checked for packing and the answer: every layer of a forward pass
# gets the same tensor, so its values are read (a host sync) once per pass, not per layer.
# An in-place change bumps the tensor's version and is read again (writes through
# .data are not seen, as autograd does not see them). Tensors made under
# torch.inference_mode() have no version: they are read every time.
_packing_checked = (None, None, None)


def _packed_from_position_ids(position_ids, batch, q_len, k_len):
    """(cu_seqlens, max_seqlen) when batch 1 holds several sequences, each restarting its
    position_ids (as transformers' packed-sequence detection), else None."""
    global _packing_checked
    if (position_ids is None or batch != 1 or q_len == 1 or q_len != k_len or position_ids.dim() != 2
            or position_ids.shape[-1] != q_len):
        return None
    if position_ids.is_inference():
        return _find_packed_sequences(position_ids, q_len)
    checked, version, packed = _packing_checked
    if checked is not None and checked() is position_ids and version == position_ids._version:
        return packed
    packed = _find_packed_sequences(position_ids, q_len)
    _packing_checked = (weakref.ref(position_ids), position_ids._version, packed)
    return packed


def _find_packed_sequences(position_ids, q_len):
    pos = position_ids[0]
    restarts = (pos[1:] - pos[:-1]) != 1  # token i + 1 starts a sequence
    if not bool(restarts.any()):
        return None
    begin = restarts.nonzero().flatten() + 1
    cu = torch.cat([begin.new_tensor([0]), begin, begin.new_tensor([q_len])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _varlen_from_mask(q, k, v, mask, **common):
    """Attention of (batch, seq, heads, dim) q, k, v under a (batch, keys) padding mask,
    through the variable-length kernels; output (batch, q_len, heads, dim), 0 on padding."""
    batch, q_len, nheads, headdim = q.shape
    mask = mask.to(torch.bool)
    if k.shape[1] > mask.shape[1]:  # static cache: slots past the mask are not written yet
        k, v = k[:, : mask.shape[1]], v[:, : mask.shape[1]]
    elif k.shape[1] < mask.shape[1]:
        raise ValueError(f"flash3 transformers attention: the attention mask covers {mask.shape[1]} keys, "
                         f"the keys are {k.shape[1]}")
    if bool(mask.all()):
        return _dense(q, k, v, common)
    k_len = k.shape[1]
    lengths_k = mask.sum(dim=1, dtype=torch.int32)
    cu_k, max_k = _cu_seqlens(lengths_k), int(lengths_k.max())
    k_unpad, v_unpad = k[mask], v[mask]  # (total_k, nheads_k, dim), one gather each
    if q_len == 1:  # decoding: one query per sequence, the last token
        q_unpad = q[:, 0]
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
        out = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_q, cu_k, 1, max_k, **common)
        return out.unsqueeze(1)
    if q_len == k_len:
        mask_q, cu_q, max_q = mask, cu_k, max_k
    else:  # queries are the last q_len tokens (left padding), as in transformers' FlashAttention path
        mask_q = mask[:, -q_len:]
        lengths_q = mask_q.sum(dim=1, dtype=torch.int32)
        cu_q, max_q = _cu_seqlens(lengths_q), int(lengths_q.max())
    out = flash_attn_varlen_func(q[mask_q], k_unpad, v_unpad, cu_q, cu_k, max_q, max_k, **common)
    padded = out.new_zeros(batch, q_len, nheads, out.shape[-1])
    padded[mask_q] = out
    return padded


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers' attention interface on flash3: query (batch, heads, q_len, dim), key
    and value (batch, kv_heads, kv_len, dim), ``attention_mask`` from :func:`padding_mask`.
    Returns ``(attn_output (batch, q_len, heads, dim), None)``."""
    if dropout:
        _unsupported("dropout", dropout, "attention dropout")
    if attention_mask is not None and attention_mask.dim() != 2:
        _unsupported("attention_mask.dim()", attention_mask.dim(),
                     "a custom (4-D) attention mask; flash3 takes 2-D padding masks")
    if value.shape[-1] != key.shape[-1] and (key.shape[-1], value.shape[-1]) not in SUPPORTED_HEADDIM_PAIRS:
        _unsupported("value.shape[-1]", value.shape[-1], f"a V head dim different from the Q/K head dim "
                     f"({key.shape[-1]}) other than 192 with 128")

    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = (os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
                         or torch.are_deterministic_algorithms_enabled())
    common = dict(softmax_scale=scaling, causal=causal, deterministic=bool(deterministic))
    # transformers' sliding_window w: a query sees itself and the w - 1 keys before it
    # (masking_utils: kv_idx > q_idx - w). Its FlashAttention path
    # (modeling_flash_attention_utils.py, _process_flash_attention_kwargs) passes
    #     if ... sliding_window is not None and key_length > sliding_window:
    #         flash_kwargs["window_size"] = (sliding_window - 1, sliding_window - 1)
    # with causal, which FlashAttention turns into (w - 1, 0); the same here. A window at
    # least as long as the keys masks nothing and is not passed (as there); a module that
    # is not causal gets the symmetric window, as there.
    if sliding_window is not None and key.shape[2] > sliding_window:
        common["window_size"] = (sliding_window - 1, sliding_window - 1)
    if softcap is not None and softcap != 0:
        common["softcap"] = float(softcap)
    if kwargs.get("s_aux") is not None:
        common["learnable_sink"] = kwargs["s_aux"]

    # (batch, heads, seq, dim) -> (batch, seq, heads, dim): views, no copy
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    target = _target_dtype(q, module)
    if target is not None:
        q, k, v = q.to(target), k.to(target), v.to(target)
    batch, q_len, nheads, headdim = q.shape

    if attention_mask is not None:
        return _varlen_from_mask(q, k, v, attention_mask, **common), None

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is not None and cu_k is not None:  # padding-free batch with its offsets given
        max_q = int(max_q) if max_q is not None else None
        max_k = int(max_k) if max_k is not None else None
        out = flash_attn_varlen_func(q.reshape(-1, nheads, headdim), k.reshape(-1, *k.shape[2:]),
                                     v.reshape(-1, *v.shape[2:]), cu_q.to(torch.int32), cu_k.to(torch.int32),
                                     max_q, max_k, **common)
        return out.view(batch, -1, nheads, out.shape[-1]), None

    packed = _packed_from_position_ids(kwargs.get("position_ids"), batch, q_len, k.shape[1])
    if packed is not None:
        cu, max_len = packed
        out = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, max_len, max_len, **common)
        return out.unsqueeze(0), None

    return _dense(q, k, v, common), None


def _dense(q, k, v, common):
    """The dense call: flash3.attention for the head dims it runs as they are (one Python
    layer less per call), flash_attn_func for the others (it zero-pads them)."""
    if q.shape[-1] not in SUPPORTED_HEADDIMS:
        return flash_attn_func(q, k, v, **common)
    options = dict(common)
    sinks = options.pop("learnable_sink", None)
    return attention(q, k, v, sinks=sinks, **options)
