"""The engine-against-trainer mismatch, logged every step whether or not a correction is on, on tensors checked by
hand: a k3 estimate of KL(π_rollout ‖ π_old) and the shares IcePop's token band and Seq-MIS's sequence band would
drop. The metric accumulator's token-weighted means and extremes, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr_lightning.training.step_metrics import MetricAccumulator, mismatch_metrics


def test_the_mismatch_kl_and_the_shares_a_masked_correction_would_drop():
    ratios = torch.tensor([[1.0, 2.0, 8.0], [1.0, 1.5, 1.0]])  # π_old/π_rollout per token; the last is padding
    rollout = torch.full((2, 3), math.log(0.1))
    old = rollout + ratios.log()
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old[1, 2] = 50.0  # whatever padding holds counts nowhere
    metrics = mismatch_metrics(old, rollout, mask)
    k3 = [0.0, 1 - math.log(2), 7 - math.log(8), 0.0, 0.5 - math.log(1.5)]  # r − 1 − log r
    assert metrics["train/mismatch_kl"] == pytest.approx(sum(k3) / 5, rel=1e-5)
    assert metrics["train/mismatch_drop_token_frac"] == pytest.approx(1 / 5)  # 8 is outside IcePop's [0.5, 5]
    assert metrics["train/mismatch_drop_seq_frac"] == pytest.approx(1 / 2)  # Π = 16 outside [0.5, 2]; 1.5 inside


def test_on_policy_there_is_no_mismatch():
    logp = torch.log(torch.rand(3, 4) * 0.9 + 0.05)
    metrics = mismatch_metrics(logp, logp.clone(), torch.ones(3, 4))
    assert metrics == {"train/mismatch_kl": 0.0, "train/mismatch_drop_token_frac": 0.0, "train/mismatch_drop_seq_frac": 0.0}


def test_the_metric_accumulator_gives_token_weighted_means_and_extremes_by_hand():
    """Two micro-batches, 2 and 3 real tokens: the ratio's mean is weighted by tokens, its max is over real tokens
    only, a per-sequence `_max` sample keeps the largest, and `padding_frac` weighs each forward by its slots."""
    acc = MetricAccumulator()
    acc.add_tokens({"ratio": torch.tensor([[1.0, 3.0, 9.0]])}, None, torch.tensor([[1.0, 1.0, 0.0]]))
    acc.add_tokens({"ratio": torch.tensor([[2.0, 2.0, 5.0]]), "kl_max": torch.tensor([0.5, 0.25])}, None, torch.ones(1, 3))
    acc.add_padding(torch.tensor([[1, 1, 0, 0]]))
    acc.add_padding(torch.tensor([[1, 1, 1, 1]]))
    acc.add("loss", torch.tensor(2.0))
    acc.add("loss", torch.tensor(4.0))
    got = acc.result()
    assert got["ratio_mean"] == (1 + 3 + 2 + 2 + 5) / 5 and got["ratio_max"] == 5.0  # the masked 9 is not a token
    assert got["kl_max"] == 0.5 and got["padding_frac"] == 2 / 8 and got["loss"] == 3.0
