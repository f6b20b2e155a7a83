"""The GRPO-family LightningModules on a tiny real model: the module's own code paths (tensor layout,
θ_old pass, loss inputs, micro-batch accumulation), not re-implementations of them."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from rlvr_lightning.algos import DAPO, GRPO, GSPO, REAL, DrGRPO, wiring
from rlvr_lightning.data.datamodule import RolloutDataModule
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rollout.settings import RolloutSettings
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.standalone import standalone
from rlvr_lightning.training.behaviour import FromUpdateForward, Precomputed, separate_pass
from rlvr_lightning.training.settings import BehaviourSettings, ComputeSettings, OptimSettings
from rlvr_lightning.training.step_metrics import MetricAccumulator
from tests.support.settings import checked, resettle

G, MAX_LEN = 4, 8
PRESETS = {
    "grpo": (GRPO, {}),
    "dr-grpo": (DrGRPO, {}),
    "dapo": (DAPO, {}),
    "gspo": (GSPO, {}),
    "gspo-token": (GSPO, {"policy_loss": {"name": "gspo-token", "knobs": {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4}}}),
    # The newer pieces on GRPO's step, with their presets' knobs (configs/algo/<name>.yaml).
    "cispo": (GRPO, {"policy_loss": {"name": "cispo", "knobs": {"clip_eps_low": 1.0, "clip_eps_high": 0.28}},
                     "loss_agg": "token-mean"}),
    "gmpo": (GRPO, {"policy_loss": {"name": "gmpo", "knobs": {"clip_eps_low": 0.4, "clip_eps_high": 0.4}}}),
    "sapo": (GRPO, {"policy_loss": "sapo"}),
    # An estimator that reads more than the rewards (the lengths, a reduction); RLOO's and pass@k's are
    # functions of the rewards alone, tested in test_advantage_estimators.py.
    "reinforce-pp": (GRPO, {"advantage_estimator": "reinforce-pp", "loss_agg": "token-mean"}),
    # Token selections over the whole step, at shares large enough that many of the 40 tokens are taken.
    "clip-cov": (GRPO, {"policy_loss": {"name": "clip-cov", "knobs": {"clip_cov_ratio": 0.3, "clip_cov_lb": 0.0,
                                                                     "clip_cov_ub": 100.0}},
                        "loss_agg": "token-mean"}),
    "kl-cov": (GRPO, {"policy_loss": {"name": "kl-cov", "knobs": {"kl_cov_ratio": 0.3}}, "loss_agg": "token-mean"}),
    "dppo-tv": (GRPO, {"policy_loss": {"name": "dppo-tv", "knobs": {"clip_eps_low": 0.15, "clip_eps_high": 0.15}},
                       "loss_agg": "token-mean"}),
    "maxrl": (GRPO, {"advantage_estimator": "maxrl"}),
    "dro": (GRPO, {"policy_loss": "dro", "loss_agg": "token-mean"}),
    # This year's knobs together: the dual clip, the sum aggregation and Kimi's regulariser to θ_old.
    "composed": (GRPO, {"loss_agg": "seq-mean-token-sum", "kl_estimator": "kimi", "kl_coef": 0.01,
                        "policy_loss": {"name": "ppo-clip", "knobs": {"dual_clip_c": 3.0}}}),
}


def attach(cls, tiny_policy_dir, rollout_kwargs=None, **model_kwargs):
    """A module wired to a bare Trainer and a RolloutDataModule (tokenizer, lengths), without fitting."""
    rollout = RolloutSettings(**{"max_response_length": MAX_LEN, "group_size": G, **(rollout_kwargs or {})})
    dm = RolloutDataModule(model_name_or_path=str(tiny_policy_dir), batch_size=2, rollout=rollout)
    return standalone(cls(**model_kwargs), dm)


def sample_rollout(module, seed=0) -> Rollout:
    """Two prompts × G completions of random tokens (any token sequence has a log-prob under the policy)."""
    tok = module.trainer.datamodule.tokenizer
    prompts = ["What is 3+4-2?\n", "What is 10+1+5?\n"]
    prompt_ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    g = torch.Generator().manual_seed(seed)
    completions = []
    for L_n in (2, 8, 5, 8, 3, 6, 8, 4):  # three hit MAX_LEN: truncated
        ids = torch.randint(3, 60, (L_n,), generator=g).tolist()
        completions.append(Completion(ids, [0.0] * L_n, "length" if L_n == MAX_LEN else "stop"))
    correct = torch.tensor([1.0, 0, 0, 1, 0, 0, 1, 0])
    return Rollout(
        batch=PromptBatch(["a", "b"], prompts, ["5", "16"]), group_size=G, prompt_ids=prompt_ids,
        completions=completions, sampling=SamplingConfig(group_size=G, max_tokens=MAX_LEN), policy_version=0,
        texts=[""] * 8, correct=correct,
    )  # fmt: skip


def set_engine_logprobs(rollout: Rollout, per_token: torch.Tensor) -> None:
    for n, comp in enumerate(rollout.completions):
        comp.logprobs = per_token[n, : len(comp.token_ids)].tolist()


def prepared(module, rollout):
    """The module's own rewards, advantages and update inputs of a scored rollout."""
    return module.rlvr_step.prepare(module.step_context(), rollout)[1]


def gradient(module, inputs, micro_batch_size, acc=None, max_tokens=None, tweak=None):
    """One optimizer step's loss and accumulated gradient over every sequence of `inputs`, with
    micro-batches of `micro_batch_size` rows, or by token budget `max_tokens`; `tweak(update)` may
    adjust or instrument the module's update before it runs."""
    resettle(module, micro_batch_size=micro_batch_size, max_tokens_per_micro_batch=max_tokens)
    module.policy.zero_grad(set_to_none=True)
    rows = torch.arange(inputs.correct.shape[0])
    update = module.rlvr_step.update
    if tweak is not None:
        tweak(update)
    loss = update.accumulate_gradients(module.step_context(), inputs, rows, module.manual_backward, acc)
    return loss, torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None])


def trainer_old_logp(module, inputs, micro_batch_size=8):
    """θ_old's log-probs from the trainer's separate no-grad pass."""
    layout = lambda rows, _whole_groups: list(rows.split(micro_batch_size))  # noqa: E731
    return separate_pass(
        module.policy, None, inputs.tensors, inputs.temperature, layout, module.settings.compute.logprob_chunk_tokens,
        with_old=True,
    )[0]


def seeded_noise(like: torch.Tensor) -> torch.Tensor:
    """Standard normal noise of `like`'s shape, the same whichever tests ran before in this process."""
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(0), dtype=like.dtype)


def with_old_logp(inputs, old_logp):
    """`inputs` with θ_old's log-probs given before the update (e.g. off-policy ones)."""
    return inputs.with_behaviour(Precomputed(old_logp, "trainer"))


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


def test_a_built_step_is_rebuilt_with_the_settings_a_test_resettles(tiny_policy_dir):
    """The step is built once from the module's settings; `resettle` (a test's change of settings) must reach the
    next step, not leave the one built before it running (every layout would then run the first one's)."""
    module = attach(GRPO, tiny_policy_dir)
    before = module.rlvr_step
    assert before.layout.micro_batch_size == ComputeSettings().micro_batch_size
    resettle(module, micro_batch_size=3)
    assert module.rlvr_step is not before and module.rlvr_step.layout.micro_batch_size == 3


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


def independent_logprobs(policy, rollout: Rollout, grad: bool = False) -> torch.Tensor:
    """[N, MAX_LEN] log π(y_t | prompt, y_<t) at the rollout's temperature, 0 on padding: every sequence
    alone, unpadded, from the model's full logits (no `policy_forward`, layout, chunked head or θ_old strategy)."""
    out = torch.zeros(rollout.num_sequences, MAX_LEN)
    with torch.set_grad_enabled(grad):
        for n, comp in enumerate(rollout.completions):
            prompt, L = rollout.prompt_ids[n // rollout.group_size], len(comp.token_ids)
            logits = policy(input_ids=torch.tensor([prompt + comp.token_ids])).logits[0, len(prompt) - 1 : -1]
            logp = (logits.double() / rollout.sampling.temperature).log_softmax(-1)
            out[n, :L] = logp.gather(-1, torch.tensor(comp.token_ids)[:, None]).squeeze(1).float()
    return out


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


@pytest.mark.parametrize("preset", list(PRESETS))
def test_old_logprobs_from_the_update_forward_equal_a_separate_pass(tiny_policy_dir, preset):
    """With one update per rollout batch the separate θ_old pass is skipped (behaviour source `update`):
    same loss and gradient as with θ_old's log-probs from their own no-grad forward, and the log-probs
    the update recorded are exactly those."""
    cls, kwargs = PRESETS[preset]
    module = attach(cls, tiny_policy_dir, compute=ComputeSettings(micro_batch_size=3), **kwargs)
    if module.rlvr_step.resolved.behaviour != "update":
        pytest.skip("this preset's θ_old does not come from the update's forward")
    inputs = prepared(module, sample_rollout(module))
    assert isinstance(inputs.behaviour, FromUpdateForward)  # the separate pass did not run
    explicit = with_old_logp(inputs, trainer_old_logp(module, inputs, 3))  # same micro-batches: same numerics
    loss_a, g_a = gradient(module, inputs, 3)
    loss_b, g_b = gradient(module, explicit, 3)
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=1e-6, abs=1e-8)
    torch.testing.assert_close(g_a, g_b, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(
        inputs.behaviour.old_logp_all(), explicit.behaviour.old_logp_all(), rtol=0, atol=1e-6
    )


def test_dapo_reward_is_signed_correctness_plus_overlong_penalty(tiny_policy_dir):
    module = attach(DAPO, tiny_policy_dir, overlong_buffer_len=4)
    rollout = sample_rollout(module)
    lengths = rollout.response_lengths
    expected = (2 * rollout.correct - 1) + ((4 - lengths) / 4).clamp(-1, 0)  # penalty from L > 8 − 4
    torch.testing.assert_close(module.rlvr_step.algorithm.rewards(rollout)[0], expected)
    assert (expected < 2 * rollout.correct - 1).any()  # the sample does contain penalised lengths
    assert attach(DAPO, tiny_policy_dir).rlvr_step.algorithm.buffer == MAX_LEN // 5  # 20% of max_response_length


def test_mask_truncated_takes_truncated_completions_out_of_the_loss(tiny_policy_dir):
    module = attach(DAPO, tiny_policy_dir, mask_truncated=True)
    rollout = sample_rollout(module)
    inputs = prepared(module, rollout)
    truncated = rollout.truncated
    assert truncated.any() and (~truncated).any()
    assert torch.equal(inputs.loss_mask[truncated], torch.zeros_like(inputs.loss_mask[truncated]))
    torch.testing.assert_close(inputs.loss_mask[~truncated], inputs.tensors.response_mask[~truncated])


def test_truncated_is_scales_the_policy_gradient_by_the_capped_ratio(tiny_policy_dir):
    plain = attach(GRPO, tiny_policy_dir)
    rollout = sample_rollout(plain)
    inputs = prepared(plain, rollout)
    _, g_plain = gradient(plain, inputs, 8)
    # The engine assigned every token 1/1.5 of the trainer's probability: w = 1.5 (under the cap of 2).
    set_engine_logprobs(rollout, inputs.behaviour.old_logp_all() - torch.log(torch.tensor(1.5)))
    tis = attach(GRPO, tiny_policy_dir, rollout_correction={"name": "tis-token", "knobs": {"tis_cap": 2.0}})
    tis.policy.load_state_dict(plain.policy.state_dict())
    tis_inputs = prepared(tis, rollout)
    torch.testing.assert_close(tis_inputs.is_weight, 1.5 * tis_inputs.loss_mask)
    _, g_tis = gradient(tis, tis_inputs, 8)
    torch.testing.assert_close(g_tis, 1.5 * g_plain, rtol=1e-4, atol=1e-7)


def test_behaviour_logprobs_from_the_rollout_engine(tiny_policy_dir):
    module = attach(GRPO, tiny_policy_dir, behaviour=BehaviourSettings(logprobs="rollout"))
    rollout = sample_rollout(module)
    engine_logp = -torch.rand(8, MAX_LEN, generator=torch.Generator().manual_seed(4))
    set_engine_logprobs(rollout, engine_logp)
    inputs = prepared(module, rollout)
    torch.testing.assert_close(inputs.behaviour.old_logp_all(), engine_logp * inputs.tensors.response_mask)


@pytest.mark.parametrize(
    "model_kwargs,rollout_kwargs,ok",
    [
        ({"rollout_correction": "tis-token"}, {"top_p": 0.9}, False),
        ({"rollout_correction": "tis-sequence"}, {"top_k": 20}, False),
        ({"behaviour": BehaviourSettings(logprobs="rollout")}, {"top_p": 0.95}, False),
        ({"rollout_correction": "tis-token", "behaviour": BehaviourSettings(allow_filtered_rollout_logprobs=True)}, {"top_p": 0.9}, True),
        ({}, {"top_p": 0.9}, True),  # θ_old from the trainer: the engine's log-probs are only logged
        ({"rollout_correction": "tis-token"}, {}, True),
        ({}, {"top_p": 0.9, "engine": "vllm-server", "stream": {"max_staleness": 1}}, False),  # θ_old from the engine
    ],
)
def test_filtered_sampling_with_rollout_logprobs_is_refused_unless_opted_in(
    tiny_policy_dir, model_kwargs, rollout_kwargs, ok
):
    module = attach(GRPO, tiny_policy_dir, rollout_kwargs, **model_kwargs)
    if ok:
        checked(module)
    else:
        with pytest.raises(ConfigError, match="allow_filtered_rollout_logprobs"):
            checked(module)
def test_rollouts_ahead_are_refused_where_they_cannot_run(tiny_policy_dir):
    with pytest.raises(ConfigError, match="max_staleness=2 needs rollout.engine=vllm-server"):
        RolloutSettings(stream={"max_staleness": 2})
    with pytest.raises(ConfigError, match="partial_rollouts continues sequences across weight syncs"):
        RolloutSettings(engine="vllm-server", stream={"partial_rollouts": True})
    with pytest.raises(ConfigError, match="max_staleness must be an integer ≥ 0"):
        RolloutSettings(engine="vllm-server", stream={"max_staleness": -1})
    ahead = {"engine": "vllm-server", "stream": {"max_staleness": 2}}  # no server starts: the engine is built on first use
    checked(attach(DAPO, tiny_policy_dir, ahead))  # dynamic sampling refills from the stream


def test_contradictory_or_invalid_settings_are_clear_errors():
    with pytest.raises(ConfigError, match="every weight is 1"):
        GRPO(rollout_correction="tis-token", behaviour=BehaviourSettings(logprobs="rollout"))
    with pytest.raises(ConfigError, match="registered: ppo-clip, gspo-token, gspo, "):
        GRPO(policy_loss="ppo")
    with pytest.raises(ConfigError, match="re-weights token-level losses"):
        GRPO(policy_loss="real-anchor", rollout_correction="tis-token")
    with pytest.raises(ConfigError, match="two_pass is for group-level"):
        REAL(policy_loss="ppo-clip", advantage_estimator="grpo", two_pass=True)
    with pytest.raises(ConfigError, match="valid: error, train_partial"):
        DAPO(on_exhausted="skip")
    assert GSPO(policy_loss="gspo-token").settings.pieces.objective.policy_loss.name == "gspo-token"
    assert GSPO().settings.pieces.objective.policy_loss.name == "gspo"


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


def test_weight_decay_warmup_and_cosine_schedule_reach_the_optimizer(tiny_policy_dir):
    module = attach(GRPO, tiny_policy_dir, optim=OptimSettings(lr=1.0, weight_decay=0.1, warmup_steps=2, lr_schedule="cosine"))
    module.trainer.fit_loop.epoch_loop.max_steps = 6  # trainer.max_steps
    config = module.configure_optimizers()
    opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert all(group["weight_decay"] == 0.1 for group in opt.param_groups)
    lrs = []
    for _ in range(6):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    # Linear warm-up over 2 steps, then cosine from 1 to 0 over the remaining 4.
    expected = [0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]
    assert lrs == pytest.approx(expected)


def test_an_estimator_knob_that_does_not_fit_the_group_size_stops_the_run_at_fit_start(tiny_policy_dir):
    module = attach(GRPO, tiny_policy_dir, advantage_estimator={"name": "pass-at-k", "knobs": {"pass_at_k": G + 1}})
    with pytest.raises(ConfigError, match=rf"pass_at_k must lie in \[1, rollout.group_size={G}\], got {G + 1}"):
        checked(module)
    checked(attach(GRPO, tiny_policy_dir, advantage_estimator={"name": "pass-at-k", "knobs": {"pass_at_k": G}}))


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
