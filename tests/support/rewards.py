"""Rewards for runs whose policy the verifier alone would never reward."""

from __future__ import annotations

import torch

from rlvr_lightning.callbacks.rollout import RolloutCallback
from rlvr_lightning.rollout.types import Verdict


class ParityReward(RolloutCallback):
    """A deterministic stand-in reward after the verifier's: "the completion's token ids sum to an even
    number". An untrained or barely trained policy answers almost nothing correctly, so with the verifier's
    rewards alone few steps would move the weights or Adam's moments (a resume that lost them would go
    unnoticed) and few groups would be mixed (DAPO would draw round after round)."""

    def on_rollout_generated(self, step, rollout) -> Verdict:
        return Verdict(torch.tensor([float(sum(c.token_ids) % 2 == 0) for c in rollout.completions]))
