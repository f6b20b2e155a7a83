"""The loss aggregators (`pieces.aggregation`) against their formulas on hand-checkable tensors."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.pieces.kinds import OptimizerStepNorms, loss_aggregators


# ---- seq-mean-token-sum ----------------------------------------------------------------------------------
def test_seq_mean_token_sum_sums_each_sequence_and_averages_over_the_steps_sequences():
    per_tok = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the 9 is padding
    norms = OptimizerStepNorms(num_seqs=4.0, num_tokens=5.0, num_groups=1.0, num_mixed_seqs=0.0, world_size=2, norm_const=3.0)
    # (6 + 9) / 4 sequences of the whole step, × 2 ranks (undoing the gradient averaging).
    assert loss_aggregators.get("seq-mean-token-sum").fn(per_tok, mask, norms).item() == pytest.approx(15 / 4 * 2)
