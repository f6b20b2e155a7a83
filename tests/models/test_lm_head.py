"""Chunked LM-head log-probs: the same values and gradients as the full logits, without ever holding
[tokens × vocabulary] logits for the backward."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlvr_lightning.models.forward import policy_forward, sequence_logprobs
from rlvr_lightning.models.lm_head import chunked_token_logprobs, supports_chunked_head
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig


def full_reference(h, W, y, T):
    logp_all = torch.log_softmax((h @ W.T).double() / T, -1)
    return logp_all.gather(-1, y[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("chunk", [1, 5, 37, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_the_full_log_softmax(chunk, temperature):
    g = torch.Generator().manual_seed(0)
    M, d, V = 37, 8, 50
    h = torch.randn(M, d, generator=g, requires_grad=True)
    W = torch.randn(V, d, generator=g, requires_grad=True)
    y = torch.randint(V, (M,), generator=g)
    upstream = torch.randn(M, generator=g)  # any upstream gradient, not only a sum
    logp, entropy = chunked_token_logprobs(h, W, y, temperature, chunk, with_entropy=True)
    (logp * upstream).sum().backward()
    gh, gW = h.grad.clone(), W.grad.clone()
    h.grad = W.grad = None
    ref_logp, ref_entropy = full_reference(h, W, y, temperature)
    (ref_logp.float() * upstream).sum().backward()
    torch.testing.assert_close(logp, ref_logp.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh, h.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gW, W.grad, rtol=1e-4, atol=1e-5)
    assert not entropy.requires_grad


def test_bf16_weights_give_bf16_gradients_close_to_the_exact_ones():
    """bf16 models: the products run in bf16, the softmax and the weight-gradient sum in fp32."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, 16, generator=g).bfloat16().requires_grad_()
    W = torch.randn(64, 16, generator=g).bfloat16().requires_grad_()
    y = torch.randint(64, (40,), generator=g)
    logp, _ = chunked_token_logprobs(h, W, y, 1.0, 7)
    logp.sum().backward()
    assert h.grad.dtype == W.grad.dtype == torch.bfloat16 and logp.dtype == torch.float32
    h64, W64 = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    ref, _ = full_reference(h64, W64, y, 1.0)
    ref.sum().backward()
    torch.testing.assert_close(logp.double(), ref, rtol=0.02, atol=0.05)
    torch.testing.assert_close(W.grad.double(), W64.grad, rtol=0.02, atol=0.02)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=0.02, atol=0.02)


def tiny_model(vocab=96, seed=0, **config):
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, **config,
    )  # fmt: skip
    return Qwen2ForCausalLM(cfg).eval()


def laid_out(vocab=96):
    """Two groups of ragged responses under left-padded prompts of different lengths."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 9)]
    completions = [
        Completion(torch.randint(3, vocab, (L,), generator=g).tolist(), [0.0] * L, "stop") for L in (3, 11, 0, 7)
    ]
    rollout = Rollout(
        PromptBatch(["a", "b"], ["", ""], ["", ""]), 2, prompts, completions, SamplingConfig(group_size=2), 0
    )
    return rollout.tensors(pad_id=0)


@pytest.mark.parametrize("chunk", [4, 1024])
def test_policy_forward_chunked_equals_the_models_own_logits(chunk):
    model = tiny_model()
    t = laid_out()
    weights = torch.randn(t.response_mask.shape, generator=torch.Generator().manual_seed(2))

    def run(chunk_tokens):
        model.zero_grad(set_to_none=True)
        out = policy_forward(model, t, 0.8, with_entropy=True, capture_lm_head=True, chunk_tokens=chunk_tokens)
        (out.logp * weights).sum().backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters()}

    full, g_full = run(0)
    chunked, g_chunked = run(chunk)
    mask = t.response_mask.bool()
    torch.testing.assert_close(chunked.logp, full.logp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked.entropy[mask], full.entropy[mask], rtol=1e-5, atol=1e-6)
    assert (chunked.logp[~mask] == 0).all() and (chunked.entropy[~mask] == 0).all()
    torch.testing.assert_close(chunked.lm_head_in, full.lm_head_in)
    for name in g_full:
        torch.testing.assert_close(g_chunked[name], g_full[name], rtol=1e-4, atol=1e-6, msg=name)
    assert "forward" not in vars(model.get_output_embeddings())  # the LM head is restored


def test_the_backward_never_keeps_vocabulary_wide_tensors():
    """What autograd saves for the backward: the full path keeps logits-sized [n, T, V] tensors, the
    chunked path nothing larger than the hidden states and the LM-head weight."""
    vocab = 512
    model = tiny_model(vocab=vocab)
    t = laid_out(vocab)
    n, T = t.response_mask.shape

    def largest_saved(chunk_tokens):
        sizes = []

        def pack(x):
            sizes.append(x.numel())
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            policy_forward(model, t, 1.0, chunk_tokens=chunk_tokens)
        return max(sizes)

    assert largest_saved(0) >= n * T * vocab
    assert largest_saved(4) <= max(vocab * 32, n * t.input_ids.shape[1] * 32 * 4)  # W, or the MLP's hidden


def test_a_bf16_backward_holds_one_fp32_weight_gradient_and_its_bf16_product():
    """The backward's peak with a bf16 LM head, by PyTorch's MemTracker: the fp32 accumulator [V, d] and one chunk's
    bf16 product beside it (plus a chunk's logits), never an fp32 copy of that product as well (at Qwen3-0.6B's
    151,936 × 1,024 head, 0.58 GiB more at the update's peak)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    g = torch.Generator().manual_seed(0)
    M, d, V, chunk = 16, 256, 4096, 4  # the [V, d] buffers dominate a chunk's [c, V] ones
    h = torch.randn(M, d, generator=g).bfloat16().requires_grad_()
    W = torch.randn(V, d, generator=g).bfloat16().requires_grad_()
    y = torch.randint(V, (M,), generator=g)
    logp, _ = chunked_token_logprobs(h, W, y, 1.0, chunk)
    loss = logp.sum()
    tracker = MemTracker()
    tracker.track_external(h, W)
    with tracker:
        before = tracker.get_tracker_snapshot("current")[h.device]["Total"]
        loss.backward()
        peak = tracker.get_tracker_snapshot("peak")[h.device]["Total"]
    accumulator, product, logits = V * d * 4, V * d * 2, chunk * V * 4 * 2
    assert peak - before <= accumulator + product + logits + M * d * 4 + V * d * 2, (peak - before) / (V * d)


def test_heads_the_chunked_path_cannot_reproduce_fall_back_to_the_full_logits():
    assert supports_chunked_head(tiny_model()) is None
    biased = tiny_model()
    biased.lm_head = torch.nn.Linear(32, 96, bias=True)
    assert "bias" in supports_chunked_head(biased)
    # A fallback model still gives log-probs (through its own forward).
    t = laid_out()
    assert policy_forward(biased, t, 1.0, chunk_tokens=4).logp.shape == t.response_mask.shape


def test_the_weight_sync_probe_scores_through_the_chunked_head():
    """`sequence_logprobs` (the trainer side of the weight-sync probe, and the HF engine's `logprobs`) gives
    the model's own log-probs, and its LM head never returns vocabulary-wide logits: an 8k-token probe
    completion at V = 151,936 would otherwise build ~5 GB of logits plus their log-softmax."""
    vocab = 96
    model = tiny_model(vocab=vocab)
    g = torch.Generator().manual_seed(3)
    prompt, completion = torch.randint(3, vocab, (6,), generator=g).tolist(), torch.randint(3, vocab, (9,), generator=g).tolist()
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.double(), -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)

    head_outputs = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, a, out: head_outputs.append(out.shape))
    try:
        got = sequence_logprobs(model, prompt, completion, chunk_tokens=4)
    finally:
        handle.remove()
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), expected, rtol=1e-5, atol=1e-5)
    assert head_outputs and all(vocab not in shape for shape in head_outputs), head_outputs
