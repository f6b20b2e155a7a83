"""From a scored batch with sequence advantages to `UpdateInputs`: the tensor layout, θ_old and
reference log-probs, the advantage shapers' token weights, the loss mask and the rollout correction's
weights."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from rlvr_lightning.context import AdvantageShaper, ScoredBatch, StepContext
from rlvr_lightning.pieces.kinds import CorrectionInputs
from rlvr_lightning.rollout.types import RolloutTensors
from rlvr_lightning.training.batch import UpdateInputs
from rlvr_lightning.training.behaviour import (
    ApproximateProximal,
    BehaviourSource,
    FromUpdateForward,
    Precomputed,
    separate_pass,
)
from rlvr_lightning.training.layout import UpdateLayout
from rlvr_lightning.training.shaping import hidden_weigher, rollout_token_weights
from rlvr_lightning.training.step_metrics import StageTimer


def prepare_update(
    step: StepContext,
    batch: ScoredBatch,
    t: RolloutTensors,
    layout: UpdateLayout,
    source: BehaviourSource,
    correction: Callable,
    mask_truncated: bool,
    shapers: list[AdvantageShaper],
    timer: StageTimer | None = None,
    approximate_proximal: Callable | None = None,
) -> tuple[UpdateInputs, dict[str, float]]:
    """The batch ready for the update, its advantages reshaped by the shapers' token weights known before it
    (`UpdateInputs.token_weights`), and the rollout correction's statistics. `t`: the rollout's tensors on the step's
    device."""
    rollout, device = batch.rollout, step.device
    timer = timer or StageTimer()
    G, temperature = rollout.group_size, rollout.sampling.temperature
    with timer("attribution"):
        shaper_weights = rollout_token_weights(step, batch, shapers)
    weigher = hidden_weigher(step, batch, shapers)
    # Shapers read θ_old's LM-head inputs in the update's forward when that runs at θ_old and every
    # micro-batch holds whole groups (THR scores a group from all its responses); else in the θ_old pass.
    weigh_in_update = weigher is not None and source == "update" and layout.keeps_groups_whole(G)
    counts = t.token_counts  # [N, 2] prompt and response tokens: what token budgets pack
    with timer("old_logprob"):
        old_logp, ref_logp, hidden_weights = separate_pass(
            step.policy,
            step.ref_policy,
            t,
            temperature,
            lambda rows, whole_groups: layout.micro_batches(rows, counts, step.collectives, G if whole_groups else 1),
            layout.logprob_chunk_tokens,
            with_old=source == "trainer",
            weigher=None if weigh_in_update else weigher,
            lockstep=step.collectives.world_size > 1,
            packed=layout.packing,
        )
    loss_mask = t.sampled_mask  # sampled response tokens: not padding, not what an environment inserted
    if mask_truncated:
        loss_mask = loss_mask * (~rollout.truncated).to(device, loss_mask.dtype)[:, None]
    if any(c.excluded for c in rollout.completions):  # a tool run's stability guards
        loss_mask = loss_mask * (~rollout.excluded).to(device, loss_mask.dtype)[:, None]
    if source == "proximal":  # θ_old and the correction's weights come from the update's forwards
        versions = rollout.token_versions(t.response_mask.shape[1]).to(device)
        behaviour = ApproximateProximal(approximate_proximal, correction, versions, step.policy_version)
    elif source == "update":
        behaviour = FromUpdateForward(t.response_mask.shape, device, weigher if weigh_in_update else None)
    else:
        behaviour = Precomputed(t.rollout_logp if source == "rollout" else old_logp, source)
    token_advantages = batch.advantages.to(device)[:, None] if batch.token_advantages is None else batch.token_advantages.to(device)
    advantages = token_advantages * t.sampled_mask
    correct = rollout.correct.to(device, torch.float32)
    inputs = UpdateInputs(
        t, advantages, ref_logp, loss_mask, None, correct, G, temperature, behaviour, shaper_weights, hidden_weights
    )
    if (weights := inputs.token_weights()) is not None:  # those known before the update
        inputs = replace(inputs, advantages=advantages * weights.to(device))
    if source == "proximal":
        return inputs, {}
    is_weight, is_stats = correction(CorrectionInputs(old_logp, t.rollout_logp, loss_mask, inputs.advantages))
    return replace(inputs, is_weight=is_weight), is_stats
