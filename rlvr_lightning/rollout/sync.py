"""Probe that a weight sync really reached the rollout engine.

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

from rlvr_lightning.rollout.engine import RolloutEngine, WeightSyncError
from rlvr_lightning.rollout.types import Rollout

ScoreFn = Callable[[list[int], list[int]], list[float]]


class WeightSyncProbe:
    def __init__(self, tol: float = 1e-3) -> None:
        self.tol = tol
        self.probe: tuple[list[int], list[int]] | None = None
        self.last_engine: list[float] | None = None
        self.last_trainer: list[float] | None = None
        self.last_diff = 0.0

    def check(self, engine: RolloutEngine, trainer_score: ScoreFn, rollout: Rollout) -> None:
        if self.probe is None:
            self.probe = _pick_probe(rollout)
        if self.probe is None:
            return
        engine_lp = engine.score(*self.probe)
        trainer_lp = trainer_score(*self.probe)
        self.last_diff = max(abs(a - b) for a, b in zip(engine_lp, trainer_lp))
        if self.last_diff > self.tol:
            raise WeightSyncError(
                f"after the weight sync the engine's log-probs differ from the trainer's by {self.last_diff:.2e} "
                f"(> model.sync_check_tol={self.tol}); the engine is not running the trained weights"
            )
        trainer_moved = self.last_trainer is not None and trainer_lp != self.last_trainer
        if trainer_moved and engine_lp == self.last_engine:
            raise WeightSyncError(
                "the trainer's weights changed but the engine's log-probs are bit-identical to before the sync: "
                "the weight sync did nothing"
            )
        self.last_engine, self.last_trainer = engine_lp, trainer_lp


def _pick_probe(rollout: Rollout) -> tuple[list[int], list[int]] | None:
    """The first non-empty completion of the first rollout batch, fixed for the rest of the run."""
    for n, comp in enumerate(rollout.completions):
        if comp.token_ids:
            return list(rollout.prompt_ids[rollout.group_of(n)]), list(comp.token_ids)
    return None
