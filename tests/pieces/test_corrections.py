"""Masked rollout corrections against their formulas, on small hand-checkable tensors: MIS per token and
IcePop weigh a token by its trainer/engine ratio inside the band, MIS per sequence weighs a sequence by
its importance ratio ρ(y) = Π_t ρ_t inside the band, the geometric mask keeps (1) or drops (0) a
sequence by ρ(y)^(1/|y|); outside the band the weight is 0. Then tis-geo, OPSM and KPop."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.pieces import rollout_corrections
from rlvr_lightning.pieces.kinds import CorrectionInputs
from rlvr_lightning.tensor_math import LOG_RATIO_CLAMP
from tests.algos.test_grpo_family import off_policy_batch

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


def sequences(*rows: list[float], width: int | None = None):
    """(old, rollout, mask) whose token ratios π_old/π_rollout are the given rows (rollout log-probs 0, so
    each log-ratio is exactly float32(log ratio)), right-padded with 0 to the longest row."""
    width = width or max(len(r) for r in rows)
    old, mask = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
    for n, row in enumerate(rows):
        old[n, : len(row)] = torch.tensor([math.log(r) for r in row])
        mask[n, : len(row)] = 1.0
    return old, torch.zeros_like(old), mask


# ρ(y) = 1, 1.5, 3, 0.25; geometric means 1, 1.5^(1/3) ≈ 1.145, 3^(1/3) ≈ 1.442, 0.5
FOUR = sequences([2.0, 0.5], [1.0, 1.5, 1.0], [1.0, 3.0, 1.0], [0.5, 0.5])


def test_mis_sequence_weighs_a_kept_sequence_by_its_importance_ratio_the_product_of_its_token_ratios():
    w, stats = weights("mis-sequence", *FOUR)  # the default band [0.5, 2]: 3 and 0.25 leave it
    expected = torch.tensor([[1.0, 1, 0], [1.5, 1.5, 1.5], [0, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(w, expected)
    assert stats["is_masked_frac"] == pytest.approx(5 / 10) and stats["is_weight_mean"] == pytest.approx(6.5 / 10)
    w, _ = weights("mis-sequence", *FOUR, is_mask_low=0.0, is_mask_high=4.0)  # one-sided, ρ(y) ≤ 4
    torch.testing.assert_close(w, torch.tensor([[1.0, 1, 0], [1.5, 1.5, 1.5], [3, 3, 3], [0.25, 0.25, 0]]))
    w, _ = weights("mis-sequence")  # ρ = 2·0.5 = 1 (kept) and 1·3·1 = 3 (dropped)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))


def test_the_band_edges_are_inside_the_band():
    old, rollout, mask = sequences([2.0, 1.0], [0.5], [2.0, 1.001], [0.5 / 1.001])
    w, _ = weights("mis-sequence", old, rollout, mask)
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0], [0.5, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    w, _ = weights("geo-mask", old, rollout, mask, is_mask_low=0.5, is_mask_high=2**0.5)  # √2 per token in [2, 1]
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]))


def test_a_long_sequence_is_weighed_in_log_space_where_the_product_would_overflow():
    # 8,192 tokens: 4,096 at ratio e and 4,096 at 1/e. Any product of the ratios passes e^88 (float32's
    # largest) or e^-103 on the way; their logs sum to exactly 0, ρ(y) = 1.
    T = 8192
    balanced = torch.cat([torch.ones(T // 2), -torch.ones(T // 2)])
    far = torch.full((T,), 0.02)  # ρ(y) = e^163.84: no float32 holds it
    old, mask = torch.stack([balanced, far]), torch.ones(2, T)
    w, _ = weights("mis-sequence", old, torch.zeros_like(old), mask)
    torch.testing.assert_close(w, torch.stack([torch.ones(T), torch.zeros(T)]))
    w, _ = weights("mis-sequence", old, torch.zeros_like(old), mask, is_mask_low=0.0, is_mask_high=math.inf)
    assert torch.isfinite(w).all()  # kept by a band to ∞: its weight is the clamped e^LOG_RATIO_CLAMP
    torch.testing.assert_close(w[1], torch.full((T,), math.exp(LOG_RATIO_CLAMP)))
    w, _ = weights("geo-mask", old, torch.zeros_like(old), mask)  # geometric means 1 and e^0.02
    torch.testing.assert_close(w, torch.stack([torch.ones(T), torch.zeros(T)]))


def test_geo_mask_keeps_or_drops_a_whole_sequence_by_its_geometric_mean_ratio():
    w, stats = weights("geo-mask", *FOUR, is_mask_low=0.5, is_mask_high=2.0)  # all inside: weight 1, not ρ
    torch.testing.assert_close(w, FOUR[2])
    assert stats["is_masked_frac"] == 0.0 and stats["is_weight_mean"] == 1.0
    w, stats = weights("geo-mask", *FOUR, is_mask_low=0.6, is_mask_high=1.2)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]]))
    assert stats["is_masked_frac"] == pytest.approx(5 / 10)


def test_geo_mask_does_not_depend_on_the_length_where_the_sequence_ratio_does():
    old, rollout, mask = sequences([1.1] * 2, [1.1] * 200)  # ρ(y) = 1.21 and 1.1^200; both geometric 1.1
    w, _ = weights("geo-mask", old, rollout, mask, is_mask_low=1.0, is_mask_high=1.2)
    torch.testing.assert_close(w, mask)
    w, _ = weights("mis-sequence", old, rollout, mask)
    torch.testing.assert_close(w, torch.cat([torch.full((1, 200), 1.21) * mask[:1], torch.zeros(1, 200)]))


@pytest.mark.parametrize("log_ratio,kept", [(5e-4, 1.0), (-5e-4, 1.0), (2e-3, 0.0), (-2e-3, 0.0)])
def test_geo_mask_default_band_is_a_tenth_of_a_percent_per_token(log_ratio, kept):
    old = torch.full((1, 100), log_ratio)
    w, _ = weights("geo-mask", old, torch.zeros_like(old), torch.ones_like(old))  # [0.999, 1.001]
    torch.testing.assert_close(w, torch.full((1, 100), kept))


@pytest.mark.parametrize("name", ["tis-sequence", "mis-sequence", "geo-mask"])
def test_a_sequence_level_correction_puts_one_weight_on_all_of_a_sequences_tokens(name):
    """Its `level` trait says so (the step then lets it weigh a per-sequence loss such as GSPO's)."""
    assert rollout_corrections.get(name)["level"] == "sequence"
    _, old, mask = off_policy_batch(seed=4, spread=0.0)
    rollout = old + 1e-3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1)) * mask
    knobs = {"tis_cap": 2.0} if name.startswith("tis") else {"is_mask_low": 0.5, "is_mask_high": 2.0}
    w, _ = rollout_corrections.get(name).fn(CorrectionInputs(old, rollout, mask), **knobs)
    for n in range(len(w)):
        row = w[n][mask[n].bool()]
        torch.testing.assert_close(row, row[:1].expand_as(row))


@pytest.mark.parametrize("name", ["tis-token", "tis-sequence", "mis-token", "mis-sequence", "geo-mask", "icepop"])
def test_what_lies_off_the_mask_reaches_no_weight(name):
    """Padding may hold anything (±inf, NaN); a masked-out token's ratio (here 100) is not part of ρ(y)."""
    old, rollout, mask = sequences([1.2, 100.0, 0.9, 1.0], [1.1, 1.0])
    mask[0, 1] = 0.0
    knobs = {"tis_cap": 2.0} if name.startswith("tis") else {"is_mask_low": 0.5, "is_mask_high": 2.0}
    clean, _ = rollout_corrections.get(name).fn(CorrectionInputs(old * mask, rollout, mask), **knobs)
    old[1, 2:], rollout[1, 2:] = torch.tensor([math.inf, math.nan]), torch.tensor([-math.inf, math.inf])
    w, stats = rollout_corrections.get(name).fn(CorrectionInputs(old, rollout, mask), **knobs)
    assert torch.isfinite(w).all() and all(math.isfinite(v) for v in stats.values())
    torch.testing.assert_close(w, clean)
    assert (w[mask == 0] == 0).all()


@pytest.mark.parametrize("name", ["mis-token", "mis-sequence", "geo-mask", "icepop"])
def test_without_mismatch_every_weight_is_one(name):
    _, old, mask = off_policy_batch(seed=2)
    w, stats = weights(name, old, old, mask)
    torch.testing.assert_close(w, mask)
    assert stats["is_masked_frac"] == 0.0


def test_an_empty_band_is_a_config_error():
    with pytest.raises(ConfigError, match=r"0 ≤ is_mask_low < is_mask_high, got \[2.0, 1.0\]"):
        rollout_corrections.get("icepop").bind({"is_mask_low": 2.0, "is_mask_high": 1.0})  # its knob check


def test_an_empty_band_stops_the_algorithm_at_construction():
    from rlvr_lightning.algos import GRPO

    with pytest.raises(ConfigError, match="is_mask_low < is_mask_high"):
        GRPO(rollout_correction={"name": "mis-token", "knobs": {"is_mask_low": 3.0}})
    GRPO(rollout_correction={"name": "mis-token", "knobs": {"is_mask_low": 0.5}})


# ---- rollout corrections: tis-geo, OPSM, KPop ------------------------------------------------------------
def correction(name: str, old: list[list[float]], rollout: list[list[float]], mask=None, advantages=None, **knobs):
    old_t, rollout_t = torch.tensor(old), torch.tensor(rollout)
    mask = torch.ones_like(old_t) if mask is None else torch.tensor(mask)
    adv = None if advantages is None else torch.tensor(advantages)
    return rollout_corrections.get(name).fn(CorrectionInputs(old_t, rollout_t, mask, adv), **knobs)


def test_tis_geo_weighs_each_sequence_by_the_geometric_mean_of_its_ratios():
    ln2 = math.log(2)
    ln4 = 2 * ln2
    weights, _ = correction("tis-geo", [[ln2, -ln2, 0.0], [ln2, ln2, 50.0], [ln4, ln4, 0.0]], [[0.0] * 3] * 3,
                            mask=[[1, 1, 0], [1, 1, 0], [1, 1, 0]], tis_cap=3.0)  # fmt: skip
    # ρ = (2, ½): geometric mean 1 (product 1); (2, 2): 2 (product 4); (4, 4): 4, capped at 3; the padded
    # position changes none.
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 0.0], [3.0, 3.0, 0.0]]))


def test_opsm_masks_negative_sequences_whose_rollout_drifted_from_theta_old():
    rollout = [[0.0, 0.0]] * 3
    old = [[-0.1, -0.1], [-0.1, -0.1], [-1e-4, -1e-4]]  # mean log π_rollout − log π_old: 0.1, 0.1, exactly δ
    weights, stats = correction("opsm", old, rollout, advantages=[[-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0]], opsm_delta=1e-4)
    assert weights.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]  # Â ≥ 0 kept; at δ kept (strict)
    assert stats["opsm_masked_frac"] == pytest.approx(1 / 3)


def test_kpop_keeps_a_token_while_the_binary_kl_both_ways_stays_under_the_threshold():
    old, rollout = [[math.log(0.5), math.log(0.3)]], [[math.log(0.25), math.log(0.3)]]
    # p = 0.5, q = 0.25: KL(p‖q) = 0.1438, KL(q‖p) = 0.1308.
    tight, _ = correction("kpop", old, rollout, kpop_threshold=0.1)
    between, _ = correction("kpop", old, rollout, kpop_threshold=0.135)  # over one way only: still masked
    loose, _ = correction("kpop", old, rollout, kpop_threshold=0.15)
    torch.testing.assert_close(tight, torch.tensor([[0.0, 1.0]]))
    torch.testing.assert_close(between, torch.tensor([[0.0, 1.0]]))
    torch.testing.assert_close(loose, torch.tensor([[2.0, 1.0]]))  # kept: weighted by π_old/π_rollout


@pytest.mark.parametrize("name", ["kpop", "icepop", "mis-token"])
def test_a_token_the_engine_gave_probability_zero_is_dropped(name):
    """Probability 0 under the engine (log-prob −inf) is no sample of it: the token is dropped (weight 0), not kept
    at the clamped ratio e^20, although the trainer's probability is as tiny (their binary KL is then ~0)."""
    weights, stats = correction(name, [[math.log(1e-9), math.log(0.5)]], [[-math.inf, math.log(0.5)]])
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.0]]))
    assert stats["is_masked_frac"] == 0.5


def test_kpop_reads_the_binary_kl_of_a_tiny_probability_exactly():
    """The engine gave the token 1e-15, the trainer 0.07: D(p‖q) = 0.07·ln(0.07/1e-15) + 0.93·ln(0.93/1) = 2.16 > φ = 2,
    so the token is left out; a clamp of q at 1e-8 read 1.04 and kept it at the weight e^20."""
    p, q = 0.07, 1e-15
    exact = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
    assert exact == pytest.approx(2.1641, abs=1e-4)
    from rlvr_lightning.tensor_math import binary_kl

    d = binary_kl(torch.tensor([math.log(p)], dtype=torch.float64), torch.tensor([math.log(q)], dtype=torch.float64))
    assert d.item() == pytest.approx(exact, rel=1e-9)
    weights, _ = correction("kpop", [[math.log(p), math.log(0.5)]], [[math.log(q), math.log(0.5)]], kpop_threshold=2.0)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.0]]))
