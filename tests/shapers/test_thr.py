"""THR as an advantage shaper (`shapers.thr`, docs/algorithms.md#thr-in-the-training-step): its settings' checks, and
the shaper inside a real module's step: p = 0 is the base algorithm bit for bit, mixed groups only are reweighted, no
sign flips, an environment's inserted tokens weigh 1, read in the update's forward or a separate θ_old pass alike, and
the losses it composes with."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from rlvr_lightning.algos import GRPO, GSPO, REAL
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.models.forward import policy_forward
from rlvr_lightning.shapers.settings import THRSettings
from rlvr_lightning.training.settings import ComputeSettings
from rlvr_lightning.training.shaping import HiddenWeigher
from tests.support.settings import checked
from tests.support.update_harness import attach, gradient, prepared, sample_rollout


def test_bad_settings_are_one_error_line():
    with pytest.raises(ConfigError, match=r"^model.shapers.thr.p=1.5 must lie in \[-1, 1\]"):
        THRSettings(p=1.5).check()
    with pytest.raises(ConfigError, match=r"^model.shapers.thr.threshold=absolute needs model.shapers.thr.thr_abs"):
        THRSettings(p=0.1, threshold="absolute").check()
    with pytest.raises(ConfigError, match=r"^model.shapers.thr.threshold"):
        THRSettings(p=0.1, threshold="median").check()


def with_thr(cls, tiny_policy_dir, thr: THRSettings | None, **kwargs):
    """A module of `cls` with THR in its shapers section (None: without)."""
    return attach(cls, tiny_policy_dir, shapers={"thr": thr}, **kwargs)


def thr_of(module):
    (thr,) = module.rlvr_step.shapers
    return thr


def test_p_zero_is_the_base_algorithm_bit_for_bit(tiny_policy_dir):
    base = with_thr(GRPO, tiny_policy_dir, None)
    thr = with_thr(GRPO, tiny_policy_dir, THRSettings(p=0.0))
    inputs_base, inputs_thr = prepared(base, sample_rollout(base)), prepared(thr, sample_rollout(thr))
    assert torch.equal(inputs_base.advantages, inputs_thr.advantages)
    loss_b, grad_b = gradient(base, inputs_base, 3)
    loss_t, grad_t = gradient(thr, inputs_thr, 3)
    assert torch.equal(loss_b, loss_t) and torch.equal(grad_b, grad_t)


def test_module_captures_the_hidden_states_that_produce_old_logprobs(tiny_policy_dir):
    """The forward grabs the LM-head inputs at the positions predicting each response token, and the
    scorer keeps those of the rows it needs, across micro-batch boundaries."""
    module = with_thr(GRPO, tiny_policy_dir, None)
    rollout = sample_rollout(module)
    t = rollout.tensors(module.trainer.datamodule.tokenizer.pad_token_id)
    rows = torch.tensor([True, False, True, True, False, False, False, True])
    scorer = HiddenWeigher(module.step_context(), None, [], rows)
    hidden, old = {}, []
    for mb_rows in torch.arange(8).split(3):
        forward = policy_forward(module.policy, t.select(mb_rows), 0.8, capture_lm_head=True)
        old.append(forward.logp.detach())
        hidden.update(scorer.hidden_of(forward.lm_head_in, mb_rows, t.select(mb_rows).response_mask))
    old = torch.cat(old)
    assert sorted(hidden) == [0, 2, 3, 7]
    head = module.policy.get_output_embeddings()
    for n, h in hidden.items():
        L_n = len(rollout.completions[n].token_ids)
        logp = (head(h).float() / 0.8).log_softmax(-1)
        targets = torch.tensor(rollout.completions[n].token_ids)
        torch.testing.assert_close(logp.gather(-1, targets[:, None]).squeeze(1), old[n, :L_n], rtol=1e-5, atol=1e-5)


class THRRun(NamedTuple):
    module: object
    rollout: object
    advantages: torch.Tensor  # [N] sequence advantages
    weights: torch.Tensor  # THR's token weights
    metrics: dict  # THR's batch metrics
    seen: torch.Tensor  # the token advantages the micro-batch losses received
    loss: torch.Tensor
    grad: torch.Tensor
    read_in_update: bool


class RecordingObjective:
    """The update's objective, recording the token advantages each micro-batch loss receives."""

    def __init__(self, objective, seen: list) -> None:
        self.objective, self.seen = objective, seen

    def __getattr__(self, name):
        return getattr(self.objective, name)

    def micro_batch_loss(self, mb, logp, norms, *rest):
        self.seen.append(mb.advantages)
        return self.objective.micro_batch_loss(mb, logp, norms, *rest)


def thr_update(tiny_policy_dir, p, micro_batch_size, rollout_edit=None):
    """THR on GRPO through the module's preparation and one update's gradient; micro_batch_size 4 (= G)
    reads θ_old's LM-head inputs in the update's forward, 3 (splits groups) in the separate no-grad pass.
    What it returns: `THRRun`."""
    module = with_thr(GRPO, tiny_policy_dir, THRSettings(p=p, threshold="all"), compute=ComputeSettings(micro_batch_size=micro_batch_size))
    thr, rollout = thr_of(module), sample_rollout(module)
    if rollout_edit:
        rollout_edit(rollout)
    scored, inputs, _ = module.rlvr_step.prepare(module.step_context(), rollout)
    read_in_update = inputs.behaviour.reads_lm_head
    seen = []  # the token advantages each micro-batch loss received

    def record(update):
        update.objective = RecordingObjective(update.objective, seen)

    loss, grad = gradient(module, inputs, micro_batch_size, tweak=record)
    weights = inputs.token_weights()  # those read in the update's forwards too
    return THRRun(module, rollout, scored.advantages, weights, thr.batch_metrics(), torch.cat(seen), loss, grad, read_in_update)


def no_correct_in_group_1(rollout):
    rollout.correct[4:] = 0.0  # group 1 now has no correct rollout: Â ≡ 0 and no THR


@pytest.mark.parametrize("micro_batch_size", [4, 3])
@pytest.mark.parametrize("p", [0.3, -0.3])
def test_thr_reweights_mixed_groups_only(tiny_policy_dir, p, micro_batch_size):
    _, rollout, _, w, metrics, used, _, _, read_in_update = thr_update(tiny_policy_dir, p, micro_batch_size, no_correct_in_group_1)
    assert read_in_update == (micro_batch_size == 4)
    mask = rollout.tensors(0).response_mask
    # The unweighted token advantages, from the verdicts by docs/algorithms.md#group-relative-advantages (r = c).
    c = rollout.correct.view(-1, 4)
    unweighted = ((c - c.mean(1, keepdim=True)) / (c.std(1, keepdim=True) + 1e-6)).view(-1, 1) * mask
    assert (unweighted[:4][mask[:4].bool()] != 0).all() and (unweighted[4:] == 0).all()
    # No weight flipped a sign: every token advantage the loss received has the sign of the unweighted one.
    flipped = int((torch.sign(used) != torch.sign(unweighted)).sum())
    assert flipped == 0, f"{flipped} token advantages changed sign (or left/became 0)"
    torch.testing.assert_close(used, unweighted * w)  # the loss received Â' = Â·w token by token
    assert (w[4:] == 1).all()
    values = w[:4][mask[:4].bool()]
    near = [torch.isclose(values, torch.tensor(v)) for v in (1 + p, 1 - p, 1.0)]
    assert (near[0] | near[1] | near[2]).all() and (near[0] | near[1]).any()
    assert metrics["thr/dominant_frac"] == 1.0
    assert metrics["thr/positive_frac"] + metrics["thr/negative_frac"] == pytest.approx(1.0)


@pytest.mark.parametrize("micro_batch_size", [4, 3])
def test_in_an_environment_thr_weighs_the_sampled_tokens_and_leaves_the_inserted_ones_at_one(tiny_policy_dir, micro_batch_size):
    """Through the module's preparation and update (THR read in the update's forward, or in the θ_old pass): the
    tokens a tool inserted weigh exactly 1 and are not counted in THR's metrics; every sampled token of a mixed
    group is reweighted (threshold `all`)."""
    from tests.environments.test_episodes import SAMPLED, with_inserted_tokens

    module = with_thr(GRPO, tiny_policy_dir, THRSettings(p=0.3, threshold="all"), compute=ComputeSettings(micro_batch_size=micro_batch_size))
    thr, rollout = thr_of(module), with_inserted_tokens(sample_rollout(module))
    scored, inputs, _ = module.rlvr_step.prepare(module.step_context(), rollout)
    gradient(module, inputs, micro_batch_size)
    w, sampled = inputs.token_weights(), inputs.tensors.sampled_mask.bool()
    inserted = inputs.tensors.response_mask.bool() & ~sampled
    assert inserted.sum() == sum(m.count(0) for m in SAMPLED.values()) and (w[inserted] == 1.0).all()
    c = rollout.correct.view(-1, 4)
    mixed = ((c.sum(1) > 0) & (c.sum(1) < 4)).repeat_interleave(4)[:, None] & sampled
    assert mixed.any() and torch.isclose(w[mixed], torch.tensor(1.3)).logical_or(torch.isclose(w[mixed], torch.tensor(0.7))).all()
    assert thr.batch_metrics()["thr/tokens"] == mixed.sum().item()


def test_thr_read_in_the_update_equals_a_separate_theta_old_pass(tiny_policy_dir):
    """One update per rollout batch: THR scored from the update's own forward (no θ_old pass) gives the
    weights, metrics, loss and gradient of THR scored from a separate no-grad θ_old forward."""
    *_, w_in, m_in, in_in, loss_in, grad_in, read_in = thr_update(tiny_policy_dir, 0.3, 4)
    *_, w_sep, m_sep, in_sep, loss_sep, grad_sep, read_sep = thr_update(tiny_policy_dir, 0.3, 3)
    assert read_in and not read_sep
    assert torch.equal(w_in, w_sep)
    assert (w_in != 1).any()
    torch.testing.assert_close(in_in, in_sep)  # the token advantages the losses received
    for key in ("thr/tokens", "thr/positive_frac", "thr/abs_p50", "thr/abs_max"):
        assert m_in[key] == pytest.approx(m_sep[key], rel=1e-5)
    assert loss_in.item() == pytest.approx(loss_sep.item(), rel=1e-5)
    torch.testing.assert_close(grad_in, grad_sep, rtol=1e-4, atol=1e-7)


def test_thr_composes_with_gspo_token_and_is_refused_where_it_cannot(tiny_policy_dir):
    gspo_token = {"name": "gspo-token", "knobs": {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4}}  # GSPO's clip range
    module = with_thr(GSPO, tiny_policy_dir, THRSettings(p=0.2), policy_loss=gspo_token, num_mini_batches=2)
    checked(module)
    with pytest.raises(ConfigError, match="policy_loss=gspo does not honour them"):
        checked(with_thr(GSPO, tiny_policy_dir, THRSettings(p=0.2), num_mini_batches=2))
    with pytest.raises(ConfigError, match="policy_loss=real-anchor does not honour them"):
        checked(with_thr(REAL, tiny_policy_dir, THRSettings(p=0.2), compute=ComputeSettings(micro_batch_size=4), num_mini_batches=1))
    with pytest.raises(ConfigError, match="policy_loss=gmpo does not honour them"):  # one term per sequence
        checked(with_thr(GRPO, tiny_policy_dir, THRSettings(p=0.2), policy_loss="gmpo"))
    for loss in ("cispo", "sapo"):  # per-token losses take the reshaped token advantages
        checked(with_thr(GRPO, tiny_policy_dir, THRSettings(p=0.2), policy_loss=loss))
