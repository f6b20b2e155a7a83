"""Proximal policies of decoupled PPO (docs/algorithms.md#decoupled-ppo-and-the-proximal-policy): the
policy the clip is anchored to when the rollouts were sampled by older versions (asynchronous RL), while a
rollout correction weighs it against the behaviour policy that sampled."""

from __future__ import annotations

import torch

from rlvr_lightning.pieces.kinds import ProximalInputs, proximal_policies


@proximal_policies.register("recompute", anchor="decoupled-ppo-and-the-proximal-policy", forward=True)
def recompute(x: ProximalInputs) -> torch.Tensor:
    """π_prox = θ_old, the trainer's weights when the update began, from a no-grad pass over the batch before
    it (`model.behaviour.logprobs: trainer`). That pass runs outside this function: with this piece the update
    reads its result, so the function is only what it stands for at the first optimizer step, log π_θ."""
    return x.current_logp


@proximal_policies.register("loglinear", anchor="decoupled-ppo-and-the-proximal-policy")
def loglinear(x: ProximalInputs) -> torch.Tensor:
    """A-3PO's interpolation (Li, Wu and Shen 2025, arXiv 2512.06547; AReaL's `prox_logp_method: loglinear`):
    log π_prox = log π_behav + α (log π_θ − log π_behav), α = (v_prox − v_behav)/(v_θ − v_behav) per token,
    with no forward pass. At the update's first step v_θ = v_prox, so α = 1 and π_prox = π_θ exactly; a token
    sampled by the trainer's own version (v_behav = v_prox) keeps π_behav."""
    span = (x.current_version - x.behaviour_version).to(x.current_logp.dtype)
    behind = (x.proximal_version - x.behaviour_version).to(x.current_logp.dtype)
    alpha = torch.where(span > 0, behind / span.clamp(min=1), torch.ones_like(span))
    return x.behaviour_logp + alpha * (x.current_logp.detach() - x.behaviour_logp)
