"""The families whose forward transforms the LM head's output (logit scaling, logit scale, soft-capping):
the chunked LM head and THR's LM-head calls reproduce each model's own logits, values and gradients;
a transform not verified here falls back to the model's own forward; under autocast the chunked head
runs its products in autocast's dtype in both passes."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from rlvr_lightning.models.forward import lm_head_inputs, policy_forward
from rlvr_lightning.models.lm_head import (
    HEAD_TRANSFORM_FAMILIES,
    SCALES_THE_HEAD_INPUT,
    PolicyHead,
    supports_chunked_head,
)
from tests.models.test_lm_head import laid_out, tiny_model

SHARED = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, final_logit_softcapping=2.0)
FAMILIES = {  # model type → (config class, its transform's settings, strong enough to matter at this size)
    "granite": (tf.GraniteConfig, dict(logits_scaling=4.0)),
    "granitemoe": (tf.GraniteMoeConfig, dict(logits_scaling=4.0)),
    "cohere": (tf.CohereConfig, dict(logit_scale=0.25)),
    "cohere2": (tf.Cohere2Config, dict(logit_scale=0.25)),
    "gemma2": (tf.Gemma2Config, GEMMA),
    "gemma3_text": (tf.Gemma3TextConfig, GEMMA),
    "hyperclovax": (tf.HyperCLOVAXConfig, dict(logits_scaling=0.5)),
    "minicpm3": (tf.MiniCPM3Config, dict(dim_model_base=8)),  # logits_scaling = hidden / dim_model_base = 4
    "nanochat": (tf.NanoChatConfig, dict(final_logit_softcapping=2.0)),
}


def family_model(model_type: str) -> torch.nn.Module:
    config_cls, settings = FAMILIES[model_type]
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config_cls(**SHARED, **settings)).eval()


def test_every_family_the_library_names_is_tested_here():
    assert set(FAMILIES) == HEAD_TRANSFORM_FAMILIES


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_chunked_head_and_thrs_head_reproduce_the_models_own_logits(model_type):
    model = family_model(model_type)
    assert model.config.model_type == model_type and supports_chunked_head(model) is None
    t = laid_out()
    with lm_head_inputs(model) as grabbed, torch.no_grad():
        own = model(input_ids=t.input_ids, attention_mask=t.attention_mask, position_ids=t.position_ids).logits
    head = PolicyHead(model)
    torch.testing.assert_close(head(grabbed[0]), own, rtol=1e-5, atol=1e-5)
    if model_type not in SCALES_THE_HEAD_INPUT:  # (MiniCPM3 scales the head's input: its output is the logits)
        assert not torch.allclose(model.get_output_embeddings()(grabbed[0]), own, atol=1e-3)  # the transform matters

    weights = torch.randn(t.response_mask.shape, generator=torch.Generator().manual_seed(2))

    def run(chunk_tokens):
        model.zero_grad(set_to_none=True)
        out = policy_forward(model, t, 0.8, with_entropy=True, chunk_tokens=chunk_tokens)
        (out.logp * weights).sum().backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (full, g_full), (chunked, g_chunked) = run(0), run(4)
    mask = t.response_mask.bool()
    torch.testing.assert_close(chunked.logp, full.logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked.entropy[mask], full.entropy[mask], rtol=1e-5, atol=1e-5)
    assert g_chunked.keys() == g_full.keys()
    for name in g_full:
        torch.testing.assert_close(g_chunked[name], g_full[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_transform_not_verified_here_falls_back_to_the_models_own_forward():
    model = tiny_model()
    model.config.final_logit_softcapping = 30.0  # Qwen2's forward ignores it: reading it would be wrong
    assert "final_logit_softcapping" in supports_chunked_head(model)
    t = laid_out()
    torch.testing.assert_close(policy_forward(model, t, 1.0, chunk_tokens=4).logp, policy_forward(model, t, 1.0).logp)


def test_under_autocast_the_chunked_head_matches_the_models_own_and_its_backward_runs():
    """bf16-mixed: fp32 weights, bf16 hidden states from the autocast region; the head's product in bf16 in
    the forward (as the model's own) and in the backward (which runs outside autocast)."""
    model = tiny_model()
    t = laid_out()

    def run(chunk_tokens):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = policy_forward(model, t, 1.0, chunk_tokens=chunk_tokens)
        out.logp.sum().backward()
        return out.logp, {n: p.grad.clone() for n, p in model.named_parameters()}

    (full, g_full), (chunked, g_chunked) = run(0), run(4)
    torch.testing.assert_close(chunked, full, rtol=0.02, atol=0.05)
    for name in g_full:
        assert g_chunked[name].dtype == torch.float32
        torch.testing.assert_close(g_chunked[name], g_full[name], rtol=0.05, atol=0.02, msg=name)


def test_a_bf16_hidden_state_with_fp32_weights_under_autocast_gets_autocasts_gradients():
    """The chunked head against the same product run by autocast and a full log-softmax: values and both
    gradients, with the backward (outside autocast) recomputing the product in bf16 as the forward did."""
    from rlvr_lightning.models.lm_head import chunked_token_logprobs

    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, 16, generator=g).bfloat16().requires_grad_()
    W = torch.randn(64, 16, generator=g, requires_grad=True)
    y = torch.randint(64, (40,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = chunked_token_logprobs(h, W, y, 1.0, 7)
    logp.sum().backward()
    grads = h.grad.clone(), W.grad.clone()
    h.grad = W.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = h @ W.T
    reference = torch.log_softmax(z.float(), -1).gather(-1, y[:, None]).squeeze(-1)
    reference.sum().backward()
    assert grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.float32
    torch.testing.assert_close(logp, reference, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(grads[0], h.grad, rtol=0.02, atol=0.02)
    torch.testing.assert_close(grads[1], W.grad, rtol=0.02, atol=0.02)
