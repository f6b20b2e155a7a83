"""REAL and REAL-BCE (docs/algorithms.md#real): loss values, closed-form gradient weights,
their bounds and monotonicity, zero signal from non-mixed groups, and group integrity in the module."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr_lightning.algos import REAL
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.pieces.real import real_grad_weights, real_loss
from rlvr_lightning.pieces.token_losses import sequence_log_ratio
from rlvr_lightning.rollout.types import Verdict
from rlvr_lightning.training.settings import ComputeSettings
from tests.support.settings import checked, resettle
from tests.support.update_harness import attach, gradient, independent_logprobs, prepared, sample_rollout, with_old_logp

TAU = 0.5
C_TOY = torch.tensor([1.0, 0, 0, 0])


def test_anchor_loss_and_gradients_on_the_toy_group():
    """docs/algorithms.md#worked-example: one group, c = (1,0,0,0), L = (2,4,4,6), on policy, τ = 0.5, B = 1."""
    lengths = (2, 4, 4, 6)
    mask = (torch.arange(6)[None] < torch.tensor(lengths)[:, None]).float()
    logp = (-torch.rand(4, 6) * mask).requires_grad_(True)
    s_bar = sequence_log_ratio(logp, logp.detach(), mask)
    s_bar.retain_grad()
    loss = real_loss(s_bar, C_TOY, 4, normaliser=1, tau=TAU)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(8), abs=1e-6)  # log(1+1) + log(1+3)
    torch.testing.assert_close(s_bar.grad, torch.tensor([-1.0, 0.5, 0.5, 0.5]))
    for n, (L, w) in enumerate(zip(lengths, (-0.5, 0.125, 0.125, 0.0833333))):
        torch.testing.assert_close(logp.grad[n, :L], torch.full((L,), w), atol=1e-6, rtol=1e-5)
        assert torch.all(logp.grad[n, L:] == 0)


def test_bce_variant_on_the_toy_group_and_against_torch():
    s_bar = torch.zeros(4, requires_grad=True)
    loss = real_loss(s_bar, C_TOY, 4, normaliser=4, tau=TAU, variant="bce")
    loss.backward()
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)  # docs/algorithms.md#worked-example
    torch.testing.assert_close(s_bar.grad, torch.tensor([-0.25, 0.25, 0.25, 0.25]))
    # Arbitrary logits, one mixed and one all-correct group: the mean BCE over the mixed rollouts.
    s = torch.randn(8, generator=torch.Generator().manual_seed(0)) * 3
    c = torch.tensor([1.0, 0, 1, 0, 1, 1, 1, 1])
    expected = torch.nn.functional.binary_cross_entropy_with_logits(s[:4] / TAU, c[:4])
    assert real_loss(s, c, 4, normaliser=4, tau=TAU, variant="bce").item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("variant", ["anchor", "bce", "pairwise"])
@pytest.mark.parametrize("scale", [0.1, 3.0, 50.0])
def test_closed_form_weights_equal_autograd_and_are_bounded(variant, scale):
    g = torch.Generator().manual_seed(int(scale * 10))
    G, B = 8, 6
    c = (torch.rand(B * G, generator=g) < 0.4).float()
    c[:G] = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0])  # at least one mixed group
    c[G : 2 * G] = 1.0  # and one all-correct group
    s = (torch.randn(B * G, generator=g) * scale).requires_grad_(True)
    real_loss(s, c, G, normaliser=1.0, tau=TAU, variant=variant).backward()
    W = real_grad_weights(s.detach(), c, G, 1.0, TAU, variant)
    torch.testing.assert_close(s.grad, W, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(W).all()
    if variant == "anchor":
        assert W.abs().max() <= 1 / TAU  # strict in exact arithmetic; fp32 may round onto the bound at ±50
    assert torch.equal(W[G : 2 * G], torch.zeros(G))


def test_anchor_weights_are_monotonic_in_the_sequence_logit():
    grid = torch.linspace(-20, 20, 81)
    pos_w, neg_w = [], []
    for x in grid:
        s = torch.tensor([x, 0.3, -0.2, 0.1])
        c = torch.tensor([1.0, 1, 0, 0])
        pos_w.append(real_grad_weights(s, c, 4, 1.0, TAU)[0].abs())
        neg_w.append(real_grad_weights(s, 1 - c, 4, 1.0, TAU)[0])  # the same sequence as a negative
    pos_w, neg_w = torch.stack(pos_w), torch.stack(neg_w)
    # Strictly monotonic where fp32 resolves the change (|s̄/τ| ≲ 10), never reversed anywhere.
    central = (grid.abs() <= 5)[1:]
    assert (pos_w[1:] < pos_w[:-1])[central].all() and (pos_w[1:] <= pos_w[:-1]).all()  # under-learned get most push
    assert (neg_w[1:] > neg_w[:-1])[central].all() and (neg_w[1:] >= neg_w[:-1]).all() and (neg_w > 0).all()
    assert neg_w[-1] == pytest.approx(1 / TAU, rel=1e-3) and neg_w.max() <= 1 / TAU  # saturates, never dominates


def test_on_policy_weights_follow_the_class_sizes():
    c = torch.tensor([1.0, 1, 1, 0, 0, 0, 0, 0])  # n+ = 3, n− = 5
    W = real_grad_weights(torch.zeros(8), c, 8, 1.0, TAU)
    torch.testing.assert_close(W[:3], torch.full((3,), -1 / (TAU * 4)))
    torch.testing.assert_close(W[3:], torch.full((5,), 1 / (TAU * 6)))


@pytest.mark.parametrize("variant", ["anchor", "bce", "pairwise"])
@pytest.mark.parametrize("labels", [[1.0, 1, 1, 1], [0.0, 0, 0, 0]])
def test_groups_without_both_classes_give_zero_loss_and_gradient(variant, labels):
    s = torch.randn(4, requires_grad=True)
    loss = real_loss(s, torch.tensor(labels), 4, normaliser=1.0, tau=TAU, variant=variant)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(s.grad, torch.zeros(4))  # still a graph: 0·Σs̄


def real_step_by_hand(logp, old_logp, mask, correct, variant):
    """docs/algorithms.md#real with explicit sums over the step's 2 prompts of G = 4: s̄_k = mean_t(log π_θ −
    log π_old); anchor: (1/B) Σ_{mixed g} [log(1 + Σ_{O+} e^{−s̄/τ}) + log(1 + Σ_{O−} e^{s̄/τ})], B = prompts;
    bce: (1/M) Σ_{k in mixed groups} −log σ(±s̄_k/τ), M = rollouts in mixed groups."""
    s_bar = [((logp[k] - old_logp[k]) * mask[k]).sum() / mask[k].sum() for k in range(8)]
    c = correct.tolist()
    total, prompts, mixed_rollouts = 0.0, 0, 0
    for g in range(2):
        members = range(4 * g, 4 * g + 4)
        prompts += 1
        if 0 < sum(c[k] for k in members) < 4:
            mixed_rollouts += 4
            pos, neg = [k for k in members if c[k] == 1], [k for k in members if c[k] == 0]
            if variant == "anchor":
                total = total + torch.log(1 + sum(torch.exp(-s_bar[k] / TAU) for k in pos))
                total = total + torch.log(1 + sum(torch.exp(s_bar[k] / TAU) for k in neg))
            else:
                total = total + sum(-torch.log(torch.sigmoid(s_bar[k] / TAU)) for k in pos)
                total = total + sum(-torch.log(1 - torch.sigmoid(s_bar[k] / TAU)) for k in neg)
    return total / (prompts if variant == "anchor" else mixed_rollouts)


@pytest.mark.parametrize("variant", ["anchor", "bce"])
def test_non_mixed_groups_count_in_the_prompt_normaliser(tiny_policy_dir, variant):
    """Through the module's own step (it counts B, or M, itself): group 1 is all wrong, so it adds nothing
    to the sum but counts in B = 2 prompts (not 8 sequences, not 1 mixed group); M = 4 mixed rollouts. Loss
    and gradient equal the formula written out over an independent forward of the policy, off policy."""
    module = attach(REAL, tiny_policy_dir, policy_loss=f"real-{variant}", compute=ComputeSettings(micro_batch_size=4))
    rollout = sample_rollout(module)
    rollout = rollout.scored(Verdict(torch.cat([rollout.correct[:4], torch.zeros(4)])))  # group 1 all wrong
    inputs = prepared(module, rollout)
    mask = inputs.tensors.response_mask
    behind = 0.3 * torch.rand(8, 8, generator=torch.Generator().manual_seed(0))  # off policy: s̄ > 0
    old_logp = (independent_logprobs(module.policy, rollout) - behind) * mask
    loss, grad = gradient(module, with_old_logp(inputs, old_logp), 4)
    module.policy.zero_grad(set_to_none=True)
    logp = independent_logprobs(module.policy, rollout, grad=True)
    expected = real_step_by_hand(logp, old_logp, mask, rollout.correct, variant)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    expected_grad = torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None])
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)
    assert grad.abs().sum() > 0


# ---- the module ------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["anchor", "bce"])
def test_micro_batches_of_whole_groups_and_two_pass_give_the_one_pass_gradient(tiny_policy_dir, variant):
    module = attach(REAL, tiny_policy_dir, policy_loss=f"real-{variant}")
    inputs = prepared(module, sample_rollout(module))
    old_logp = inputs.behaviour.old_logp_all()
    inputs = with_old_logp(inputs, old_logp + 0.05 * torch.randn_like(old_logp) * inputs.tensors.response_mask)

    def off_policy(update):  # off policy: the two-pass method must run its first pass
        update.updates_since_rollout = 1

    loss_one, g_one = gradient(module, inputs, 8)
    loss_groups, g_groups = gradient(module, inputs, 4)  # whole groups of G = 4
    torch.testing.assert_close(g_groups, g_one, rtol=1e-4, atol=1e-6)
    resettle(module, two_pass=True)
    for size in (3, 1):  # micro-batches that split groups
        loss_two, g_two = gradient(module, inputs, size, tweak=off_policy)
        torch.testing.assert_close(g_two, g_one, rtol=1e-4, atol=1e-6)
        assert loss_two.item() == pytest.approx(loss_one.item(), rel=1e-5)
    # Token budgets of ~2 rows: the two-pass method on rows sorted by length (groups split and
    # reordered), then the one-pass loss, whose micro-batches must then hold whole groups.
    budget = 2 * int(inputs.tensors.lengths.max())
    for two_pass in (True, False):
        resettle(module, two_pass=two_pass)
        loss_budget, g_budget = gradient(module, inputs, 8, max_tokens=budget, tweak=off_policy)
        torch.testing.assert_close(g_budget, g_one, rtol=1e-4, atol=1e-6)
        assert loss_budget.item() == pytest.approx(loss_one.item(), rel=1e-5)
    assert g_one.abs().sum() > 0


def test_two_pass_skips_its_first_pass_on_policy(tiny_policy_dir):
    module = attach(REAL, tiny_policy_dir)
    inputs = prepared(module, sample_rollout(module))  # θ = θ_old: every s̄ is exactly 0
    _, g_one = gradient(module, inputs, 8)
    resettle(module, two_pass=True)
    calls = []

    def counting(update):
        original = update.sequence_log_ratio
        update.sequence_log_ratio = lambda *a, **k: calls.append(1) or original(*a, **k)

    _, g_two = gradient(module, inputs, 3, tweak=counting)
    torch.testing.assert_close(g_two, g_one, rtol=1e-4, atol=1e-6)
    assert len(calls) == 3  # only the second pass: one forward per micro-batch (3 + 3 + 2 sequences)


def test_group_splitting_micro_batches_are_refused_without_two_pass(tiny_policy_dir):
    module = attach(REAL, tiny_policy_dir, compute=ComputeSettings(micro_batch_size=6), num_mini_batches=2)  # G = 4
    with pytest.raises(ConfigError, match="two_pass"):
        checked(module)
def test_real_config_errors():
    with pytest.raises(ConfigError, match="tau"):
        REAL(policy_loss={"name": "real-anchor", "knobs": {"tau": 0}})
    with pytest.raises(ConfigError, match=r"registered: ppo-clip, .*, real-anchor, real-bce, real-pairwise"):
        REAL(policy_loss="real-softmax")
    with pytest.raises(ConfigError, match="group level"):
        REAL(rollout_correction="tis-token")
