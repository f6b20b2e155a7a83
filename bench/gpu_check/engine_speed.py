"""Step 4: the HF engine's (`rollout/hf_engine.py`) generation tokens/s on this device.

Two policies: the embedded default's architecture (what the RL runs of step 5 sample with) and Qwen3-0.6B
built from its configuration with random weights, in the trainer's dtype (bf16 on CUDA, fp32 on the CPU).
Random prompts of 64 tokens; an untrained model rarely samples its EOS, so nearly every sequence runs to
`max_tokens`. One untimed warm-up call, then one timed call; tokens/s counts the tokens generated.

Calibration of the planner's HF-engine model (`planner/generation.py: padded_batch`): the same rollout planned
without its per-decode-step overhead, and the overhead per step that the measured time implies, beside the
planner's constant (`STEP_OVERHEAD_EAGER_S`).
"""

from __future__ import annotations

import time
from functools import partial

import torch

from bench.gpu_check.planner_check import shrunk
from bench.gpu_check.record import attempt

EMBEDDED = {"prompts": 16, "group_size": 8, "prompt_tokens": 24, "max_tokens": 40}  # configs/base.yaml's rollout batch
QWEN3 = {"prompts": 32, "group_size": 8, "prompt_tokens": 64, "max_tokens": 256}
TINY = {"prompts": 2, "group_size": 2, "prompt_tokens": 8, "max_tokens": 8}


def policies(tiny: bool) -> dict:
    """name → (configuration, sizes)."""
    from rlvr_lightning.models.embedded import TinyQwen2Spec, build_char_tokenizer, tiny_qwen2_config
    from rlvr_lightning.planner.models import model_config

    qwen3 = model_config("Qwen/Qwen3-0.6B")
    embedded = tiny_qwen2_config(build_char_tokenizer(), TinyQwen2Spec())
    if tiny:
        return {"embedded default (tiny Qwen2)": (embedded, TINY), "Qwen/Qwen3-0.6B (shrunk)": (shrunk(qwen3), TINY)}
    return {"embedded default (tiny Qwen2)": (embedded, EMBEDDED), "Qwen/Qwen3-0.6B": (qwen3, QWEN3)}


def generation(config, sizes: dict) -> dict:
    from transformers import AutoModelForCausalLM

    from rlvr_lightning.models.forward import sequence_logprobs
    from rlvr_lightning.rollout.hf_engine import HFGenerateEngine
    from rlvr_lightning.rollout.types import SamplingConfig

    cuda = torch.cuda.is_available()
    device, dtype = (torch.device("cuda", 0), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    eos = int(config.eos_token_id if isinstance(config.eos_token_id, int) else config.eos_token_id[0])
    engine = HFGenerateEngine(model, pad_id=0, eos_id=eos, logprobs=partial(sequence_logprobs, model))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size, (sizes["prompt_tokens"],), generator=g).tolist()
               for _ in range(sizes["prompts"])]  # fmt: skip
    sampling = SamplingConfig(sizes["group_size"], temperature=1.0, max_tokens=sizes["max_tokens"], seed=0)
    engine.generate(prompts[:2], SamplingConfig(1, temperature=1.0, max_tokens=4, seed=0))  # warm-up
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    groups = engine.generate(prompts, sampling)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    lengths = [len(c.token_ids) for group in groups for c in group]
    tokens = sum(lengths)
    logps = [lp for group in groups for c in group for lp in c.logprobs]
    engine.close()
    return {**sizes, "sequences": sizes["prompts"] * sizes["group_size"], "generated_tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1), "dtype": str(dtype).removeprefix("torch."),
            "mean_logprob": sum(logps) / max(1, len(logps)),
            "planner": planned_without_overhead(config, sizes["prompt_tokens"], lengths, dtype, seconds)}  # fmt: skip


def planned_without_overhead(config, prompt_tokens: int, lengths: list[int], dtype: torch.dtype, measured_s: float) -> dict:
    """The planner's HF-engine rollout of these lengths with no per-step overhead, and the overhead per decode
    step that would make it the measured time."""
    from bench.gpu_check.update_step import device_hardware
    from rlvr_lightning.planner.engine_memory import kv_bytes_per_token
    from rlvr_lightning.planner.generation import DecodeCosts, padded_batch
    from rlvr_lightning.planner.step_time import DECODE_EFFICIENCY, PREFILL_EFFICIENCY, STEP_OVERHEAD_EAGER_S

    hw = device_hardware()
    if hw is None:
        return {"skipped": "a GPU the planner does not list"}
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    streamed = parameters - (0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size)
    nbytes = torch.finfo(dtype).bits // 8
    costs = DecodeCosts(streamed * nbytes, kv_bytes_per_token(config, nbytes), hw.memory_tb_s * 1e12 * DECODE_EFFICIENCY,
                        2 * streamed, hw.tflops * 1e12 * PREFILL_EFFICIENCY, step_overhead_s=0.0)  # fmt: skip
    plan = padded_batch(prompt_tokens, lengths, costs)
    return {"hardware": hw.name, "decode_steps": plan.decode_steps, "seconds_without_overhead": round(plan.seconds, 4),
            "implied_step_overhead_s": round((measured_s - plan.seconds) / max(1, plan.decode_steps), 5),
            "planner_step_overhead_s": STEP_OVERHEAD_EAGER_S}  # fmt: skip


def run(ctx) -> dict:
    results: dict = {"runs": {}}
    for name, (config, sizes) in policies(ctx.tiny).items():
        attempt(results["runs"], name, ctx.deadline, generation, config, sizes)
    return results
