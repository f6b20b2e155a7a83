"""Algorithm pieces: advantage estimators, policy losses, loss aggregators, KL estimators, rollout
corrections and proximal policies, each a pure function registered under a name (`registry`, `kinds`).
Importing this package registers every built-in piece: `advantages` and `distillation` (advantage estimators), `token_losses`, `covariance` and `real`
(policy losses), `aggregation`, `kl`, `corrections`, `proximal`."""

# They register in this order, the order `python -m rlvr_lightning list` and the errors show.
from rlvr_lightning.pieces import advantages, distillation, token_losses, covariance, real, aggregation, kl, corrections, proximal  # noqa: F401  # isort: skip
from rlvr_lightning.pieces.kinds import (
    KINDS,
    advantage_estimators,
    kl_estimators,
    loss_aggregators,
    policy_losses,
    proximal_policies,
    rollout_corrections,
)

__all__ = ["KINDS", "advantage_estimators", "policy_losses", "loss_aggregators", "kl_estimators", "rollout_corrections",
           "proximal_policies"]
