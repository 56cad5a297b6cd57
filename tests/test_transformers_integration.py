"""Tests of flash3.integrations.transformers, flash3 as a Hugging Face transformers backend.

CPU tests without transformers: the module imports without it and register() says what is
missing; the name checks; the mask function; the attention function's glue (layout,
padding masks, decoding, packed sequences, static caches, unsupported arguments) with the
kernels replaced by the float64 reference.

With transformers installed (skipped otherwise): a small random Llama in float64 on CPU,
kernels replaced by the reference, must give the logits, loss, gradients and greedy
generations of "sdpa" (to rounding), through transformers' own dispatch (register,
set_attn_implementation, create_causal_mask, generate with dynamic and static caches).

On a Hopper GPU with transformers: the same model in bf16 on the real kernels against an
fp32 "sdpa" reference, within a small factor of bf16 "sdpa"'s own error.
"""
import importlib
import sys

import pytest
import torch

import flash3
from flash3 import flash_attn_interface as fai
from flash3.reference import attention_ref

MODULE = "flash3.integrations.transformers"


def _integration():
    return importlib.import_module(MODULE)


def _transformers_or_skip():
    return pytest.importorskip("transformers", reason="transformers is not installed")


# ----------------------------------------------------------------------------------------
# CPU, without transformers
# ----------------------------------------------------------------------------------------


def test_imports_without_transformers_and_register_says_what_is_missing(monkeypatch):
    import flash3.integrations

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    # a fresh import of the module (both restored afterwards)
    monkeypatch.delattr(flash3.integrations, "transformers", raising=False)
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    module = importlib.import_module(MODULE)
    assert module.NAME == "hopper_attention"
    with pytest.raises(ImportError, match=r"register\(\) needs Hugging Face transformers 5\.x .*pip install 'transformers>=5'"):
        module.register()


def test_integrations_are_imported_lazily():
    import flash3.integrations as integrations

    assert flash3.integrations is integrations
    assert integrations.transformers is _integration()


@pytest.mark.parametrize("name", ["flash3", "Flash3", "my_flash", "sdpa_f3", "flex_attention_x", "org/repo", "paged|x", ""])
def test_register_rejects_names_transformers_reserves(name):
    with pytest.raises((ValueError, TypeError)):
        _integration().register(name)


def test_padding_mask_function():
    padding_mask = _integration().padding_mask
    ones = torch.ones(2, 7, dtype=torch.bool)
    assert padding_mask(2, 7, 7, attention_mask=None) is None
    assert padding_mask(2, 7, 7, attention_mask=ones) is None
    left = ones.clone()
    left[0, :3] = False
    assert torch.equal(padding_mask(2, 7, 7, attention_mask=left), left)
    # decoding with a cache: the 2-D mask covers the keys, passed on (its last kv_length columns)
    assert torch.equal(padding_mask(2, 1, 7, q_offset=6, attention_mask=left), left)
    # static cache, no padding: all-ones over the written slots only
    m = padding_mask(2, 3, 16, q_offset=torch.tensor(4), attention_mask=None, device="cpu")
    assert m.shape == (2, 7) and bool(m.all())
    assert padding_mask(2, 3, 7, q_offset=4, attention_mask=None) is None


class _Attn(torch.nn.Module):
    def __init__(self, is_causal=True):
        super().__init__()
        self.is_causal = is_causal
        self.proj = torch.nn.Linear(4, 4, dtype=torch.float64)


@pytest.fixture
def cpu_kernels(monkeypatch):
    from test_flash_attn_interface import _reference_attention, _reference_varlen

    monkeypatch.setattr(fai, "_attention", _reference_attention)
    monkeypatch.setattr(_integration(), "attention", _reference_attention)  # its dense call
    monkeypatch.setattr(fai, "_attention_varlen", _reference_varlen)


def _bhsd(seed, b, h, hk, sq, sk, d=64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hk, sk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hk, sk, d, generator=g, dtype=torch.float64)
    return q, k, v


def _masked_reference(q, k, v, key_mask, causal, scale=None):
    """(b, h, s, d) inputs, (b, sk) key mask: per row, the valid keys, bottom-right causal
    over the valid ones; output (b, sq, h, d)."""
    b, h, sq, d = q.shape
    out = torch.zeros(b, sq, h, d, dtype=q.dtype)
    for i in range(b):
        keys = key_mask[i].nonzero().flatten()
        n_valid_q = min(sq, len(keys))
        rows = slice(sq - n_valid_q, sq)  # queries are the last tokens (left padding)
        o, _ = attention_ref(q[i:i + 1, :, rows].transpose(1, 2), k[i:i + 1, :, keys].transpose(1, 2),
                             v[i:i + 1, :, keys].transpose(1, 2), causal=causal, softmax_scale=scale)
        out[i, rows] = o[0]
    return out


def test_attention_forward_dense_gqa_layout(cpu_kernels):
    attention_forward = _integration().attention_forward
    q, k, v = _bhsd(0, 2, 4, 2, 9, 9)
    out, weights = attention_forward(_Attn(), q, k, v, None, scaling=0.2)
    assert weights is None and out.shape == (2, 9, 4, 64)
    ref, _ = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, softmax_scale=0.2)
    torch.testing.assert_close(out, ref)
    # is_causal from the kwarg wins over the module's
    out, _ = attention_forward(_Attn(), q, k, v, None, is_causal=False)
    torch.testing.assert_close(out, attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))[0])


@pytest.mark.parametrize("sq, sk", [(9, 9), (1, 12), (3, 12)], ids=["prefill", "decode", "chunk"])
def test_attention_forward_padding_mask(cpu_kernels, sq, sk):
    attention_forward = _integration().attention_forward
    q, k, v = _bhsd(1, 3, 4, 2, sq, sk)
    mask = torch.ones(3, sk, dtype=torch.bool)
    mask[0, :4] = False
    mask[2, :2] = False
    out, _ = attention_forward(_Attn(), q, k, v, mask)
    ref = _masked_reference(q, k, v, mask, causal=True)
    valid_q = mask[:, -sq:]
    torch.testing.assert_close(out[valid_q], ref[valid_q])
    assert (out[~valid_q] == 0).all()


def test_attention_forward_static_cache_slots_are_cut(cpu_kernels):
    attention_forward = _integration().attention_forward
    q, k, v = _bhsd(2, 2, 4, 2, 1, 16)
    k[:, :, 10:] = float("nan")  # slots not written yet
    v[:, :, 10:] = float("nan")
    mask = torch.ones(2, 10, dtype=torch.bool)
    out, _ = attention_forward(_Attn(), q, k, v, mask)
    ref, _ = attention_ref(q.transpose(1, 2), k[:, :, :10].transpose(1, 2), v[:, :, :10].transpose(1, 2), causal=True)
    torch.testing.assert_close(out, ref)
    mask[1, :3] = False
    out, _ = attention_forward(_Attn(), q, k, v, mask)
    torch.testing.assert_close(out, _masked_reference(q, k[:, :, :10], v[:, :, :10], mask, causal=True))


def test_attention_forward_packed_sequences(cpu_kernels):
    attention_forward = _integration().attention_forward
    q, k, v = _bhsd(3, 1, 4, 2, 12, 12)
    position_ids = torch.cat([torch.arange(5), torch.arange(7)])[None]
    out, _ = attention_forward(_Attn(), q, k, v, None, position_ids=position_ids)
    for s in (slice(0, 5), slice(5, 12)):
        ref, _ = attention_ref(q[:, :, s].transpose(1, 2), k[:, :, s].transpose(1, 2), v[:, :, s].transpose(1, 2),
                               causal=True)
        torch.testing.assert_close(out[:, s], ref)
    # the same through precomputed cu_seq_lens (padding-free collators)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out2, _ = attention_forward(_Attn(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7,
                                max_length_k=7)
    torch.testing.assert_close(out2, out)
    # one sequence: dense
    out3, _ = attention_forward(_Attn(), q, k, v, None, position_ids=torch.arange(12)[None])
    torch.testing.assert_close(out3, attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   causal=True)[0])


def test_packing_is_read_once_per_position_ids(cpu_kernels, monkeypatch):
    """Every layer of a forward pass gets the same position_ids: their values are read
    once; the same tensor changed in place, or another tensor, is read again."""
    integration = _integration()
    reads = []
    find = integration._find_packed_sequences
    monkeypatch.setattr(integration, "_find_packed_sequences", lambda *a: reads.append(1) or find(*a))
    q, k, v = _bhsd(4, 1, 4, 2, 12, 12)
    position_ids = torch.arange(12)[None]
    dense = [integration.attention_forward(_Attn(), q, k, v, None, position_ids=position_ids)[0] for _ in range(3)]
    assert len(reads) == 1
    position_ids[0, 5:] = torch.arange(7)  # in place: now two sequences
    packed, _ = integration.attention_forward(_Attn(), q, k, v, None, position_ids=position_ids)
    assert len(reads) == 2
    ref, _ = attention_ref(q[:, :, 5:].transpose(1, 2), k[:, :, 5:].transpose(1, 2), v[:, :, 5:].transpose(1, 2),
                           causal=True)
    torch.testing.assert_close(packed[:, 5:], ref)
    torch.testing.assert_close(packed[:, :5], dense[0][:, :5])
    integration.attention_forward(_Attn(), q, k, v, None, position_ids=torch.arange(12)[None])
    assert len(reads) == 3
    with torch.inference_mode():  # inference tensors have no version: read every time
        position_ids = torch.cat([torch.arange(5), torch.arange(7)])[None]
        for _ in range(2):
            out, _ = integration.attention_forward(_Attn(), q, k, v, None, position_ids=position_ids)
            torch.testing.assert_close(out, packed)
    assert len(reads) == 5


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(dropout=0.1), r"dropout=0\.1"),
], ids=["dropout"])
def test_attention_forward_unsupported(kwargs, pattern):
    q, k, v = _bhsd(4, 2, 4, 2, 9, 9)
    with pytest.raises(NotImplementedError, match=pattern + ".*not implemented in flash3 yet"):
        _integration().attention_forward(_Attn(), q, k, v, None, **kwargs)


def test_attention_forward_4d_mask_and_v_headdim_unsupported():
    attention_forward = _integration().attention_forward
    q, k, v = _bhsd(5, 2, 4, 2, 9, 9)
    with pytest.raises(NotImplementedError, match=r"attention_mask\.dim\(\)=4"):
        attention_forward(_Attn(), q, k, v, torch.ones(2, 1, 9, 9, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match=r"V head dim"):
        attention_forward(_Attn(), q, k, v[..., :32], None)


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_attention_forward_window_softcap_sinks(cpu_kernels, padded):
    """sliding_window w -> window (w - 1, w - 1) with causal (a query sees itself and the
    w - 1 keys before it), softcap -> softcap, s_aux -> sinks; dense and padded batches."""
    attention_forward = _integration().attention_forward
    q, k, v = _bhsd(8, 2, 4, 2, 9, 9)
    sinks = torch.randn(4, dtype=torch.float64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    if padded:
        mask[1, :3] = False  # left padding of the second sequence
    out, _ = attention_forward(_Attn(), q, k, v, mask if padded else None, sliding_window=4, softcap=20.0,
                               s_aux=sinks)
    for b in range(2):
        keep = mask[b]
        qb, kb, vb = (t[b:b + 1].transpose(1, 2)[:, keep] for t in (q, k, v))
        ref, _ = attention_ref(qb, kb, vb, causal=True, window_size=(3, 3), softcap=20.0, sinks=sinks)
        torch.testing.assert_close(out[b:b + 1, keep], ref.to(out.dtype))
        if padded:
            assert torch.all(out[b, ~keep] == 0)


def test_attention_forward_window_longer_than_keys_is_no_window(cpu_kernels):
    q, k, v = _bhsd(6, 2, 4, 2, 9, 9)
    out, _ = _integration().attention_forward(_Attn(), q, k, v, None, sliding_window=4096)
    out_ref, _ = _integration().attention_forward(_Attn(), q, k, v, None)
    torch.testing.assert_close(out, out_ref)


# ----------------------------------------------------------------------------------------
# With transformers: a small Llama through transformers' own dispatch
# ----------------------------------------------------------------------------------------


def _llama(dtype, device, seed=0):
    transformers = _transformers_or_skip()
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=1000, max_position_embeddings=512,
        initializer_range=0.1, pad_token_id=0,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def _set(model, impl):
    model.set_attn_implementation(impl)
    assert model.config._attn_implementation == impl
    return model


def _batch(device, b=3, s=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1000, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[0, :7] = 0  # left padding
    if b > 2:
        mask[2, :19] = 0
    return ids.to(device), mask.to(device)


def test_name_with_flash_is_not_usable_in_transformers():
    """Why flash3 registers as "hopper_attention": transformers sends any name containing
    "flash" to its FlashAttention loader, which looks for a Hub kernel."""
    transformers = _transformers_or_skip()
    model = _llama(torch.float32, "cpu")

    def fn(*args, **kwargs):
        raise AssertionError("not reached")

    transformers.AttentionInterface.register("flash3_probe", fn)
    with pytest.raises(Exception):
        model.set_attn_implementation("flash3_probe")


def test_llama_float64_cpu_matches_sdpa(cpu_kernels):
    model = _llama(torch.float64, "cpu")
    name = _integration().register()
    ids, mask = _batch("cpu")
    with torch.no_grad():
        for kwargs in (dict(), dict(attention_mask=mask)):
            ref = _set(model, "sdpa")(input_ids=ids, **kwargs).logits
            out = _set(model, name)(input_ids=ids, **kwargs).logits
            valid = kwargs.get("attention_mask", torch.ones_like(ids)).bool()
            torch.testing.assert_close(out[valid], ref[valid], rtol=1e-9, atol=1e-9)
        # packed sequences in one row (no cache: transformers' sdpa mask packs them then)
        pos = torch.cat([torch.arange(15), torch.arange(25)])[None]
        ref = _set(model, "sdpa")(input_ids=ids[:1], position_ids=pos, use_cache=False).logits
        out = _set(model, name)(input_ids=ids[:1], position_ids=pos, use_cache=False).logits
        torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    # loss and gradients
    grads = {}
    for impl in ("sdpa", name):
        _set(model, impl).zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        grads[impl] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(grads[name][0], grads["sdpa"][0], rtol=1e-9, atol=1e-9)
    for g, g_ref in zip(grads[name][1], grads["sdpa"][1]):
        torch.testing.assert_close(g, g_ref, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "left-padded"])
def test_llama_float64_cpu_generate_matches_sdpa(cpu_kernels, cache, padded):
    model = _llama(torch.float64, "cpu")
    name = _integration().register()
    ids, mask = _batch("cpu", s=24)
    kwargs = dict(attention_mask=mask if padded else torch.ones_like(mask), max_new_tokens=8, do_sample=False,
                  pad_token_id=0, cache_implementation=cache, disable_compile=True)
    ref = _set(model, "sdpa").generate(input_ids=ids, **kwargs)
    out = _set(model, name).generate(input_ids=ids, **kwargs)
    assert torch.equal(out, ref)


# ----------------------------------------------------------------------------------------
# GPU: bf16 on the kernels
# ----------------------------------------------------------------------------------------


def _gpu_models():
    _transformers_or_skip()
    if not flash3.is_supported("fwd", torch.bfloat16, 64, True) or not flash3.is_supported("bwd", torch.bfloat16, 64, True):
        pytest.skip("bf16 hdim 64 causal kernels not in this build")
    model = _llama(torch.bfloat16, "cuda")
    reference = _llama(torch.float32, "cuda")
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    return model, _set(reference, "sdpa"), _integration().register()


def _errors(x, ref):
    d = (x.float() - ref.float()).abs()
    return d.max().item(), d.mean().item()


def _within_noise(ours, sdpa, ref, what, factor=2.0, floor=1e-3):
    (m, a), (m_sdpa, a_sdpa) = _errors(ours, ref), _errors(sdpa, ref)
    assert m <= factor * m_sdpa + floor and a <= factor * a_sdpa + floor, (
        f"{what}: max/mean error {m:.3e}/{a:.3e} against fp32, bf16 sdpa's {m_sdpa:.3e}/{a_sdpa:.3e}"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "left-padded"])
def test_llama_bf16_logits_loss_gradients(padded):
    model, reference, name = _gpu_models()
    ids, mask = _batch("cuda", b=4, s=300)
    if not padded:
        mask = torch.ones_like(mask)
    labels = ids.masked_fill(mask == 0, -100)
    valid = mask.bool()

    def run(m, impl=None):
        if impl is not None:
            _set(m, impl)
        m.zero_grad()
        outputs = m(input_ids=ids, attention_mask=mask, labels=labels)
        outputs.loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if "layers.0" in n or "embed" in n}
        return outputs.logits.detach()[valid], outputs.loss.detach(), grads

    ref_logits, ref_loss, ref_grads = run(reference)
    sdpa_logits, sdpa_loss, sdpa_grads = run(model, "sdpa")
    ours_logits, ours_loss, ours_grads = run(model, name)
    _within_noise(ours_logits, sdpa_logits, ref_logits, "logits")
    _within_noise(ours_loss, sdpa_loss, ref_loss, "loss", floor=1e-3)
    for n in ref_grads:
        scale = max(ref_grads[n].abs().max().item(), 1e-6)
        _within_noise(ours_grads[n] / scale, sdpa_grads[n] / scale, ref_grads[n] / scale, f"grad {n}", floor=1e-3)


@pytest.mark.gpu
def test_llama_bf16_packed_sequences():
    model, reference, name = _gpu_models()
    ids, _ = _batch("cuda", b=1, s=300)
    pos = torch.cat([torch.arange(100), torch.arange(120), torch.arange(80)]).cuda()[None]
    with torch.no_grad():
        ref = reference(input_ids=ids, position_ids=pos, use_cache=False).logits
        sdpa = _set(model, "sdpa")(input_ids=ids, position_ids=pos, use_cache=False).logits
        ours = _set(model, name)(input_ids=ids, position_ids=pos, use_cache=False).logits
    _within_noise(ours, sdpa, ref, "packed logits")


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "left-padded"])
def test_llama_bf16_generate(cache, padded):
    """Greedy decoding with the KV cache (seqlen_q = 1 against the cached keys, causal
    bottom-right aligned). Every generated token must be the fp32 model's choice given the
    same prefix, up to bf16 noise (ties within the noise may go either way); generations
    that stay on sdpa's path must equal it token for token."""
    model, reference, name = _gpu_models()
    ids, mask = _batch("cuda", b=3, s=64)
    if not padded:
        mask = torch.ones_like(mask)
    new = 8
    kwargs = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                  cache_implementation=cache, disable_compile=True)
    with torch.no_grad():
        sdpa = _set(model, "sdpa").generate(input_ids=ids, **kwargs)
        ours = _set(model, name).generate(input_ids=ids, **kwargs)
        full_mask = torch.cat([mask, torch.ones(3, new, dtype=mask.dtype, device=mask.device)], dim=1)
        ref_logits = reference(input_ids=ours, attention_mask=full_mask).logits.float()
        sdpa_logits = _set(model, "sdpa")(input_ids=ours, attention_mask=full_mask).logits.float()
    noise = (sdpa_logits - ref_logits).abs()[full_mask.bool()].max().item()
    steps = ref_logits[:, ids.shape[1] - 1: -1]  # the logits that chose each generated token
    chosen = steps.gather(-1, ours[:, ids.shape[1]:, None])[..., 0]
    best = steps.max(dim=-1).values
    assert (best - chosen).max().item() <= 4 * noise + 1e-3, "a generated token is not the fp32 model's greedy choice"
    # token for token equal to sdpa until the first tie within the noise
    for row in range(3):
        for t in range(new):
            if ours[row, ids.shape[1] + t] != sdpa[row, ids.shape[1] + t]:
                top2 = steps[row, t].topk(2).values
                assert (top2[0] - top2[1]).item() <= 4 * noise + 1e-3, f"row {row} differs from sdpa at step {t}"
                break
