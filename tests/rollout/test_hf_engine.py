"""The HF engine's memory while generating, held to PyTorch's own accounting (its profiler's memory
timeline; `MemTracker` cannot follow a module called once per decoding step): what the planner says
`generate` keeps beside the policy (KV cache and the last decoding step), and not the full-vocabulary
scores of every step."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rlvr_lightning.planner.engine_memory import hf_decode_step_bytes, kv_bytes_per_token
from rlvr_lightning.rollout.hf_engine import HFGenerateEngine
from rlvr_lightning.rollout.types import SamplingConfig

VOCAB, PROMPTS, GROUP, RESPONSE = 32_768, 4, 2, 48


def peak_bytes_created(fn) -> int:
    """The peak of the bytes that tensors created inside `fn` hold at once, by PyTorch's profiler."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    live = peak = 0
    for _, action, _, size in MemoryProfile(prof.profiler.kineto_results).timeline:
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    return peak


def test_generation_keeps_the_planned_tensors_and_not_every_steps_scores():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    prompts = [torch.randint(3, VOCAB, (n,)).tolist() for n in (5, 8, 11, 12)]  # left padding: the masked path
    engine = HFGenerateEngine(model, pad_id=0, eos_id=VOCAB + 1, logprobs=None)  # no EOS: every sequence runs to the limit
    sampling = SamplingConfig(group_size=GROUP, temperature=0.8, top_k=100, max_tokens=RESPONSE, seed=0)
    engine.generate(prompts, sampling)  # warm-up: lazily built state is not generation's
    gc.collect()
    groups = []
    measured = peak_bytes_created(lambda: groups.extend(engine.generate(prompts, sampling)))
    assert all(len(c.token_ids) == RESPONSE for g in groups for c in g)

    N = PROMPTS * GROUP
    spec = SimpleNamespace(model_config=config, sequences_per_rank=N, max_prompt_length=12, max_response_length=RESPONSE)
    planned = N * (12 + RESPONSE) * kv_bytes_per_token(config, 4) + hf_decode_step_bytes(spec)
    every_steps_scores = N * RESPONSE * VOCAB * 4
    assert measured < every_steps_scores / 4, (measured, every_steps_scores)
    assert 0.8 * planned <= measured <= 1.1 * planned, (measured, planned)
