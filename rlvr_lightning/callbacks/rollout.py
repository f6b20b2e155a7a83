"""The hooks a callback can have inside the training step, and which callbacks have them.

`RolloutCallback.on_rollout_generated` runs right after generation and scoring: a callback watches the scored
rollout there and changes nothing (correctness and reward terms have one owner, the module's scoring stage,
`training.scoring`, configured by its `rewards` section). An `AdvantageShaper` reweights token advantages,
Â'_{n,t} = Â_n · w_{n,t}: THR and OAR are shapers, and any number of them compose by multiplying their weights.
The step's stages call these hooks with the step's context (policy, tokenizer, counters) and the scored batch; a
shaper's metrics for the batch are read once the update is done (`batch_metrics`).
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from rlvr_lightning.context import ScoredBatch, StepContext
from rlvr_lightning.rollout.types import Rollout


class RolloutCallback(Callback):
    """A Lightning callback that also sees each freshly generated rollout batch."""

    def on_rollout_generated(self, step: StepContext, rollout: Rollout) -> None:
        """After generation and scoring: the scored rollout (its correctness and reward terms), to watch; it returns
        None (the step refuses a returned value: give correctness with `rewards.correctness`)."""
        return None


class AdvantageShaper(RolloutCallback):
    """A callback that reweights token advantages (THR, OAR). Both hooks may be used at once.

    Weights are positive multipliers of the token advantages, so they never flip an advantage's sign;
    a token no shaper weighs keeps weight 1. Per rollout batch, the step calls `token_weights` once,
    after the advantages; then, if `hidden_rows` asks for them, it hands θ_old's LM-head inputs to
    `weights_from_hidden`, read from a forward that runs anyway (the θ_old pass, or the update's own
    forward when that runs at θ_old), a few whole groups at a time, each group exactly once (so a
    shaper knows its batch is fully scored when it has seen every group it asked for).

    `weighs_sampled_tokens_only`: True for a shaper that leaves an environment's inserted tokens (a tool's output,
    `Completion.sampled_mask`) out of its weights and their normalisation; a run in an environment refuses the others.
    """

    weighs_sampled_tokens_only: bool = False

    def token_weights(self, step: StepContext, batch: ScoredBatch) -> torch.Tensor | None:
        """Weights [N, T'] of the whole rollout batch computed from it and the policy at θ_old (OAR),
        or None. Also marks the start of a rollout batch for shapers that read hidden states."""
        return None

    def hidden_rows(self, batch: ScoredBatch) -> torch.Tensor | None:
        """Bool [N], whole groups: the sequences whose θ_old LM-head inputs `weights_from_hidden` reads."""
        return None

    def weights_from_hidden(
        self, step: StepContext, batch: ScoredBatch, hidden: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """Weights [L_n] of sequence n from its θ_old LM-head inputs `hidden[n]` [L_n, d] (THR).
        `hidden` holds whole groups of the rows `hidden_rows` asked for, a few groups per call."""
        return {}

    def batch_metrics(self) -> dict[str, float]:
        """The last rollout batch's metrics (logged as `train/<key>`), read after its update."""
        return {}


def rollout_callbacks(trainer: L.Trainer) -> list[RolloutCallback]:
    return [cb for cb in trainer.callbacks if isinstance(cb, RolloutCallback)]


def advantage_shapers(trainer: L.Trainer) -> list[AdvantageShaper]:
    return [cb for cb in trainer.callbacks if isinstance(cb, AdvantageShaper)]
