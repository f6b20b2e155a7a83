"""From a scored rollout with sequence advantages to `UpdateInputs`: the tensor layout, θ_old and
reference log-probs, the advantage shapers' token weights, the loss mask and truncated-IS weights."""

from __future__ import annotations

import torch

from rlvr_lightning.callbacks.rollout import advantage_shapers
from rlvr_lightning.losses import truncated_is_weights
from rlvr_lightning.rollout.types import Rollout
from rlvr_lightning.training.batch import UpdateInputs
from rlvr_lightning.training.behaviour import FromUpdateForward, Precomputed, separate_pass
from rlvr_lightning.training.micro_batches import keeps_groups_whole
from rlvr_lightning.training.shaping import compose_token_weights, hidden_scorer, rollout_token_weights
from rlvr_lightning.training.step_metrics import StageTimer


def prepare_update(module, rollout: Rollout, timer: StageTimer | None = None) -> tuple[UpdateInputs, dict[str, float]]:
    """The rollout batch ready for `module`'s update, and the truncated-IS statistics.

    Sets `rollout.token_weights` to the shapers' weights known before the update (those read in the
    update's own forward are added by the training step afterwards)."""
    h, trainer = module.hparams, module.trainer
    timer = timer or StageTimer()
    t = rollout.tensors(module.datamodule.tokenizer.pad_token_id).to(module.device)
    G, temperature = rollout.group_size, rollout.sampling.temperature
    source = module.behaviour_source()
    shapers = advantage_shapers(trainer)
    with timer("attribution"):
        weights = rollout_token_weights(trainer, module, rollout, shapers)
    scorer = hidden_scorer(trainer, module, rollout, shapers)
    # Shapers read θ_old's LM-head inputs in the update's forward when that runs at θ_old and every
    # micro-batch holds whole groups (THR scores a group from all its responses); else in the θ_old pass.
    whole_groups_fit = keeps_groups_whole(h.micro_batch_size, h.max_tokens_per_micro_batch, G)
    score_in_update = scorer is not None and source == "update" and whole_groups_fit
    with timer("old_logprob"):
        old_logp, ref_logp, hidden_weights = separate_pass(
            module.policy, module.ref_policy, t, temperature,
            lambda rows, whole_groups: module.policy_update.micro_batches(rows, t.lengths, G if whole_groups else 1),
            h.logprob_chunk_tokens, with_old=source == "trainer", scorer=None if score_in_update else scorer,
            lockstep=trainer.world_size > 1,
        )  # fmt: skip
    weights = compose_token_weights(weights, hidden_weights)
    rollout.token_weights = weights
    advantages = rollout.advantages.to(module.device)[:, None] * t.response_mask
    if weights is not None:
        advantages = advantages * weights.to(module.device)
    loss_mask = t.response_mask
    if h.mask_truncated:
        loss_mask = loss_mask * (~rollout.truncated).to(module.device, loss_mask.dtype)[:, None]
    if source == "update":
        behaviour = FromUpdateForward(t.response_mask.shape, module.device, scorer if score_in_update else None)
    else:
        behaviour = Precomputed(t.rollout_logp if source == "engine" else old_logp, source)
    is_weight, is_stats = truncated_is_weights(old_logp, t.rollout_logp, loss_mask, h.tis_level, h.tis_cap)
    correct = rollout.correct.to(module.device, torch.float32)
    inputs = UpdateInputs(t, advantages, ref_logp, loss_mask, is_weight, correct, G, temperature, behaviour)
    return inputs, is_stats
