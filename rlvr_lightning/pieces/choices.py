"""The config's choice of one piece of each kind, with that piece's knobs: the module's arguments
`advantage_estimator`, `policy_loss`, `loss_agg`, `kl_estimator`, `rollout_correction` and `proximal_policy`.

    policy_loss:
      name: ppo-clip                    # --model.init_args.policy_loss.name ppo-clip
      knobs: {clip_eps_high: 0.28}      # --model.init_args.policy_loss.knobs.clip_eps_high 0.28

A flag `.knobs.<knob>` adds to the knobs a config file gave; a config file's `knobs:` replaces the algorithm's. An
algorithm class sets its paper's defaults in the same form (DAPO's `policy_loss`). In Python a bare name works too:
`GRPO(policy_loss="gspo")` is gspo at its own defaults: a choice given whole replaces the class's default choice,
knobs included (`GSPO(policy_loss="gspo-token")` runs at 0.2/0.2, not GSPO's 3e-4/4e-4; give them with the name).
A piece that runs inside another (on-policy distillation's `opd_reward`) takes its knobs from a knob of that other
(`advantage_estimator: {name: opd, knobs: {opd_reward: pass-at-k, opd_reward_knobs: {pass_at_k: 2}}}`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.pieces.kinds import (
    AdvantageEstimatorName,
    KLEstimatorName,
    LossAggName,
    PolicyLossName,
    ProximalPolicyName,
    RolloutCorrectionName,
)


@dataclass(frozen=True)
class PieceChoice:
    """A piece, by name or dotted path, and the knobs it runs with (its own defaults for the others)."""

    name: str
    knobs: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:  # messages name the piece: `model.policy_loss=gspo`
        return str(self.name)


@dataclass(frozen=True)
class AdvantageEstimatorChoice(PieceChoice):
    name: AdvantageEstimatorName
    knobs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicyLossChoice(PieceChoice):
    name: PolicyLossName
    knobs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LossAggChoice(PieceChoice):
    name: LossAggName
    knobs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class KLEstimatorChoice(PieceChoice):
    name: KLEstimatorName
    knobs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RolloutCorrectionChoice(PieceChoice):
    name: RolloutCorrectionName | None = None  # None: the device's (`rlvr_lightning.device_defaults`)
    knobs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ProximalPolicyChoice(PieceChoice):
    name: ProximalPolicyName
    knobs: dict[str, Any] = field(default_factory=dict)


# The module's argument of each kind (`Registry.key`) → its choice's type.
CHOICES: dict[str, type[PieceChoice]] = {
    "advantage_estimator": AdvantageEstimatorChoice,
    "policy_loss": PolicyLossChoice,
    "loss_agg": LossAggChoice,
    "kl_estimator": KLEstimatorChoice,
    "rollout_correction": RolloutCorrectionChoice,
    "proximal_policy": ProximalPolicyChoice,
}


def choice_of(key: str, value: Any) -> PieceChoice:
    """The choice `value` gives for the module's argument `key`: a choice (the CLI's), a bare name (Python), a
    mapping (a checkpoint's hyper-parameters, a preset read as YAML), a parsed namespace, or None (the device's
    rollout correction)."""
    cls = CHOICES[key]
    if isinstance(value, cls):
        return value
    if value is None or isinstance(value, str):
        return cls(name=value)
    if isinstance(value, PieceChoice):
        return cls(name=value.name, knobs=dict(value.knobs))
    given = value.as_dict() if hasattr(value, "as_dict") else value
    if not isinstance(given, Mapping) or set(given) - {"name", "knobs"} or not isinstance(given.get("knobs") or {}, Mapping):
        raise ConfigError(f"model.{key} takes {{name: <piece>, knobs: {{<knob>: <value>}}}}, got {value!r}")
    return cls(name=given.get("name"), knobs=dict(given.get("knobs") or {}))
