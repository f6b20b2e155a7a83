"""Loss aggregators (docs/algorithms.md#loss-aggregation): how one micro-batch's per-token losses are
reduced, with the optimizer step's *global* normalisers (`OptimizerStepNorms`: counts over all micro-batches
and ranks), so the accumulated gradient does not depend on how the step is split. Multiplying by the
world size undoes DDP/FSDP gradient averaging."""

from __future__ import annotations

from torch import Tensor

from rlvr_lightning.pieces.kinds import OptimizerStepNorms, loss_aggregators


@loss_aggregators.register("seq-mean-token-mean", anchor="loss-aggregation")
def seq_mean_token_mean(per_tok: Tensor, mask: Tensor, norms: OptimizerStepNorms) -> Tensor:
    """Mean over each sequence's tokens, then over the step's sequences (GRPO)."""
    return ((per_tok * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / norms.num_seqs * norms.world_size


@loss_aggregators.register("token-mean", anchor="loss-aggregation")
def token_mean(per_tok: Tensor, mask: Tensor, norms: OptimizerStepNorms) -> Tensor:
    """Mean over every token of the step (DAPO): long answers weigh more."""
    return (per_tok * mask).sum() / norms.num_tokens * norms.world_size


@loss_aggregators.register("seq-mean-token-sum", anchor="loss-aggregation")
def seq_mean_token_sum(per_tok: Tensor, mask: Tensor, norms: OptimizerStepNorms) -> Tensor:
    """Sum over each sequence's tokens, mean over the step's sequences (verl's `seq-mean-token-sum`): a
    sequence weighs by its length, and the loss's scale grows with the answers."""
    return (per_tok * mask).sum() / norms.num_seqs * norms.world_size


@loss_aggregators.register("seq-mean-token-sum-norm", anchor="loss-aggregation")
def seq_mean_token_sum_norm(per_tok: Tensor, mask: Tensor, norms: OptimizerStepNorms) -> Tensor:
    """Sum over tokens / (sequences × max_response_length), a constant (Dr. GRPO: no length bias)."""
    if not norms.norm_const:
        raise ValueError("seq-mean-token-sum-norm needs a constant normaliser (max_response_length)")
    return (per_tok * mask).sum() / (norms.num_seqs * norms.norm_const) * norms.world_size
