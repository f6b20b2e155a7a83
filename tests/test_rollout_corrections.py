"""Masked rollout corrections (MIS per token and per sequence, IcePop) against their formulas: the
weight is the trainer/engine ratio inside the band and 0 outside, on small hand-checkable tensors."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.pieces import rollout_corrections
from rlvr_lightning.pieces.kinds import CorrectionInputs
from tests.test_grpo_family import off_policy_batch

MASK = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
OLD = torch.log(torch.tensor([[0.5, 0.4, 1.0], [0.3, 0.9, 0.5]])) * MASK
ROLLOUT = torch.log(torch.tensor([[0.25, 0.8, 1.0], [0.3, 0.3, 0.5]])) * MASK  # ratios 2, 0.5 | 1, 3, 1


def weights(name: str, old=OLD, rollout=ROLLOUT, mask=MASK, **band):
    return rollout_corrections.get(name).fn(CorrectionInputs(old, rollout, mask), **band)


def test_mis_token_keeps_the_ratio_inside_the_band_and_drops_the_token_outside():
    w, stats = weights("mis-token")  # the default band [0, 2]: one-sided, as Yao et al.
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 0.0], [1.0, 0.0, 1.0]]))
    assert stats["is_masked_frac"] == pytest.approx(1 / 5) and stats["is_weight_mean"] == pytest.approx(4.5 / 5)


def test_icepop_masks_on_both_sides():
    w, stats = weights("icepop")  # [0.5, 5]: everything kept, reweighted by its ratio
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 0.0], [1.0, 3.0, 1.0]]))
    assert stats["is_masked_frac"] == 0.0
    w, stats = weights("icepop", is_mask_low=0.6, is_mask_high=2.5)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.0, 0.0], [1.0, 0.0, 1.0]]))
    assert stats["is_masked_frac"] == pytest.approx(2 / 5)


def test_icepop_with_an_infinite_band_is_plain_importance_sampling():
    _, old, mask = off_policy_batch(seed=1)
    rollout = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(0)) * mask
    w, stats = weights("icepop", old, rollout, mask, is_mask_low=0.0, is_mask_high=math.inf)
    untruncated, _ = rollout_corrections.get("tis-token").fn(CorrectionInputs(old, rollout, mask), tis_cap=math.inf)
    torch.testing.assert_close(w, untruncated)
    torch.testing.assert_close(w, (old - rollout).exp() * mask)
    assert stats["is_masked_frac"] == 0.0


def test_mis_sequence_masks_whole_sequences_by_the_geometric_mean_of_their_ratios():
    w, stats = weights("mis-sequence")  # band [0.99, 1.01]: geometric means 1 (kept) and 3^(1/3) (dropped)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert stats["is_masked_frac"] == pytest.approx(3 / 5)
    w, _ = weights("mis-sequence", is_mask_low=0.5, is_mask_high=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 0.0], [3 ** (1 / 3)] * 3]))


@pytest.mark.parametrize("name", ["mis-token", "mis-sequence", "icepop"])
def test_without_mismatch_every_weight_is_one(name):
    _, old, mask = off_policy_batch(seed=2)
    w, stats = weights(name, old, old, mask)
    torch.testing.assert_close(w, mask)
    assert stats["is_masked_frac"] == 0.0


def test_an_empty_band_is_a_config_error():
    with pytest.raises(ConfigError, match=r"0 ≤ is_mask_low < is_mask_high, got \[2.0, 1.0\]"):
        rollout_corrections.get("icepop").bind({}, {"is_mask_low": 2.0, "is_mask_high": 1.0})  # its knob check


def test_an_empty_band_stops_the_algorithm_at_construction():
    from rlvr_lightning.algos import GRPO

    with pytest.raises(ConfigError, match="is_mask_low < is_mask_high"):
        GRPO(rollout_correction="mis-token", piece_args={"is_mask_low": 3.0})
    GRPO(rollout_correction="mis-token", piece_args={"is_mask_low": 0.5})
