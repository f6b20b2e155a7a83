"""An algorithm's arguments and the pieces they bind (`training.algorithm`): each argument's default through the
classes a preset extends (a piece with its paper's knobs), and the advantages a bound
estimator gives, per sequence, and per token only from a teacher's inputs."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.algos import DAPO, GRPO, GSPO, REAL
from rlvr_lightning.pieces.choices import PolicyLossChoice
from rlvr_lightning.pieces.kinds import AdvantageInputs, DistillationInputs
from rlvr_lightning.training.algorithm import BoundPieces, class_defaults


def test_an_argument_left_unset_takes_the_most_derived_classs_default():
    assert class_defaults(GSPO)["num_mini_batches"] == 4  # GSPO's own, through GRPO's **kwargs
    assert class_defaults(DAPO)["policy_loss"] == PolicyLossChoice("ppo-clip", {"clip_eps_low": 0.2, "clip_eps_high": 0.28})
    assert class_defaults(GRPO)["policy_loss"] == PolicyLossChoice("ppo-clip")  # the loss's own defaults: 0.2 / 0.2
    assert class_defaults(DAPO)["dynamic_sampling"] is True  # DAPO's own argument


def test_an_algorithms_default_knobs_are_its_pieces_and_reach_the_bound_loss():
    """(Was: the library's default said "not set on purpose" through AlgorithmArgs; an algorithm now sets its
    paper's knobs on its piece's choice, and they are what the loss is bound with.)"""
    assert bound(DAPO).objective.loss.keywords == {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip_c": None}
    assert bound(GSPO).objective.loss.keywords == {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4, "dual_clip_c": None}
    assert bound(GRPO).objective.loss.keywords == {"clip_eps_low": 0.2, "clip_eps_high": 0.2, "dual_clip_c": None}


def bound(cls, **args) -> BoundPieces:
    """The pieces `cls` binds with `args` over its defaults (the rollout correction resolved as a run does)."""
    return BoundPieces.of(class_defaults(cls) | {"rollout_correction": "none"} | args)


def test_a_bound_estimators_advantages_per_sequence_and_per_token_from_a_teachers_inputs():
    pieces = bound(GRPO)
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    advantages, tokens, stats = pieces.advantages(AdvantageInputs(r, r, 2))
    assert tokens is None and advantages.tolist() == pytest.approx([0.7071, -0.7071, 0.0, 0.0], abs=1e-4)
    assert stats["adv_mean"] == pytest.approx(0.0)
    opd = bound(GRPO, advantage_estimator="opd", rollout_correction="none")
    student, teacher = torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[-0.5, -1.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    one = torch.tensor([1.0])
    sequence, per_token, _ = opd.advantages(AdvantageInputs(one, one, 1, distillation=DistillationInputs(student, teacher, mask)))
    assert per_token.tolist() == [[0.5, 1.0, 0.0]] and sequence.tolist() == [0.75]  # the mean over its sampled tokens


def test_group_level_losses_compose_with_any_algorithm():
    """REAL's loss on the GRPO class: the same objective as REAL's own defaults."""
    real_bce = {"name": "real-bce", "knobs": {"tau": 0.25}}
    mixed = GRPO(policy_loss=real_bce, advantage_estimator="none").settings.pieces.objective
    assert mixed.group_level and mixed.loss.keywords == {"tau": 0.25}
    assert REAL(policy_loss=real_bce).settings.pieces.objective.loss.keywords == {"tau": 0.25}


def test_the_algorithms_default_knobs_reach_the_loss():
    """DAPO's clip-higher, GSPO's tiny sequence clip range and REAL's τ are the knobs of their policy_loss choice."""
    assert DAPO().settings.pieces.objective.loss.keywords == {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip_c": None}
    assert GSPO().settings.pieces.objective.loss.keywords == {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4, "dual_clip_c": None}
    assert REAL().settings.pieces.objective.loss.keywords == {"tau": 0.5}
    assert GRPO().settings.pieces.objective.loss.keywords == {"clip_eps_low": 0.2, "clip_eps_high": 0.2, "dual_clip_c": None}
    # A choice given in full replaces the algorithm's: its knobs not given are the loss's own defaults.
    assert DAPO(policy_loss="ppo-clip").settings.pieces.objective.loss.keywords["clip_eps_high"] == 0.2
    assert REAL(policy_loss={"name": "real-anchor", "knobs": {"tau": 0.1}}).settings.pieces.objective.loss.keywords == {"tau": 0.1}
