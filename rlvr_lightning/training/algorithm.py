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
from rlvr_lightning.pieces.registry import AlgorithmArgs, Piece
from rlvr_lightning.pieces.selection import check_piece_args
from rlvr_lightning.training.checks import check_pieces
from rlvr_lightning.training.objective import Objective, compose_objective


def argument_defaults(cls: type) -> dict[str, Any]:
    """The library's default of each argument of an algorithm class: where a subclass repeats an argument of
    the class it extends, the base's default (DAPO's clip_eps_high=0.28 is DAPO setting it, against 0.2)."""
    return _defaults(cls.__mro__)  # most derived first: the base-most definition is written last


def class_defaults(cls: type) -> dict[str, Any]:
    """What each argument of an algorithm class is when left unset: the most derived class's default (GSPO's
    num_mini_batches=4), through the arguments a subclass passes on (`**kwargs`) to the class it extends."""
    return _defaults(reversed(cls.__mro__))


def _defaults(classes) -> dict[str, Any]:
    defaults: dict[str, Any] = {}
    for klass in classes:  # a later class's default overwrites an earlier one's
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.default is not inspect.Parameter.empty:
                defaults[p.name] = p.default
    return defaults


def algorithm_args(values: Mapping[str, Any], cls: type) -> AlgorithmArgs:
    """An algorithm's arguments as its pieces read them: those left at the library's default feed only knobs
    without a default of their own (`rlvr_lightning.pieces.registry.AlgorithmArgs`)."""
    return AlgorithmArgs(values, argument_defaults(cls))


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
        check_piece_args(h)
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

