"""Call registered pieces by name with plain tensors, as the tests of their formulas do: each helper
looks the piece up in its registry and calls the registered function itself (no copy of its math)."""

from __future__ import annotations

import torch

from rlvr_lightning.pieces import kl_estimators, loss_aggregators, policy_losses, rollout_corrections
from rlvr_lightning.pieces.kinds import CorrectionInputs, OptimizerStepNorms, TokenLossInputs

# Token-level losses that read one micro-batch alone; those with a step-level token selection (Clip-Cov,
# KL-Cov) are tested in test_covariance_losses.py and through the update in test_algorithms.py.
SURROGATES = [p.name for p in policy_losses.pieces() if p["level"] == "token" and p["token_selection"] is None]


def surrogate(name, logp, old_logp, adv, mask, eps_low=0.2, eps_high=0.2):
    """(per-token loss, stats) of the token-level policy loss `name`, with the clip range if it has one
    (its other knobs at their defaults, as the module binds them)."""
    piece = policy_losses.get(name)
    clip = {"clip_eps_low": eps_low, "clip_eps_high": eps_high}
    loss = piece.bind({k: v for k, v in clip.items() if k in piece.knobs})  # a loss without a clip range reads none
    return loss(TokenLossInputs(logp, old_logp, adv, mask))


def aggregate(per_tok, mask, mode, num_seqs, num_tokens, norm_const=None, world_size=1) -> torch.Tensor:
    norms = OptimizerStepNorms(float(num_seqs), float(num_tokens), 0.0, 0.0, world_size, norm_const)
    return loss_aggregators.get(mode).fn(per_tok, mask, norms)


def kl_penalty(logp, ref_logp, estimator="k3") -> torch.Tensor:
    return kl_estimators.get(estimator).fn(logp, ref_logp)


def truncated_is_weights(old_logp, rollout_logp, mask, level, cap):
    """The `tis-<level>` rollout correction's weights and statistics (`off`: `none`)."""
    piece = rollout_corrections.get("none" if level == "off" else f"tis-{level}")
    knobs = {} if level == "off" else {"tis_cap": cap}
    return piece.fn(CorrectionInputs(old_logp, rollout_logp, mask), **knobs)
