"""GSPO — Group Sequence Policy Optimization (arXiv 2507.18071), and GSPO-token.

The importance ratio is the length-normalised *sequence* likelihood ratio, and clipping acts on
whole sequences (docs/algorithms.md#gspo-and-gspo-token):

    s_i = (π_θ(y_i|x) / π_old(y_i|x))^(1/|y_i|)
    GSPO:       J = E[ (1/G) Σ_i min(s_i Â_i, clip(s_i, 1−ε_low, 1+ε_high) Â_i) ]
    GSPO-token: s_{i,t} = sg[s_i] · π_θ(y_{i,t}) / sg[π_θ(y_{i,t})], averaged over tokens

With per-sequence advantages both give the same gradient; GSPO-token also accepts token
advantages reshaped by THR/OAR. On the first, on-policy mini-batch s_i = 1 and the update equals
GRPO's; GSPO differs on the later mini-batches, hence K = 4 mini-batches per rollout batch and the
tiny clip range 3e-4 / 4e-4 of the paper.
"""

from __future__ import annotations

from rlvr_lightning.algos.grpo import GRPO
from rlvr_lightning.pieces.choices import PolicyLossChoice


class GSPO(GRPO):
    docs = "docs/algorithms.md#gspo-and-gspo-token"

    def __init__(
        self,
        policy_loss: PolicyLossChoice = PolicyLossChoice("gspo", {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4}),
        num_mini_batches: int = 4,
        kl_coef: float = 0.0,
        **kwargs,
    ) -> None:
        """
        Args:
            policy_loss: `gspo`, or `gspo-token` (needed when THR/OAR reshape token advantages), with the paper's clip
                range of the sequence ratio, clip_eps_low / clip_eps_high = 3e-4 / 4e-4 (§5.1).
            num_mini_batches: optimizer steps per rollout batch (K); GSPO's ratio is 1 on the first one.
        """
        super().__init__(
            policy_loss=policy_loss,
            num_mini_batches=num_mini_batches,
            kl_coef=kl_coef,
            **kwargs,
        )
