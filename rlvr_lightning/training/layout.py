"""How one rollout batch is updated: mini-batches, passes, micro-batch layout and clipping; and the
optimizer handles the update steps with."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from rlvr_lightning.context import Collectives
from rlvr_lightning.training.micro_batches import keeps_groups_whole, split_rows


@dataclass(frozen=True)
class UpdateLayout:
    num_mini_batches: int  # K optimizer steps per pass; the prompts are split into K mini-batches
    ppo_epochs: int  # passes over the rollout batch
    micro_batch_size: int
    max_tokens_per_micro_batch: int | None
    logprob_chunk_tokens: int
    max_grad_norm: float
    norm_const: float  # C of seq-mean-token-sum-norm: rollout.max_response_length
    packing: bool = False  # micro-batches run packed (`models.packing`); token budgets count real tokens

    def keeps_groups_whole(self, group_size: int) -> bool:
        return keeps_groups_whole(self.micro_batch_size, self.max_tokens_per_micro_batch, group_size)

    def micro_batches(
        self, rows: torch.Tensor, token_counts: torch.Tensor, collectives: Collectives, unit: int = 1
    ) -> list[torch.Tensor]:
        """The micro-batches of `rows` (see `training.micro_batches`; `token_counts`: [N, 2] prompt and
        response tokens), the same count on every rank (the largest any rank needs); `unit` = G keeps
        groups whole."""
        return split_rows(
            rows,
            token_counts,
            self.micro_batch_size,
            self.max_tokens_per_micro_batch,
            unit,
            lambda count: collectives.agree(count, op="max"),
            packed=self.packing,
        )


@dataclass(frozen=True)
class Optimization:
    """The optimizer, its schedule, the parameters it clips, and the backward to call (Lightning's
    `manual_backward`, which the strategy may wrap)."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    parameters: Callable[[], Iterable[torch.nn.Parameter]]
    backward: Callable[[torch.Tensor], None]
