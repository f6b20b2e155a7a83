"""The pieces that make Dr. GRPO, DAPO and GSPO out of GRPO (docs/algorithms.md: Dr. GRPO, DAPO, GSPO),
and the train–inference mismatch correction."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.pieces.advantages import group_advantage, mixed_groups, overlong_penalty
from rlvr_lightning.pieces.token_losses import sequence_log_ratio
from tests.support.pieces import SURROGATES, aggregate, surrogate, truncated_is_weights


def off_policy_batch(seed: int = 0, N: int = 8, T: int = 7, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = -torch.rand(N, T, generator=g) * mask
    logp = (old + spread * torch.randn(N, T, generator=g) * mask).requires_grad_(True)
    return logp, old, mask


# ---- GSPO ------------------------------------------------------------------------------------
def test_gspo_ratio_is_the_length_normalised_sequence_ratio():
    logp, old, mask = off_policy_batch(spread=0.01)
    _, stats = surrogate("gspo", logp, old, torch.ones_like(mask), mask, 3e-4, 4e-4)
    # s_n = (π_θ(y)/π_old(y))^(1/L_n), computed here from the sequence log-likelihoods.
    expected = ((logp.detach() * mask).sum(1) - (old * mask).sum(1)).div(mask.sum(1)).exp()
    for n in range(mask.shape[0]):
        torch.testing.assert_close(stats["ratio"][n][mask[n].bool()], expected[n].expand(int(mask[n].sum())))
    _, token_stats = surrogate("gspo-token", logp, old, torch.ones_like(mask), mask, 3e-4, 4e-4)
    torch.testing.assert_close(token_stats["ratio"] * mask, stats["ratio"] * mask)


@pytest.mark.parametrize("spread", [1e-4, 0.01, 0.3])  # inside, around and far beyond the 3e-4 clip range
def test_gspo_token_and_gspo_give_the_same_gradient_with_sequence_advantages(spread):
    logp, old, mask = off_policy_batch(seed=3, spread=spread)
    adv = group_advantage(torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1]), 4)[:, None] * mask
    grads = []
    for name in ("gspo", "gspo-token"):
        logp.grad = None
        per_tok, stats = surrogate(name, logp, old, adv, mask, 3e-4, 4e-4)
        aggregate(per_tok, mask, "seq-mean-token-mean", mask.shape[0], mask.sum().item()).backward()
        grads.append(logp.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-8)
    # Not vacuous at any spread: some sequences keep a gradient, and beyond the clip range others are
    # silenced by it (both losses agree on each sequence's branch, not only on zeros).
    passed = grads[0].abs().sum(1) > 0
    clipped = (stats["clipped_low"] | stats["clipped_high"]).any(1)
    assert passed.any(), "no sequence has a gradient: the comparison is vacuous"
    assert clipped.any() == (spread > 1e-3) and torch.equal(passed, ~clipped), (passed, clipped)


def test_gspo_clips_whole_sequences():
    logp, old, mask = off_policy_batch(seed=1, spread=0.3)
    s_bar = sequence_log_ratio(logp.detach(), old, mask)
    adv = torch.ones_like(mask)  # Â > 0: sequences with s > 1 + ε_high are clipped, all their tokens
    _, stats = surrogate("gspo", logp, old, adv, mask, 3e-4, 4e-4)
    high = s_bar.exp() > 1 + 4e-4
    assert high.any()
    for n in range(mask.shape[0]):
        assert bool(stats["clipped_high"][n][mask[n].bool()].all()) == bool(high[n])


# ---- layout invariance of the whole surrogate + aggregator + IS-weight pipeline ------------------
@pytest.mark.parametrize("loss_name", SURROGATES)
@pytest.mark.parametrize(
    "mode,C", [("seq-mean-token-mean", None), ("token-mean", None), ("seq-mean-token-sum-norm", 7)]
)
def test_micro_batches_and_ranks_do_not_change_the_gradient(loss_name, mode, C):
    logp, old, mask = off_policy_batch(seed=2, spread=0.05)
    rollout_logp = old + 0.02 * torch.randn_like(old) * mask
    w, _ = truncated_is_weights(old, rollout_logp, mask, "token", cap=1.01)
    adv = group_advantage(torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1]), 4)[:, None] * mask
    N_S, T_S = float(mask.shape[0]), mask.sum().item()

    def grad_for(splits, world_size=1):
        logp.grad = None
        for idx in splits:
            per_tok, _ = surrogate(loss_name, logp[idx], old[idx], adv[idx], mask[idx], 0.2, 0.28)
            loss = aggregate(per_tok * w[idx], mask[idx], mode, N_S, T_S, C, world_size)
            (loss / world_size).backward()  # simulated ranks: DDP/FSDP average the gradients
        return logp.grad.clone()

    whole = grad_for([list(range(8))])
    torch.testing.assert_close(grad_for([[0], [1, 2, 3], [4, 5], [6, 7]]), whole, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(grad_for([[0, 1, 2, 3], [4, 5, 6, 7]], world_size=2), whole, rtol=1e-5, atol=1e-8)


# ---- truncated importance sampling -------------------------------------------------------------
def test_truncated_is_weights_token_and_sequence_level():
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    old = torch.log(torch.tensor([[0.5, 0.4, 1.0], [0.2, 0.9, 0.5]])) * mask
    rollout = torch.log(torch.tensor([[0.25, 0.8, 1.0], [0.2, 0.3, 0.5]])) * mask
    w, stats = truncated_is_weights(old, rollout, mask, "token", cap=2.5)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 0.0], [1.0, 2.5, 1.0]]))  # 0.9/0.3 = 3 capped at 2.5
    assert stats["tis_capped_frac"] == pytest.approx(1 / 5)
    w_seq, _ = truncated_is_weights(old, rollout, mask, "sequence", cap=2.5)
    torch.testing.assert_close(w_seq, torch.tensor([[1.0, 1.0, 0.0], [2.5, 2.5, 2.5]]))  # products 1.0 and 3.0
    assert truncated_is_weights(old, rollout, mask, "off", cap=2.0) == (None, {})
    with pytest.raises(ValueError, match="registered: none, tis-token, tis-sequence"):
        truncated_is_weights(old, rollout, mask, "tok", cap=2.0)


def test_truncated_is_weights_are_one_without_mismatch():
    logp, old, mask = off_policy_batch()
    for level in ("token", "sequence"):
        w, stats = truncated_is_weights(old, old, mask, level, cap=2.0)
        torch.testing.assert_close(w, mask)
        assert stats["tis_capped_frac"] == 0.0


# ---- DAPO: overlong shaping and the mixed-group filter (dynamic sampling: training/test_dynamic_sampling.py) ----
def test_overlong_penalty_matches_the_paper_examples():
    L = torch.tensor([100, 16384, 16385, 18432, 20480, 20481])
    expected = torch.tensor([0.0, 0.0, -0.000244140625, -0.5, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(L, 20480, 4096), expected)
    assert torch.equal(overlong_penalty(L, 20480, 0), torch.zeros(6))
    with pytest.raises(ValueError, match="exceeds"):
        overlong_penalty(L, 40, 41)


def test_mixed_groups_looks_at_correctness_only():
    c = torch.tensor([1.0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0])
    assert mixed_groups(c, 4).tolist() == [True, False, False]
    assert mixed_groups(c, 3).tolist() == [True, False, True, False]


def test_dapo_refuses_maxrl_on_its_signed_or_penalised_rewards(tiny_policy_dir):
    """MaxRL's (r − r̄)/r̄ takes rewards in [0, 1]: on DAPO's ±1 a group at most half right has r̄ ≤ 0 and no
    signal at all, and the overlong penalty goes below 0. With 0/1 rewards and no penalty it is MaxRL's own."""
    from rlvr_lightning.algos import DAPO
    from rlvr_lightning.errors import ConfigError
    from tests.support.update_harness import attach

    for kwargs in ({}, {"signed_reward": False}, {"overlong_buffer_len": 0}):
        module = attach(DAPO, tiny_policy_dir, advantage_estimator="maxrl", **kwargs)
        with pytest.raises(ConfigError, match=r"^model.advantage_estimator=maxrl takes rewards in \[0, 1\]"):
            module.rlvr_step  # noqa: B018 (building it checks DAPO's settings)
    attach(DAPO, tiny_policy_dir, advantage_estimator="maxrl", signed_reward=False, overlong_buffer_len=0).rlvr_step  # noqa: B018
    # the same estimator as on-policy distillation's reward is refused the same way
    teacher = {"model_name_or_path": str(tiny_policy_dir)}
    module = attach(DAPO, tiny_policy_dir, advantage_estimator={"name": "opd", "knobs": {"opd_reward": "maxrl"}}, teacher=teacher)
    with pytest.raises(ConfigError, match=r"^model.opd_reward=maxrl takes rewards in \[0, 1\]"):
        module.rlvr_step  # noqa: B018
