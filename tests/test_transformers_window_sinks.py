"""transformers models with sliding windows, softcap and attention sinks on flash3:
a tiny random Gemma-2-style model (alternating sliding-window and global layers,
attention logit softcapping) and a tiny gpt-oss-style one (sliding windows and per-head
sinks, `s_aux`), against transformers' eager attention (its sdpa path does not apply
softcap or sinks). Skipped without transformers.

CPU, the kernels replaced by the float64 reference (the mapping of `sliding_window`,
`softcap` and `s_aux` onto flash3's arguments): logits equal to eager's to 1e-4 in
float64 (eager's softmax runs in float32 even there: its error is ~2e-6; a window one key
off moves the logits by ~1e-2), 2e-3 in float32 (gpt-oss). GPU, bf16: logits, loss and
gradients within twice bf16 eager's error against a float32 eager copy of the model; a
left-padded batch against each sequence run alone (eager's padded rows are NaN in
float64, and their values reach the valid rows).
"""
import pytest
import torch

import flash3
from test_transformers_integration import _batch, _integration, _set, _transformers_or_skip, _within_noise
from test_transformers_integration import cpu_kernels  # noqa: F401  (fixture)

WINDOW = 16


def _gemma2(dtype, device, seed=0):
    transformers = _transformers_or_skip()
    config = transformers.Gemma2Config(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=1000, max_position_embeddings=512, sliding_window=WINDOW,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=64,
        layer_types=["sliding_attention", "full_attention"], initializer_range=0.1, pad_token_id=0,
    )
    torch.manual_seed(seed)
    return transformers.Gemma2ForCausalLM(config).to(device=device, dtype=dtype).eval()


def _gpt_oss(dtype, device, seed=0):
    transformers = _transformers_or_skip()
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("this transformers has no gpt-oss")
    config = transformers.GptOssConfig(
        hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=1000, max_position_embeddings=512, sliding_window=WINDOW, num_local_experts=4,
        num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"], initializer_range=0.1,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).to(device=device, dtype=dtype).eval()
    with torch.no_grad():  # sinks far from 0, so that they matter
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


MODELS = {"gemma2": _gemma2, "gpt-oss": _gpt_oss}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_cpu_matches_eager(cpu_kernels, family):  # noqa: F811
    # gpt-oss's experts need float32 matmuls on the CPU
    dtype = torch.float64 if family == "gemma2" else torch.float32
    model = MODELS[family](dtype, "cpu")
    name = _integration().register()
    ids, _ = _batch("cpu", s=48)
    with torch.no_grad():
        ref = _set(model, "eager")(input_ids=ids).logits
        ours = _set(model, name)(input_ids=ids).logits
    tol = 1e-4 if dtype == torch.float64 else 2e-3
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_cpu_packed_sequences_match_separate_runs(cpu_kernels, family):  # noqa: F811
    """Two sequences packed in one row (position_ids restarting) on the variable-length
    path, windows, softcap and sinks per sequence: the logits of each sequence run alone
    with eager attention (rather than eager on the packed row: with the transformers this
    was written against, gpt-oss's eager mask does not separate packed sequences)."""
    dtype = torch.float64 if family == "gemma2" else torch.float32
    model = MODELS[family](dtype, "cpu")
    name = _integration().register()
    ids, _ = _batch("cpu", b=1, s=60)
    position_ids = torch.cat([torch.arange(25), torch.arange(35)])[None]
    with torch.no_grad():
        ours = _set(model, name)(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        _set(model, "eager")
        alone = torch.cat([model(input_ids=ids[:, :25]).logits, model(input_ids=ids[:, 25:]).logits], dim=1)
    tol = 1e-4 if dtype == torch.float64 else 2e-3
    torch.testing.assert_close(ours, alone, rtol=tol, atol=tol)


def _per_sequence(model, ids, mask):
    """Logits of each left-padded sequence run alone, unpadded, at its valid positions."""
    rows = []
    for b in range(ids.shape[0]):
        keep = mask[b].bool()
        rows.append(model(input_ids=ids[b:b + 1, keep]).logits[0])
    return torch.cat(rows)


def _gpu_pair(family):
    if not all(flash3.is_supported(kind, torch.bfloat16, 64, False, mask="local") for kind in ("fwd", "bwd")):
        pytest.skip("bf16 hdim 64 local-mask kernels not in this build")
    model = MODELS[family](torch.bfloat16, "cuda")
    reference = MODELS[family](torch.float32, "cuda")
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    return model, _set(reference, "eager"), _integration().register()


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(MODELS))
def test_bf16_logits_loss_gradients(family):
    model, reference, name = _gpu_pair(family)
    ids, _ = _batch("cuda", b=4, s=200)

    def run(m, impl=None):
        if impl is not None:
            _set(m, impl)
        m.zero_grad()
        outputs = m(input_ids=ids, labels=ids)
        outputs.loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()
                 if p.grad is not None and ("layers.0.self_attn" in n or "layers.1.self_attn" in n)}
        return outputs.logits.detach(), outputs.loss.detach(), grads

    ref_logits, ref_loss, ref_grads = run(reference)
    eager_logits, eager_loss, eager_grads = run(model, "eager")
    ours_logits, ours_loss, ours_grads = run(model, name)
    _within_noise(ours_logits, eager_logits, ref_logits, "logits")
    _within_noise(ours_loss, eager_loss, ref_loss, "loss", floor=1e-3)
    assert ref_grads.keys() == ours_grads.keys() and ref_grads
    for n in ref_grads:
        scale = max(ref_grads[n].abs().max().item(), 1e-6)
        _within_noise(ours_grads[n] / scale, eager_grads[n] / scale, ref_grads[n] / scale, f"grad {n}", floor=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(MODELS))
def test_bf16_left_padded_batch(family):
    model, reference, name = _gpu_pair(family)
    ids, mask = _batch("cuda", b=3, s=120)
    with torch.no_grad():
        ref = _per_sequence(reference, ids, mask)
        eager = _per_sequence(_set(model, "eager"), ids, mask)
        ours = _set(model, name)(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    _within_noise(ours, eager, ref, "left-padded logits")


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(MODELS))
def test_bf16_packed_sequences(family):
    """Three sequences packed in one row (position_ids restarting), against each sequence
    run alone."""
    model, reference, name = _gpu_pair(family)
    ids, _ = _batch("cuda", b=1, s=240)
    bounds = [(0, 70), (70, 200), (200, 240)]
    position_ids = torch.cat([torch.arange(b - a) for a, b in bounds]).cuda()[None]

    def alone(m):
        return torch.cat([m(input_ids=ids[:, a:b]).logits for a, b in bounds], dim=1)

    with torch.no_grad():
        ref = alone(reference)
        eager = alone(_set(model, "eager"))
        ours = _set(model, name)(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    _within_noise(ours, eager, ref, "packed logits")
