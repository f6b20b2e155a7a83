"""GRPO — Group Relative Policy Optimization (DeepSeekMath, arXiv 2402.03300).

    J = E_q E_{o_1..G ~ π_old} [ (1/G) Σ_i (1/|o_i|) Σ_t { min(ρ_{i,t} Â_i, clip(ρ_{i,t}, 1−ε_low, 1+ε_high) Â_i)
                                                         − β k3_{i,t} } ]

with Â_i the group-normalised reward (docs/algorithms.md#group-relative-advantages, unbiased std) broadcast to every token,
ρ = π_θ / π_old per token, aggregation seq-mean-token-mean, and an optional k3 KL to the frozen
initial policy. Everything else (rollout, rewards, updates, weight sync) is the shared step.

The pieces are RLVRModule's defaults (advantage_estimator grpo, policy_loss ppo-clip, loss_agg
seq-mean-token-mean, kl_estimator k3); this class only names the paper. Dr. GRPO, DAPO and GSPO are
GRPO with other pieces and defaults (`dr_grpo.py`, `dapo.py`, `gspo.py`).
"""

from __future__ import annotations

from rlvr_lightning.algos.base import RLVRModule


class GRPO(RLVRModule):
    """GRPO: the shared step with its default pieces."""

    docs = "docs/algorithms.md#grpo"
