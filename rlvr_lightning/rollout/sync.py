"""Weight sync from the trainer to the rollout engine, and the probe that it really reached it.

A sync that silently does nothing is the most common failure in RL frameworks: training goes on,
rollouts keep coming from the initial policy, and only the curves look odd. After every sync we
score one fixed probe completion with the engine and with the trainer and require
  (a) agreement within `tol` (the engine now holds the trainer's weights), and
  (b) that the engine's scores moved whenever the trainer's did (an exact no-op cannot hide
      below the tolerance when updates are tiny).
Cost: one forward of one short sequence on each side per sync.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlvr_lightning.rollout.engine import LogprobsFn, RolloutEngine, WeightSyncError
from rlvr_lightning.rollout.types import Rollout

# The probe's default tolerance follows the precision the two sides compute in. In fp32 a correct sync agrees
# to ~1e-5 (at most 1.6e-5 over the probes of the embedded model's `make results` runs on CPU), so 1e-4 still
# catches a sync that leaves a small part of the model behind (a norm weight, one layer); bf16 or fp16 on
# either side differs by rounding alone by up to a few hundredths.
FP32_SYNC_TOL = 1e-4
LOW_PRECISION_SYNC_TOL = 0.05


def default_sync_tol(engine_dtype: str, trainer_dtype: str) -> float:
    """The probe's tolerance when `rollout.sync.check_tol` is not set, for the engine's dtype (`rollout.dtype`,
    resolved when `auto`) and the dtype the trainer computes in."""
    return FP32_SYNC_TOL if engine_dtype == trainer_dtype == "float32" else LOW_PRECISION_SYNC_TOL


class WeightSyncProbe:
    def __init__(self, tol: float = 1e-3) -> None:
        self.tol = tol
        self.probe: tuple[list[int], list[int]] | None = None
        self.last_engine: list[float] | None = None
        self.last_trainer: list[float] | None = None
        self.last_diff = 0.0

    def check(self, engine: RolloutEngine, trainer_logprobs: LogprobsFn, rollout: Rollout) -> None:
        if self.probe is None:
            self.probe = _pick_probe(rollout)
        if self.probe is None:
            return
        engine_lp = engine.logprobs(*self.probe, agreement_tol=self.tol)
        trainer_lp = trainer_logprobs(*self.probe)
        self.last_diff = max(abs(a - b) for a, b in zip(engine_lp, trainer_lp))
        path = getattr(engine, "sync_path", None)  # the engine's way of receiving weights, where it has several
        by = f" (the weights went by {path})" if path else ""
        if self.last_diff > self.tol:
            raise WeightSyncError(
                f"after the weight sync the engine's log-probs differ from the trainer's by {self.last_diff:.2e} "
                f"(> rollout.sync.check_tol={self.tol}); the engine is not running the trained weights{by}"
            )
        trainer_moved = self.last_trainer is not None and trainer_lp != self.last_trainer
        if trainer_moved and engine_lp == self.last_engine:
            raise WeightSyncError(
                "the trainer's weights changed but the engine's log-probs are bit-identical to before the sync: "
                f"the weight sync did nothing{by}"
            )
        self.last_engine, self.last_trainer = engine_lp, trainer_lp


def _pick_probe(rollout: Rollout) -> tuple[list[int], list[int]] | None:
    """The first non-empty completion of the first rollout batch, fixed for the rest of the run."""
    for n, comp in enumerate(rollout.completions):
        if comp.token_ids:
            return list(rollout.prompt_ids[rollout.group_of(n)]), list(comp.token_ids)
    return None


class EngineSync:
    """Hands the trainer's weights to the engine after every update, probing the first sync and every
    `check_every`-th after it (one engine call and one trainer forward of a short sequence)."""

    def __init__(self, tol: float = 1e-3, check_every: int = 10) -> None:
        self.probe = WeightSyncProbe(tol=tol)
        self.check_every = check_every

    @torch.no_grad()
    def sync(
        self,
        engine: RolloutEngine,
        load: Callable[[int], None],
        policy_version: int,
        rollout: Rollout,
        trainer_logprobs: LogprobsFn,
    ) -> None:
        """`load(policy_version)` hands the trainer's policy to `engine` (its full weights or its adapter,
        `models.weights.load_into_engine`) as version `policy_version` (counted from 1); `trainer_logprobs`
        scores the probe with the policy itself."""
        load(policy_version)
        if (policy_version - 1) % self.check_every == 0:
            self.probe.check(engine, trainer_logprobs, rollout)
