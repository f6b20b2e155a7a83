"""The rollout engine's share of a device, and the step's rollout tensors on the trainer's device.

vLLM on a GPU takes `gpu_memory_utilization` × the device's memory when it starts (its weights, the
activations of its profiling forward, and a KV cache filling the rest); sleep mode gives it back during
the update (level 1 offloads the weights to host memory and drops the KV cache; level 2 drops both).
These are vLLM's own rules; the figures below follow them from the model's configuration. On the CPU
the KV cache is `rollout.kv_cache_gib` (VLLM_CPU_KVCACHE_SPACE) beside the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlvr_lightning.planner.hardware import GIB
from rlvr_lightning.planner.run_spec import RunSpec

SLEEPING_GIB = 0.5  # what a sleeping vLLM engine keeps on the GPU (its CUDA context and allocator pool): an assumption
# Measured with vllm-cpu 0.32 on a 2-core machine, at 1,024- and 151,936-token vocabularies: beyond its weights and
# KV cache, the engine keeps the high-water mark of its start-up profile, 0.18 GiB plus 3.5 copies of the
# sampler's [max_num_seqs, vocabulary] fp32 logits (bench/plan_accuracy.py's engine probe re-measures it:
# 0.07 GiB + 3.7 copies in the committed run, within 0.1 GiB of these).
CPU_ENGINE_FIXED_GIB = 0.18
# A decoding step of `generate` holds up to seven [sequences, vocabulary] fp32 tensors at once (the model's
# logits, their fp32 copy, the warpers' outputs, the engine's log-softmax, the sampler's probabilities, …):
# PyTorch's profiler counts 7 with temperature and top-k warpers, 6 without (tests/rollout/test_hf_engine.py).
HF_STEP_LOGITS_COPIES = 7
SAMPLER_COPIES = 3.5


def vllm_batch_limits(hw) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens): vLLM's defaults for its offline engine on this hardware (its
    EngineArgs rule: GPUs of ≥ 70 GiB other than the A100 get 1,024 and 16,384, other GPUs 256 and 8,192,
    the CPU 256 and 4,096)."""
    if not hw.gpu:
        return 256, 4096
    return (1024, 16384) if hw.memory_gib >= 70 and not hw.name.startswith("a100") else (256, 8192)


def profile_gib(config, nbytes: int, hw) -> float:
    """vLLM's profiling forward at max_num_batched_tokens (its MLP and attention inputs) and its sampler run
    over max_num_seqs rows of logits: the working memory it keeps out of the KV cache."""
    seqs, tokens = vllm_batch_limits(hw)
    intermediate = getattr(config, "intermediate_size", 4 * config.hidden_size)
    forward = tokens * (2 * intermediate + 4 * config.hidden_size) * nbytes
    sampler = SAMPLER_COPIES * seqs * config.vocab_size * 4
    return (forward + sampler) / GIB


@dataclass(frozen=True)
class EngineShare:
    awake_gib: float  # on the trainer's device while generating (0 for servers on other GPUs)
    asleep_gib: float  # on the trainer's device during the update
    weights_gib: float
    kv_cache_gib: float
    kv_bytes_per_token: int
    note: str

    @property
    def kv_tokens(self) -> int:
        return int(self.kv_cache_gib * GIB // max(1, self.kv_bytes_per_token))


def dtype_bytes(dtype: str, config) -> int:
    if dtype == "auto":
        dtype = str(getattr(config, "torch_dtype", None) or getattr(config, "dtype", None) or "float32")
    return 4 if "32" in dtype else 2


def attention_shape(config) -> tuple[int, int, int]:
    """(attention heads, head dimension, KV heads) of a model configuration."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, head_dim, getattr(config, "num_key_value_heads", None) or heads


def kv_bytes_per_token(config, nbytes: int) -> int:
    heads, head_dim, kv_heads = attention_shape(config)
    return 2 * config.num_hidden_layers * kv_heads * head_dim * nbytes  # K and V, every layer


def engine_share(spec: RunSpec, parameters: int) -> EngineShare:
    config, hw = spec.model_config, spec.hardware
    nbytes = dtype_bytes(spec.engine_dtype, config)
    per_token = kv_bytes_per_token(config, nbytes)
    weights = parameters * nbytes / GIB
    if spec.engine == "hf":
        kv = spec.sequences_per_rank * (spec.max_prompt_length + spec.max_response_length) * kv_bytes_per_token(config, 4) / GIB
        return EngineShare(
            kv + hf_decode_step_bytes(spec) / GIB,
            0.0,
            0.0,
            kv,
            kv_bytes_per_token(config, 4),
            "HF engine: the policy generates; its KV cache (fp32) and the last decoding step's tensors",
        )
    if not hw.gpu:
        held = weights + spec.kv_cache_gib + CPU_ENGINE_FIXED_GIB + SAMPLER_COPIES * 256 * config.vocab_size * 4 / GIB
        return EngineShare(
            held,
            held,
            weights,
            spec.kv_cache_gib,
            per_token,
            "vLLM on CPU: weights + rollout.kv_cache_gib + its start-up profile's high-water mark, held all run",
        )
    total = spec.gpu_memory_utilization * hw.memory_gib
    kv = max(0.0, total - weights - profile_gib(config, nbytes, hw))
    if spec.engine_elsewhere:
        return EngineShare(0.0, 0.0, weights, kv, per_token, "vLLM servers on other GPUs (rollout.servers.cuda_devices / servers.urls)")
    asleep = total if spec.sleep_level == 0 else SLEEPING_GIB
    note = f"vLLM colocated: {spec.gpu_memory_utilization:.2f} × {hw.memory_gib:.1f} GiB" + (
        f", asleep during the update (level {spec.sleep_level})" if spec.sleep_level else ", held during the update (sleep_level 0)")
    return EngineShare(total, asleep, weights, kv, per_token, note)


def hf_decode_step_bytes(spec: RunSpec) -> int:
    """What `generate` (rollout.engine hf) holds beside the KV cache at its last decoding step, the longest:
    the larger of its attention's and its sampling's working tensors, and the log-probs kept so far.
    Attention: one layer's keys and values repeated to every head (transformers' SDPA path copies them
    when left-padded prompts need a mask and the model groups its KV heads) and the layer's newly
    concatenated keys and values. Sampling: HF_STEP_LOGITS_COPIES [sequences, vocabulary] fp32 tensors."""
    config, N, T = spec.model_config, spec.sequences_per_rank, spec.max_prompt_length + spec.max_response_length
    heads, head_dim, kv_heads = attention_shape(config)
    attention = (2 * N * heads * T * head_dim * 4 if kv_heads < heads else 0) + 2 * N * kv_heads * T * head_dim * 4
    sampling = HF_STEP_LOGITS_COPIES * N * config.vocab_size * 4
    return max(attention, sampling) + N * spec.max_response_length * 4


def rollout_buffers_bytes(spec: RunSpec) -> int:
    """The rank's rollout tensors the step keeps on the device (`training.prepare`): ids, attention mask and
    positions (int64) over prompt + response; the response mask, engine log-probs, advantages, θ_old and
    reference log-probs and the entropy (fp32) over the response."""
    N, P, T = spec.sequences_per_rank, spec.max_prompt_length, spec.max_response_length
    return N * (P + T) * 3 * 8 + N * T * 6 * 4
