"""A piece's knobs (`pieces.knobs`): bound from its own choice only, else at the piece's own defaults; a knob the
piece does not read, one without a default that is not given, and a value its type does not take are refused
with the flag that sets it; every algorithm runs its pieces with the knobs it records."""

from __future__ import annotations

import re

import pytest
import torch

from rlvr_lightning.algos import DAPO, GRPO
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.pieces import KINDS, advantage_estimators, policy_losses


# A researcher's loss whose clip range has no default (the config must give it) and whose c defaults to 3.
@policy_losses.register("test-dual-clip-own-default", anchor=None)
def dual_clip_loss_with_own_default(x, *, clip_eps_low: float, clip_eps_high: float, dual_clip_c: float = 3.0):
    """PPO's clipped surrogate, dual-clipped at c."""
    return policy_losses.get("ppo-clip").fn(x, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, dual_clip_c=dual_clip_c)


@policy_losses.register("test-dual-clip-required", anchor=None)
def dual_clip_loss_without_default(x, *, clip_eps_low: float, clip_eps_high: float, dual_clip_c: float):
    """The same, with c required."""
    return dual_clip_loss_with_own_default(x, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, dual_clip_c=dual_clip_c)


CLIP = {"clip_eps_low": 0.2, "clip_eps_high": 0.2}


def dual_clipped_token_loss(module) -> float:
    """One token at ratio e² with advantage −1: the clipped surrogate's loss is e² ≈ 7.39, dual-clipped at c."""
    from rlvr_lightning.pieces.kinds import TokenLossInputs

    one = torch.ones(1, 1)
    per_token, _ = module.settings.pieces.objective.loss(TokenLossInputs(2 * one, 0 * one, -one, one.bool()))
    return float(per_token)


def test_a_piece_binds_the_knobs_its_choice_gives_else_its_own_defaults(my_pieces):
    """(Was: knobs came from the hyper-parameters, then piece_args, then the defaults.) A piece's knobs come from
    its own choice only; a knob it does not read is refused; one without a default must be given."""
    piece = advantage_estimators.get("my_pieces.rank_advantage")
    assert piece.name == "rank" and piece.knobs == ("rank_scale",)
    assert piece.bind({}).keywords == {"rank_scale": 1.0}  # the function's own default applies
    assert piece.bind({"rank_scale": 2.0}).keywords == {"rank_scale": 2.0}
    assert piece.knob_values({"rank_scale": 2.0}) == {"rank_scale": 2.0}
    with pytest.raises(ConfigError, match=r"^model.advantage_estimator=rank does not read the knob 'clip_eps_low'; its knobs: rank_scale "):
        piece.bind({"rank_scale": 2.0, "clip_eps_low": 0.2})
    with pytest.raises(ConfigError, match=re.escape("model.policy_loss=test-dual-clip-required needs the knob 'clip_eps_low': "
                                                    "set it with --model.init_args.policy_loss.knobs.clip_eps_low")):  # fmt: skip
        policy_losses.get("test-dual-clip-required").bind({})


def test_a_knob_the_choice_leaves_unset_is_the_pieces_own_default():
    """(Was: an unset algorithm argument left a piece's own default.) A piece's own default c = 3 applies until
    its choice gives c; the built-in's default None is off."""
    loss = "test-dual-clip-own-default"
    assert dual_clipped_token_loss(GRPO(policy_loss={"name": loss, "knobs": CLIP})) == pytest.approx(3.0)
    assert dual_clipped_token_loss(GRPO(policy_loss={"name": loss, "knobs": {**CLIP, "dual_clip_c": 2.0}})) == pytest.approx(2.0)
    assert dual_clipped_token_loss(GRPO(policy_loss="ppo-clip")) == pytest.approx(torch.e**2)  # the built-in: off


def test_a_knob_without_a_default_is_not_fed_by_the_algorithm():
    """A user's loss whose clip range has no default is not given the algorithm's (no knob is fed by name from
    anything but its choice): the config must give it, and its error names the flag that does."""
    with pytest.raises(ConfigError, match=re.escape("model.policy_loss=test-dual-clip-own-default needs the knob "
                                                    "'clip_eps_low': set it with --model.init_args.policy_loss.knobs.clip_eps_low")):  # fmt: skip
        DAPO(policy_loss="test-dual-clip-own-default")


def test_a_value_a_knob_cannot_take_is_refused_at_bind_time():
    with pytest.raises(ConfigError, match=re.escape(
        "policy_loss=test-dual-clip-required: its knob dual_clip_c takes float, got None "
        "(--model.init_args.policy_loss.knobs.dual_clip_c)"
    )):  # fmt: skip
        GRPO(policy_loss={"name": "test-dual-clip-required", "knobs": {**CLIP, "dual_clip_c": None}})
    with pytest.raises(ConfigError, match=r"policy_loss=test-dual-clip-required needs the knob 'dual_clip_c'"):
        GRPO(policy_loss={"name": "test-dual-clip-required", "knobs": CLIP})
    required = GRPO(policy_loss={"name": "test-dual-clip-required", "knobs": {**CLIP, "dual_clip_c": 1.5}})
    assert dual_clipped_token_loss(required) == pytest.approx(1.5)


def test_every_algorithm_runs_its_pieces_with_the_knobs_it_records():
    """(Was: binding on purpose (AlgorithmArgs) changed nothing for the library's algorithms.) Every library
    algorithm records each kind's piece with every knob it has, and its bound functions run with those values."""
    from rlvr_lightning import algos
    from rlvr_lightning.pieces.choices import CHOICES

    for name in algos.__all__:
        module = getattr(algos, name)()
        pieces = module.settings.pieces
        bound = {"advantage_estimator": pieces.estimator, "policy_loss": pieces.objective.loss,
                 "rollout_correction": pieces.correct, "proximal_policy": pieces.approximate_proximal}  # fmt: skip
        for registry in KINDS:
            recorded, piece = module.hparams[registry.key], registry.selected(module.settings.args)
            assert set(recorded) == {"name", "knobs"} and recorded["name"] == piece.name, (name, registry.key)
            assert set(recorded["knobs"]) == set(piece.knobs), (name, registry.key)
            assert recorded["knobs"] == piece.knob_values(module.settings.args[registry.key].knobs), (name, registry.key)
            if registry.key in bound:
                fn = bound[registry.key]
                assert fn.keywords == {k: recorded["knobs"][k] for k in piece.declared.taken_by[piece.fn]}, (name, registry.key)
        assert set(CHOICES) == {registry.key for registry in KINDS}
