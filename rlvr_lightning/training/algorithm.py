"""The pieces an algorithm's hyper-parameters select, checked and bound once when the module is built:
the update's objective, the advantage estimator, the rollout correction and the proximal policy."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rlvr_lightning.pieces import advantage_estimators, proximal_policies, rollout_corrections
from rlvr_lightning.pieces.advantages import advantage_stats
from rlvr_lightning.pieces.kinds import AdvantageInputs
from rlvr_lightning.pieces.registry import Piece
from rlvr_lightning.training.checks import check_pieces
from rlvr_lightning.training.objective import Objective, compose_objective


def class_defaults(cls: type) -> dict[str, Any]:
    """What each argument of an algorithm class is when left unset: the most derived class's default (GSPO's
    num_mini_batches=4), through the arguments a subclass passes on (`**kwargs`) to the class it extends. (What
    LightningCLI fills in; read here for a configuration checked without building the module: `make plan`.)"""
    defaults: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):  # a later class's default overwrites an earlier one's
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.default is not inspect.Parameter.empty:
                defaults[p.name] = p.default
    return defaults


@dataclass(frozen=True)
class BoundPieces:
    objective: Objective
    estimator: Callable  # the advantage estimator, knobs bound
    correction: Piece  # the rollout correction
    correct: Callable  # the rollout correction, knobs bound
    proximal: Piece  # the proximal policy
    approximate_proximal: Callable  # the proximal policy, knobs bound

    @classmethod
    def of(cls, h: Mapping[str, Any]) -> BoundPieces:
        """Bind the selected pieces (each runs its own knob check) and check that they combine."""
        pieces = cls(
            compose_objective(h),
            advantage_estimators.bound(h),
            rollout_corrections.selected(h),
            rollout_corrections.bound(h),
            proximal_policies.selected(h),
            proximal_policies.bound(h),
        )
        check_pieces(h, pieces.objective, pieces.correction, pieces.proximal)
        return pieces

    @property
    def corrects_rollouts(self) -> bool:
        return self.correction.name != "none"

    @property
    def approximates_proximal(self) -> bool:
        """θ_old (the proximal policy) from the update's own forward, not from the trainer's pass before it."""
        return not self.proximal["forward"]

    def advantages(self, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """Sequence advantages [N], the estimator's token advantages [N, T] if it gives each token its own (a
        teacher's estimator; the sequence's are then their mean over its sampled tokens), and their statistics
        (`adv_*`, over sequences), with the estimator's own, if it returns any."""
        out = self.estimator(inputs)
        advantages, own = out if isinstance(out, tuple) else (out, {})
        tokens = None
        if advantages.dim() == 2:
            if inputs.distillation is None:
                raise ValueError("an advantage estimator returns token advantages [N, T] only from a teacher's inputs")
            tokens, mask = advantages, inputs.distillation.mask.to(advantages)
            advantages = (tokens * mask).sum(1) / mask.sum(1).clamp(min=1)
        return advantages, tokens, {**advantage_stats(advantages), **{k: float(v) for k, v in own.items()}}

