"""An algorithm's arguments and the pieces they bind (`training.algorithm`): each argument's default through the
classes a preset extends, the library's default that says "not set on purpose", and the advantages a bound
estimator gives, per sequence, and per token only from a teacher's inputs."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.algos import DAPO, GRPO, GSPO
from rlvr_lightning.pieces.kinds import AdvantageInputs, DistillationInputs
from rlvr_lightning.training.algorithm import BoundPieces, algorithm_args, argument_defaults, class_defaults


def test_an_argument_left_unset_takes_the_most_derived_classs_default():
    assert class_defaults(GSPO)["num_mini_batches"] == 4  # GSPO's own, through GRPO's **kwargs
    assert class_defaults(DAPO)["clip_eps_high"] == 0.28 and class_defaults(GRPO)["clip_eps_high"] == 0.2
    assert class_defaults(DAPO)["dynamic_sampling"] is True  # DAPO's own argument


def test_the_librarys_default_is_the_base_classs_so_a_preset_sets_its_own_on_purpose():
    assert argument_defaults(DAPO)["clip_eps_high"] == 0.2  # DAPO's 0.28 is DAPO setting it
    args = algorithm_args(class_defaults(DAPO), DAPO)
    assert args["clip_eps_high"] == 0.28 and args.defaults["clip_eps_high"] == 0.2


def bound(cls, **args) -> BoundPieces:
    """The pieces `cls` binds with `args` over its defaults (the rollout correction resolved as a run does)."""
    return BoundPieces.of(algorithm_args(class_defaults(cls) | {"rollout_correction": "none"} | args, cls))


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
