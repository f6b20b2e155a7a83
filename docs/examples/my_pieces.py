"""A user's own advantage estimator, registered from outside the package (the README's worked example).

    PYTHONPATH=docs/examples make train ARGS="--imports my_pieces --model.init_args.advantage_estimator.name rank"
"""

import torch

from rlvr_lightning.pieces import advantage_estimators
from rlvr_lightning.pieces.kinds import AdvantageInputs


@advantage_estimators.register("rank", anchor=None)
def rank_advantage(inputs: AdvantageInputs, *, rank_scale: float = 1.0) -> torch.Tensor:
    """Rank within the group, centred and scaled to [−rank_scale, rank_scale]; ties share their mean rank."""
    r = inputs.rewards.view(-1, inputs.group_size).float()
    below = (r[:, None, :] < r[:, :, None]).sum(-1).float()  # rivals with a lower reward
    ties = (r[:, None, :] == r[:, :, None]).sum(-1).float()  # itself included
    rank = below + (ties - 1) / 2  # 0 … G−1
    return (rank / (inputs.group_size - 1) * 2 - 1).mul(rank_scale).view(-1)
