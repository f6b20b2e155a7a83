"""Clip-Cov and KL-Cov against their formulas on hand-checkable tensors: the per-token covariance of
log-prob and advantage, KL-Cov's exact top share, Clip-Cov's draw inside its band at the rate that
gives its share, each loss's gradient given a selection, and the module wiring (θ_old known before the
update, covariance statistics logged, bad knobs refused when the module is built). The selection's
independence of micro-batch layout and rank count is tested through the update in test_algorithms.py
and test_token_mean_ranks.py."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.algos.grpo import GRPO
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.pieces import policy_losses
from rlvr_lightning.pieces.covariance import order_keys
from rlvr_lightning.pieces.kinds import TokenLossInputs, TokenSelectionInputs
from rlvr_lightning.seeding import keyed_uniform
from rlvr_lightning.training.step_metrics import MetricAccumulator
from tests.algos.test_grpo_family import off_policy_batch
from tests.support.pieces import aggregate, surrogate
from tests.support.update_harness import attach, gradient, prepared, sample_rollout

PINNED_DRAWS = [0.0909, 0.5915, 0.5089]  # keyed_uniform((0, 3, 0, 1), [5], ·)'s first draws


def select(name: str, old, adv, mask, uniform=None, **knobs):
    """The registered loss `name`'s token selection, with its knobs (defaults where not given)."""
    fn = policy_losses.get(name)["token_selection"]
    draws = uniform or (lambda rows: torch.rand(len(rows), mask.shape[1], generator=torch.Generator().manual_seed(0)))
    return fn(TokenSelectionInputs(old, adv, mask, draws), **knobs)


def random_step(seed: int, N: int = 64, T: int = 40):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (N, 1), generator=g)).float()
    old = -3 * torch.rand(N, T, generator=g) * mask
    adv = torch.randn(N, 1, generator=g).expand(N, T) * mask
    return old, adv, mask


def test_the_covariance_by_hand():
    # Tokens (ℓ, Â): (−1, 1), (−2, 1), (−3, −1), one padding slot. Means: Â 1/3, ℓ −2.
    old = torch.tensor([[-1.0, -2.0], [-3.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    _, stats = select("kl-cov", old, adv, mask, kl_cov_ratio=0.5)
    torch.testing.assert_close(stats["cov_mean"], torch.tensor([[2 / 3, 0.0], [4 / 3, 0.0]]))
    # Its token mean is the population covariance of (ℓ, Â) over the step's tokens.
    assert (stats["cov_mean"] * mask).sum() / mask.sum() == pytest.approx(2 / 3)
    assert stats["cov_max"].max().item() == pytest.approx(4 / 3)


def test_order_keys_sort_like_the_floats():
    x = torch.cat([torch.randn(1000) * 10 ** torch.randint(-30, 30, (1000,)).float(),
                   torch.tensor([0.0, -0.0, 1e-42, -1e-42, float("inf"), -float("inf")])])  # fmt: skip
    x = x[~x.isnan()].unique()  # distinct values (−0.0 and 0.0 are one value: one is dropped)
    assert torch.equal(order_keys(x).argsort(), x.argsort())


@pytest.mark.parametrize("share", [0.01, 0.1, 0.5])
def test_kl_cov_takes_exactly_the_top_share_by_covariance(share):
    old, adv, mask = random_step(seed=1)
    selected, stats = select("kl-cov", old, adv, mask, kl_cov_ratio=share)
    cov = stats["cov_mean"].masked_fill(~mask.bool(), -float("inf"))
    k = int(mask.sum().item() * share)
    top = torch.zeros(cov.numel(), dtype=torch.bool)
    top[cov.flatten().topk(k).indices] = True
    assert torch.equal(selected.flatten(), top)


def test_kl_cov_takes_at_least_one_token_and_breaks_ties_at_random_to_take_exactly_its_share():
    old = torch.tensor([[-1.0, -1.0, -3.0, -3.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    # c = (Â − 0)(ℓ + 2): 1, 1, 1, 1 — four ties; one token asked for: the one with the smallest draw.
    draws = torch.tensor([[0.7, 0.9, 0.2, 0.5]])
    selected, _ = select("kl-cov", old, adv, mask, lambda rows: draws[rows], kl_cov_ratio=1e-6)
    assert selected.tolist() == [[False, False, True, False]]
    old[0, 0] = -0.5  # c = 1.5 for token 0 alone: the top 1e-6 is that one token
    assert select("kl-cov", old, adv, mask, kl_cov_ratio=1e-6)[0].tolist() == [[True, False, False, False]]
    # A step with no advantage signal: every c is 0, and still exactly the share is taken (2 of 40).
    old, _, _ = random_step(seed=3, N=4, T=10)
    selected, _ = select("kl-cov", old, torch.zeros(4, 10), torch.ones(4, 10), kl_cov_ratio=0.05)
    assert selected.sum() == 2


def test_clip_cov_draws_only_inside_its_band_at_the_rate_that_gives_its_share():
    old, adv, mask = random_step(seed=2, N=400, T=60)
    selected, stats = select("clip-cov", old, adv, mask, clip_cov_ratio=0.01, clip_cov_lb=0.5, clip_cov_ub=3.0)
    cov = stats["cov_mean"]
    in_band = mask.bool() & (cov > 0.5) & (cov < 3.0)
    assert (selected <= in_band).all() and in_band.sum() > 10 * selected.sum()  # a share of the candidates
    expected = 0.01 * mask.sum().item()  # Binomial(candidates, rate) with mean 1% of the step's tokens
    assert abs(selected.sum().item() - expected) < 4 * expected**0.5
    # A share larger than the band holds: every candidate.
    assert torch.equal(select("clip-cov", old, adv, mask, clip_cov_ratio=1.0, clip_cov_lb=0.5, clip_cov_ub=3.0)[0],
                       in_band)  # fmt: skip


def test_clip_cov_detaches_the_selected_tokens_and_is_ppo_elsewhere():
    logp, old, mask = off_policy_batch(seed=3, spread=0.3)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    selected = (torch.rand(mask.shape, generator=torch.Generator().manual_seed(2)) < 0.3) & mask.bool()

    def grad_and_loss(name, sel=None):
        logp.grad = None
        loss = policy_losses.get(name).bind({"clip_eps_low": 0.2, "clip_eps_high": 0.2})
        per_tok, _ = loss(TokenLossInputs(logp, old, adv, mask, sel))
        total = aggregate(per_tok, mask, "token-mean", mask.shape[0], mask.sum().item())
        total.backward()
        return logp.grad.clone(), total.item()

    g_cov, loss_cov = grad_and_loss("clip-cov", selected)
    g_ppo, loss_ppo = grad_and_loss("ppo-clip")
    assert selected.sum() >= 5 and (g_ppo[selected] != 0).any()
    assert (g_cov[selected] == 0).all()
    torch.testing.assert_close(g_cov[~selected], g_ppo[~selected])
    assert loss_cov == pytest.approx(loss_ppo)  # detached, not dropped: the loss value is PPO's


def test_kl_cov_gradient_by_hand():
    logp, old, mask = off_policy_batch(seed=4, spread=0.3)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3)) * mask
    selected = (torch.rand(mask.shape, generator=torch.Generator().manual_seed(4)) < 0.3) & mask.bool()
    beta = 0.7
    per_tok, stats = policy_losses.get("kl-cov").fn(TokenLossInputs(logp, old, adv, mask, selected), kl_cov_coef=beta)
    aggregate(per_tok, mask, "token-mean", mask.shape[0], mask.sum().item()).backward()
    ratio = (logp.detach() - old).exp()
    # ∂/∂ℓ of −Â·r + β·|ℓ − ℓ_old|·sel = −Â·r + β·sign(ℓ − ℓ_old)·sel, unclipped, over T_S tokens.
    expected = (-adv * ratio + beta * (logp.detach() - old).sign() * selected) * mask / mask.sum()
    torch.testing.assert_close(logp.grad, expected)
    far = mask.bool() & ((ratio - 1).abs() > 0.3) & (adv != 0)
    assert far.any() and (logp.grad[far] != 0).all() and not stats["clipped_high"].any()  # no clip


def test_the_losses_need_their_selection():
    logp, old, mask = off_policy_batch(seed=5)
    with pytest.raises(ValueError, match="token selection"):
        surrogate("kl-cov", logp, old, torch.ones_like(mask), mask)


@pytest.mark.parametrize("name", ["clip-cov", "kl-cov"])
def test_one_update_per_batch_still_takes_theta_old_from_its_own_pass_and_logs_the_covariance(tiny_policy_dir, name):
    """The selection reads θ_old's log-probs of the whole step before its first forward, so the module
    computes them in the separate pass even with one update per rollout batch; the step logs the
    covariance statistics the loss acted on."""
    knobs = {"clip-cov": {"clip_cov_ratio": 0.5, "clip_cov_lb": 0.0, "clip_cov_ub": 100.0}, "kl-cov": {"kl_cov_ratio": 0.2}}
    module = attach(GRPO, tiny_policy_dir, policy_loss={"name": name, "knobs": knobs[name]}, num_mini_batches=1)
    assert module.rlvr_step.resolved.behaviour == "trainer"
    inputs = prepared(module, sample_rollout(module))
    acc = MetricAccumulator()
    gradient(module, inputs, 3, acc)
    stats = acc.result()
    assert stats["cov_selected_frac"] > 0 and stats["cov_max"] >= stats["cov_selected_mean"] > stats["cov_mean"]


@pytest.mark.parametrize(
    "name,knobs",
    [("kl-cov", {"kl_cov_ratio": 0.0}), ("clip-cov", {"clip_cov_ratio": 1.5}),
     ("clip-cov", {"clip_cov_lb": 5.0, "clip_cov_ub": 1.0}), ("kl-cov", {"kl_cov_coef": -1.0})],
)  # fmt: skip
def test_bad_selection_knobs_fail_when_the_module_is_built(name, knobs):
    with pytest.raises(ConfigError, match=rf"^model.policy_loss={name}: .*\[.*\(given\)"):
        GRPO(policy_loss={"name": name, "knobs": knobs})


def test_the_selection_knobs_are_the_losses_knobs():
    """`make list` shows a piece's knobs: the selection's (set in the loss's `knobs`) are the loss's too."""
    assert policy_losses.get("clip-cov").knobs == ("clip_eps_low", "clip_eps_high", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")
    assert policy_losses.get("kl-cov").knobs == ("kl_cov_coef", "kl_cov_ratio")


def test_keyed_draws_depend_only_on_the_key_and_the_sequence():
    """Clip-Cov's draws and KL-Cov's tie-breaks: a sequence draws the same numbers whichever other
    sequences share its micro-batch or rank, position t is the t-th draw at any width, and the seeds
    are a fixed function of the integers (pinned: a run's selections reproduce in any process)."""
    alone, together = keyed_uniform((0, 3, 0, 1), [5], 6), keyed_uniform((0, 3, 0, 1), [9, 5, 2], 10)
    torch.testing.assert_close(together[1, :6], alone[0], rtol=0, atol=0)
    assert not torch.equal(keyed_uniform((0, 3, 0, 2), [5], 6), alone)  # another optimizer step
    assert keyed_uniform((0, 3, 0, 1), [], 6).shape == (0, 6)
    assert [round(v, 4) for v in alone[0, :3].tolist()] == PINNED_DRAWS


def test_minus_zero_is_zero_so_a_step_without_signal_breaks_ties_by_the_draws_alone():
    """With Â ≡ 0 every c_t is ±0.0 by the side of the mean log-prob its token is on: one value, tied."""
    assert order_keys(torch.tensor([-0.0])) == order_keys(torch.tensor([0.0]))
    old = torch.tensor([[-0.1, -0.2, -3.0, -4.0]])  # tokens 2, 3 lie below the mean: c = −0.0
    draws = torch.tensor([[0.9, 0.8, 0.1, 0.2]])
    selected, _ = select("kl-cov", old, torch.zeros(1, 4), torch.ones(1, 4), lambda rows: draws[rows], kl_cov_ratio=0.5)
    assert selected.tolist() == [[False, False, True, True]]


def test_a_token_with_a_non_finite_input_is_left_out_not_every_token():
    old, adv, mask = random_step(seed=4)
    reference, _ = select("kl-cov", old, adv, mask, kl_cov_ratio=0.1)
    n, t = reference.nonzero()[0].tolist()
    old[n, t] = -float("inf")
    selected, stats = select("kl-cov", old, adv, mask, kl_cov_ratio=0.1)
    assert not selected[n, t] and selected.sum() >= reference.sum() - 1 and stats["cov_mean"].isfinite().all()
