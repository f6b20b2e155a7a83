"""The rollout-engine protocol shared by the vLLM engine (default) and the HF `generate` fallback."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from rlvr_lightning.rollout.types import Completion, SamplingConfig

LogprobsFn = Callable[[list[int], list[int]], list[float]]
"""(prompt ids, completion ids) → log-probs (temperature 1) of each completion token."""


class WeightSyncError(RuntimeError):
    """The engine did not take the trainer's weights (the classic silent-no-op sync)."""


def wire_dtype(engine_dtype: str) -> torch.dtype | None:
    """The dtype the weights travel in to an engine: the engine's (`rollout.dtype`), which they would be cast to
    on loading anyway; None (as the trainer holds them) for `auto`, the checkpoint's, not known here."""
    return None if engine_dtype == "auto" else getattr(torch, engine_dtype)


class RolloutEngine(Protocol):
    # Whether `generate` may run in several threads at once, each call's samples independent of the others'
    # (seeded per request): the rollout stream then runs the segments of several batches side by side.
    concurrent_requests: bool = False

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        """`sampling.group_size` completions for every prompt, grouped per prompt, in prompt order."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Replace the engine's weights with the trainer's (HF checkpoint names): all of them, since an
        engine that released its memory may have discarded its own. `version`: the trainer's count of
        syncs, for engines that label their samples with it (vLLM servers)."""

    def load_adapter(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict, version: int | None = None
    ) -> None:
        """Serve the engine's base weights with this LoRA adapter from now on (a LoRA policy synced as an
        adapter): its tensors under PEFT's names (`base_model.model.<module>.lora_A.weight`) and its
        `adapter_config.json` contents. `version` as in `load_weights`."""

    def release_memory(self) -> None:
        """Free the engine's device memory for the policy update (a no-op unless it supports sleeping);
        the next `load_weights`, `generate` or `score` takes back what it needs."""

    def logprobs(self, prompt_ids: list[int], completion_ids: list[int], agreement_tol: float = 1e-3) -> list[float]:
        """Engine log-probs (temperature 1) of a given completion: used to probe weight syncs. An engine of
        several replicas also checks that they agree within `agreement_tol` (the probe's tolerance)."""

    def close(self) -> None: ...
