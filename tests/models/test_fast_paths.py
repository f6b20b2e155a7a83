"""`model.compute.compile_layers` and `model.compute.fused_kernels` (`models.fast_paths`): the same log-probs and
gradients as the plain path, and a clear error where a fast path cannot run."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from bench.gpu_check.fast_paths import CXX
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.models.fast_paths import apply_fast_paths
from rlvr_lightning.models.forward import policy_forward
from rlvr_lightning.models.policy import load_policies
from rlvr_lightning.rollout.types import RolloutTensors


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A two-layer Qwen3 (the family of the GPU check's models: q/k norms, tied embeddings)."""
    path = tmp_path_factory.mktemp("qwen3")
    config = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, use_cache=False, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return str(path)


def batch(rows: int, prompt: int, response: int, seed: int) -> RolloutTensors:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (rows, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt: the attention mask is not all ones
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return RolloutTensors(ids, mask, positions, torch.ones(rows, response), torch.zeros(rows, response), prompt,
                          torch.ones(rows, response))  # fmt: skip


@pytest.mark.e2e
@pytest.mark.skipif(not any(map(shutil.which, CXX)), reason="torch.compile's CPU backend needs a C++ compiler (make setup installs g++)")
def test_compiled_layers_give_the_plain_log_probs_and_gradients_under_activation_checkpointing(qwen3_dir):
    """fp32 on the CPU: compiled and eager layers agree to rounding at two micro-batch shapes (the second one
    recompiles for dynamic lengths); activation checkpointing's recomputation runs the compiled forward too."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    results = {}
    for compiled in (False, True):
        policy, _ = load_policies(qwen3_dir, with_reference=False, activation_checkpointing=True)
        apply_fast_paths(policy, compile_layers=compiled)
        for shape in ((2, 5, 7), (3, 4, 11)):
            policy.zero_grad()
            out = policy_forward(policy, batch(*shape, seed=sum(shape)), 1.0, with_entropy=True, chunk_tokens=4)
            (out.logp * torch.linspace(-1, 1, out.logp.numel()).view_as(out.logp)).sum().backward()
            grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
            results[compiled, shape] = (out.logp.detach(), out.entropy, grads)
        assert bool(counters["stats"]["unique_graphs"]) == compiled  # the layers did run compiled (and only then)
    for shape in ((2, 5, 7), (3, 4, 11)):
        (lp0, h0, g0), (lp1, h1, g1) = results[False, shape], results[True, shape]
        torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-6)
        for name in g0:
            torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


def test_without_a_fast_path_the_model_is_left_as_it_was(qwen3_dir):
    policy, _ = load_policies(qwen3_dir, with_reference=False)
    forwards = [layer.forward for layer in policy.model.layers]
    apply_fast_paths(policy)
    assert [layer.forward for layer in policy.model.layers] == forwards


def test_liger_without_cuda_and_an_unknown_kernel_set_are_one_line_errors(qwen3_dir):
    policy, _ = load_policies(qwen3_dir, with_reference=False)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="fused_kernels liger: .*no CUDA device"):
            apply_fast_paths(policy, fused_kernels="liger")
    with pytest.raises(ConfigError, match="fused_kernels='apex'; valid: none, liger"):
        apply_fast_paths(policy, fused_kernels="apex")
