"""The policy update (`training.update`) on the tiny real model: gradient accumulation and token-budget
micro-batches give the row layout's update, every forward fits the budget, the first mini-batch after a rollout is
exactly on policy, several updates and passes keep θ_old fixed and step the optimizer each time, and the micro-batch
loop reads no metric back to the host. Non-finite guard: an update whose loss or gradient is NaN/inf is skipped with
the weights and the optimizer state untouched, logged, and a run that keeps producing them stops with a clear
message."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from rlvr_lightning.algos import GRPO, wiring
from rlvr_lightning.data.datamodule import RolloutDataModule
from rlvr_lightning.rollout.settings import RolloutSettings
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.standalone import standalone
from rlvr_lightning.training.objective import Objective
from rlvr_lightning.training.settings import ComputeSettings, OptimSettings
from rlvr_lightning.training.step_metrics import MetricAccumulator
from tests.support.settings import resettle
from tests.support.update_harness import (
    MAX_LEN,
    PRESETS,
    G,
    attach,
    gradient,
    independent_logprobs,
    prepared,
    sample_rollout,
    set_engine_logprobs,
    trainer_old_logp,
    with_old_logp,
)


def poison_loss(monkeypatch) -> None:
    """Every micro-batch loss becomes NaN (what bad batch arithmetic or an overflow produces)."""
    clean = Objective.micro_batch_loss

    def nan_loss(self, mb, logp, norms, *rest):
        loss, stats = clean(self, mb, logp, norms, *rest)
        return loss * float("nan"), stats

    monkeypatch.setattr(Objective, "micro_batch_loss", nan_loss)


def test_nan_update_is_skipped_with_weights_unchanged_then_stops(tiny_policy_dir, monkeypatch):
    dm = RolloutDataModule(model_name_or_path=str(tiny_policy_dir), batch_size=4, val_data=None, rollout=RolloutSettings(group_size=4, max_response_length=8, engine="hf"))  # fmt: skip
    module = standalone(GRPO(optim=OptimSettings(lr=1e-2), compute=ComputeSettings(max_nonfinite_steps=2)), dm, callbacks=[])
    try:
        batch = next(iter(dm.train_dataloader()))
        before = {k: v.clone() for k, v in module.policy.state_dict().items()}
        poison_loss(monkeypatch)
        metrics = module.train_on_batch(batch).metrics
        assert metrics["skipped_updates"] == 1.0
        for name, value in module.policy.state_dict().items():
            assert torch.equal(value, before[name]), name
        assert all(p.grad is None for p in module.policy.parameters())  # no NaN gradient left behind
        assert not module.optimizers().optimizer.state  # AdamW never stepped: its moments are not poisoned
        with pytest.raises(RuntimeError, match="2 consecutive updates had a non-finite loss or gradient"):
            module.train_on_batch(batch)
    finally:
        for cb in module.trainer.callbacks:
            cb.teardown(module.trainer, module, "fit")
        module.teardown("fit")


def seeded_noise(like: torch.Tensor) -> torch.Tensor:
    """Standard normal noise of `like`'s shape, the same whichever tests ran before in this process."""
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(0), dtype=like.dtype)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_gradient_accumulation_does_not_change_the_update(tiny_policy_dir, preset):
    cls, kwargs = PRESETS[preset]
    module = attach(cls, tiny_policy_dir, **kwargs)
    rollout = sample_rollout(module)
    inputs = prepared(module, rollout)
    # Make the step off-policy so that clipping and the ratio matter, not only the on-policy case.
    old_logp = trainer_old_logp(module, inputs)
    inputs = with_old_logp(inputs, old_logp + 0.01 * seeded_noise(old_logp) * inputs.tensors.response_mask)
    loss_whole, g_whole = gradient(module, inputs, 8)
    # The loss sums terms of the size of the advantages (MaxRL's reach G/K − 1) that largely cancel: fp32 rounding of
    # the sum is relative to the terms, not to the loss, so the absolute tolerance scales with the largest advantage.
    scale = max(1.0, inputs.advantages.abs().max().item())
    for size in (3, 1):
        loss_split, g_split = gradient(module, inputs, size)
        assert loss_split.item() == pytest.approx(loss_whole.item(), rel=1e-5, abs=1e-7 * scale)
        torch.testing.assert_close(g_split, g_whole, rtol=1e-4, atol=1e-6)
    assert g_whole.abs().sum() > 0


@pytest.mark.parametrize(
    "preset,loss_agg",
    [(p, None) for p in PRESETS] + [("grpo", "token-mean"), ("grpo", "seq-mean-token-sum-norm")],
)
def test_token_budget_micro_batches_give_the_same_update_as_row_micro_batches(tiny_policy_dir, preset, loss_agg):
    """Micro-batches by token budget sort rows by length and trim each micro-batch to its longest row:
    same loss and gradient as today's layout (whole batch, full width), with KL and truncated IS on and
    an off-policy θ_old, for every aggregator; and the padding share of the update really drops."""
    cls, kwargs = PRESETS[preset]
    kwargs = {**kwargs, "kl_coef": 0.05} | ({"loss_agg": loss_agg} if loss_agg else {})
    per_token = cls(**kwargs).settings.pieces.objective.policy_loss["token_weights"]  # GSPO and GMPO take sequence-level weights only
    module = attach(cls, tiny_policy_dir, **kwargs, rollout_correction="tis-token" if per_token else "tis-sequence")
    rollout = sample_rollout(module)
    set_engine_logprobs(rollout, -1.0 - 0.1 * torch.rand(8, MAX_LEN, generator=torch.Generator().manual_seed(3)))
    inputs = prepared(module, rollout)
    assert (inputs.ref_logp is not None) == module.settings.pieces.objective.needs_reference and inputs.is_weight is not None
    old_logp = trainer_old_logp(module, inputs)
    inputs = with_old_logp(inputs, old_logp + 0.01 * seeded_noise(old_logp) * inputs.tensors.response_mask)
    rows_acc, budget_acc = MetricAccumulator(), MetricAccumulator()
    loss_rows, g_rows = gradient(module, inputs, 8, rows_acc)
    lengths = inputs.tensors.lengths
    for budget in (int(lengths.max()), 2 * int(lengths.max()) + 3, 10_000):
        acc = MetricAccumulator() if budget != 2 * int(lengths.max()) + 3 else budget_acc
        loss_budget, g_budget = gradient(module, inputs, 8, acc, max_tokens=budget)
        assert loss_budget.item() == pytest.approx(loss_rows.item(), rel=1e-5, abs=1e-7)
        torch.testing.assert_close(g_budget, g_rows, rtol=1e-4, atol=1e-6)
    assert g_rows.abs().sum() > 0
    assert budget_acc.result()["padding_frac"] < rows_acc.result()["padding_frac"]


def test_token_budget_bounds_every_forward_the_step_runs(tiny_policy_dir):
    """A long prompt answered in a few tokens beside a short prompt answered at length: every sequence
    has about the same real length, but two of different prompts side by side run a forward as wide as
    the long prompt plus the long answer. Every forward the model receives, in the θ_old pass and in the
    update, fits the budget, and the update is the row layout's."""
    max_len = 40
    module = attach(GRPO, tiny_policy_dir, {"max_response_length": max_len}, num_mini_batches=2)
    tok = module.trainer.datamodule.tokenizer
    prompts = ["Add three, four and two; take one away.\n", "1+1?\n"]
    prompt_ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    long, short = len(prompt_ids[0]), len(prompt_ids[1])
    # Real lengths long + 1 … long + 4 in both groups: a sort by length alone interleaves the two prompts.
    responses = [1, 3, 2, 4] + [long - short + k for k in (2, 4, 1, 3)]
    assert max(responses) <= max_len
    g = torch.Generator().manual_seed(0)
    completions = [Completion(torch.randint(3, 60, (n,), generator=g).tolist(), [0.0] * n, "stop") for n in responses]
    correct = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 0])
    rollout = Rollout(
        batch=PromptBatch(["a", "b"], prompts, ["8", "2"]), group_size=G, prompt_ids=prompt_ids,
        completions=completions, sampling=SamplingConfig(group_size=G, max_tokens=max_len), policy_version=0,
        texts=[""] * 8, correct=correct,
    )  # fmt: skip
    t = rollout.tensors(tok.pad_token_id)
    budget = 2 * int(t.lengths.max())  # two rows of one prompt fit; two of different prompts do not
    assert budget == 2 * (long + 4) < 2 * (long + max(responses))
    sizes: list[int] = []
    module.policy.register_forward_pre_hook(lambda _m, _a, kw: sizes.append(kw["input_ids"].numel()), with_kwargs=True)
    resettle(module, max_tokens_per_micro_batch=budget)
    inputs = prepared(module, rollout)
    assert inputs.behaviour.source == "trainer" and len(sizes) >= 4  # the θ_old pass, by budget
    _, g_budget = gradient(module, inputs, 8, max_tokens=budget)
    assert len(sizes) >= 8 and max(sizes) <= budget, (budget, sizes)
    _, g_rows = gradient(module, inputs, 8)
    torch.testing.assert_close(g_budget, g_rows, rtol=1e-4, atol=1e-6)


def test_kl_cov_on_policy_adds_nothing_whatever_the_layout(tiny_policy_dir):
    """On a rollout batch's first step θ = θ_old, but θ_old comes from the separate pass, laid out
    otherwise: |log-ratio| is rounding noise there, and its gradient must not act (it would be ±β on
    every selected token, different for every micro-batch size)."""
    cls, kwargs = PRESETS["kl-cov"]
    module = attach(cls, tiny_policy_dir, **{**kwargs, "num_mini_batches": 2})
    inputs = prepared(module, sample_rollout(module))
    assert inputs.behaviour.source == "trainer"
    _, g_whole = gradient(module, inputs, 8)
    _, g_split = gradient(module, inputs, 3)
    loss = kwargs["policy_loss"]
    resettle(module, policy_loss={"name": loss["name"], "knobs": {**loss["knobs"], "kl_cov_coef": 0.0}})
    _, g_no_penalty = gradient(module, inputs, 3)
    torch.testing.assert_close(g_split, g_whole, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_split, g_no_penalty, rtol=0, atol=0)


@pytest.mark.parametrize("num_mini_batches", [1, 2])  # θ_old from the update's own forward / from the no-grad pass
@pytest.mark.parametrize("preset", list(PRESETS))
def test_first_mini_batch_after_a_rollout_is_exactly_on_policy(tiny_policy_dir, preset, num_mini_batches):
    """At θ = θ_old the θ_old log-probs the loss receives are the policy's own (an independent forward),
    whichever strategy produced them, and the ratio is 1 with nothing clipped."""
    cls, kwargs = PRESETS[preset]
    module = attach(cls, tiny_policy_dir, compute=ComputeSettings(micro_batch_size=3), **{**kwargs, "num_mini_batches": num_mini_batches})
    # A loss that reads the whole step first (a token selection) needs θ_old before the update: its own pass.
    one_pass = num_mini_batches == 1 and not module.settings.pieces.objective.reads_step_first
    assert module.rlvr_step.resolved.behaviour == ("update" if one_pass else "trainer")
    rollout = sample_rollout(module)
    rollout = replace(rollout, sampling=SamplingConfig(group_size=G, max_tokens=MAX_LEN, temperature=0.7))
    inputs = prepared(module, rollout)
    received = torch.zeros(8, MAX_LEN)  # θ_old's log-probs as each micro-batch's loss got them
    seen = torch.zeros(8)

    def recording(update):
        forward_of = update.forward

        def forward(step, inputs, idx, **kwargs):
            forward, mb = forward_of(step, inputs, idx, **kwargs)
            received[idx, : mb.old_logp.shape[1]] = mb.old_logp.detach() * mb.loss_mask
            seen[idx] += 1
            return forward, mb

        update.forward = forward

    acc = MetricAccumulator()
    gradient(module, inputs, 3, acc, tweak=recording)
    assert torch.equal(seen, torch.ones(8))
    torch.testing.assert_close(received, independent_logprobs(module.policy, rollout), rtol=0, atol=1e-5)
    stats = acc.result()
    assert abs(stats["ratio_mean"] - 1) < 1e-6 and abs(stats["ratio_max"] - 1) < 1e-6
    assert stats["clip_frac_low"] == 0 and stats["clip_frac_high"] == 0
    assert stats["entropy"] > 0


def test_several_updates_per_rollout_batch_keep_theta_old_fixed(tiny_policy_dir):
    """K = 2 mini-batches: θ_old comes from a pass before the update and stays fixed, so the second
    mini-batch, taken after the first optimizer step, sees ratios ≠ 1 (off policy), while θ_old's
    log-probs are those of the policy that sampled. Reading θ_old from the update's forward here
    would make every ratio exactly 1."""
    module = attach(GRPO, tiny_policy_dir, num_mini_batches=2, optim=OptimSettings(lr=1e-2), compute=ComputeSettings(micro_batch_size=8))
    assert module.rlvr_step.resolved.behaviour == "trainer"
    rollout = sample_rollout(module)
    inputs = prepared(module, rollout)
    before = trainer_old_logp(module, inputs)
    metrics = module.rlvr_step.update.run(module.step_context(), inputs, len(rollout.batch), wiring.optimization(module))
    assert metrics["ratio_max"] > 1 + 1e-4
    torch.testing.assert_close(inputs.behaviour.old_logp_all(), before, rtol=0, atol=1e-6)


def test_several_passes_over_a_rollout_batch_keep_theta_old_and_step_the_optimizer_each_time(tiny_policy_dir):
    """ppo_epochs = 2 × num_mini_batches = 2: four optimizer steps on one rollout batch, θ_old from the pass
    before the update (fixed), the later steps off policy, and the schedule advanced four times."""
    module = attach(GRPO, tiny_policy_dir, num_mini_batches=2, ppo_epochs=2, optim=OptimSettings(lr=1e-2), compute=ComputeSettings(micro_batch_size=8))
    assert module.rlvr_step.resolved.behaviour == "trainer"
    inputs = prepared(module, sample_rollout(module))
    before = trainer_old_logp(module, inputs)
    steps = []
    update = module.rlvr_step.update
    accumulate = update.accumulate_gradients
    update.accumulate_gradients = lambda *a, **k: steps.append(update.updates_since_rollout) or accumulate(*a, **k)
    metrics = update.run(module.step_context(), inputs, 2, wiring.optimization(module))
    assert steps == [0, 1, 2, 3]
    assert module.optimizers().optimizer.state_dict()["state"][0]["step"] == 4
    assert metrics["ratio_max"] > 1 + 1e-4
    torch.testing.assert_close(inputs.behaviour.old_logp_all(), before, rtol=0, atol=1e-6)


@pytest.mark.parametrize("preset", ["grpo", "dapo", "gspo"])
def test_the_micro_batch_loop_reads_no_metric_back_to_the_host(tiny_policy_dir, preset):
    """The update's metrics stay on the device until the update ends: no `float(t)`/`.item()` of a metric per
    micro-batch (each waits for the GPU to finish everything queued, the backward included), counted at
    PyTorch's dispatcher (`_local_scalar_dense`, what every such read runs; `bench/host_reads.py` counts them) over four
    micro-batches."""
    from bench.host_reads import HostReads

    cls, kwargs = PRESETS[preset]
    module = attach(cls, tiny_policy_dir, **kwargs)
    inputs = prepared(module, sample_rollout(module))
    acc = MetricAccumulator()
    with HostReads() as reads:
        gradient(module, inputs, 2, acc)
    assert not [site for site in reads.sites if "step_metrics.py:" in site], reads.sites
    metrics = acc.result()
    assert {"ratio_mean", "entropy", "padding_frac"} <= set(metrics) and all(math.isfinite(v) for v in metrics.values())
