"""On-policy distillation: the `opd` advantage on hand-checkable tensors, the checks of its configuration, and the
update's per-token advantages through the step (the teacher itself: training/test_teacher.py)."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr_lightning.algos.grpo import GRPO
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.pieces import advantage_estimators
from rlvr_lightning.pieces.advantages import group_advantage
from rlvr_lightning.pieces.kinds import AdvantageInputs, DistillationInputs
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig

STUDENT = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -3.0, 0.0]])
TEACHER = torch.tensor([[-0.5, -3.0, -9.0], [-0.5, -1.0, -7.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the last column is padding


def opd(rewards=(1.0, 0.0), teacher=TEACHER, **knobs):
    r = torch.tensor(rewards)
    inputs = AdvantageInputs(r, r, 2, distillation=DistillationInputs(STUDENT, teacher, MASK))
    return advantage_estimators.get("opd").bind(knobs)(inputs)


def test_alone_each_sampled_token_gets_the_teacher_minus_student_log_prob():
    adv, stats = opd()
    assert adv.tolist() == [[0.5, -1.0, 0.0], [0.0, 2.0, 0.0]]  # log π_T − log π_S; 0 on padding
    assert stats["opd_reverse_kl"] == pytest.approx((-0.5 + 1.0 + 0.0 - 2.0) / 4)  # mean of log π_S − log π_T


def test_clipped_and_weighted_beside_grpos_sequence_advantage():
    adv, stats = opd(opd_reward="grpo", opd_coef=0.5, opd_clip=0.75)
    a = 0.5 ** 0.5  # GRPO's advantage of rewards (1, 0): ±(0.5 / std), std = √0.5
    expected = [[a + 0.5 * 0.5, a - 0.5 * 0.75, 0.0], [-a + 0.0, -a + 0.5 * 0.75, 0.0]]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6), adv
    assert stats["opd_clip_frac"] == 0.5  # |−1| and |2| exceed 0.75; 0.5 and 0 do not


def test_a_token_the_teacher_gives_probability_zero_keeps_the_step_finite():
    """A teacher log-prob of −inf (the teacher cannot produce the token) once made the advantage, and so the step,
    −inf: its gap stops at the log-ratio bound, −20, and the rest is as before."""
    teacher = TEACHER.clone()
    teacher[0, 1] = -float("inf")
    adv, stats = opd(teacher=teacher)
    assert torch.isfinite(adv).all() and math.isfinite(stats["opd_reverse_kl"])
    assert adv.tolist() == [[0.5, -20.0, 0.0], [0.0, 2.0, 0.0]]


def test_a_teacher_equal_to_the_student_leaves_the_rewards_advantage():
    adv, _ = opd(rewards=(0.0, 1.0), teacher=STUDENT, opd_reward="grpo")
    sequence = group_advantage(torch.tensor([0.0, 1.0]), 2)
    assert torch.equal(adv, sequence[:, None] * MASK)


def test_the_rewards_estimator_runs_with_its_own_defaults_and_checks():
    """`opd_reward` selects an estimator that runs, and is checked, as a selected piece with its own defaults: its
    check (k ≤ G) runs at fit start with the run's group size. A knob of the wrapped estimator given to `opd` is
    a knob `opd` does not read: one error line. (Before the declared knobs, `pass_at_k` in the old flat knob
    mapping reached the wrapped pass-at-k; a piece's knobs now come from its own section only.)"""
    from rlvr_lightning.pieces.selection import selected_pieces

    teacher = {"model_name_or_path": "embedded"}
    h = GRPO(advantage_estimator={"name": "opd", "knobs": {"opd_reward": "pass-at-k"}}, teacher=teacher).hparams
    rewards, logp, mask = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]), torch.zeros(8, 3), torch.ones(8, 3)
    inputs = AdvantageInputs(rewards, rewards, 8, distillation=DistillationInputs(logp, logp, mask))  # a group of 8
    adv, _ = advantage_estimators.bound(h)(inputs)
    direct = advantage_estimators.get("pass-at-k").fn(AdvantageInputs(rewards, rewards, 8), pass_at_k=4)
    assert direct.abs().sum() > 0 and torch.equal(adv, direct[:, None] * mask)  # its default k = 4
    piece, knobs = selected_pieces(h)["opd_reward"]
    assert piece.name == "pass-at-k" and knobs == {}
    with pytest.raises(ConfigError, match=r"pass_at_k must lie in \[1, rollout.group_size=2\], got 4"):
        for piece, knobs in selected_pieces(h).values():  # as the run's check does at fit start
            piece.check_knobs(knobs, {"group_size": 2, "max_response_length": 8})
    with pytest.raises(ConfigError, match=r"^model.advantage_estimator=opd does not read the knob 'pass_at_k'; its knobs: "
                                          r"opd_reward, opd_coef, opd_clip, opd_reward_knobs "):  # fmt: skip
        GRPO(advantage_estimator={"name": "opd", "knobs": {"opd_reward": "pass-at-k", "pass_at_k": 2}}, teacher=teacher)


def test_the_rewards_estimator_runs_with_the_knobs_given_for_it():
    """`opd_reward_knobs` are the wrapped estimator's knobs: it runs, is recorded and is checked with them; a knob it
    does not read is one error line naming it."""
    from rlvr_lightning.pieces.selection import knobs_run_with, selected_pieces

    teacher = {"model_name_or_path": "embedded"}
    chosen = {"name": "opd", "knobs": {"opd_reward": "pass-at-k", "opd_reward_knobs": {"pass_at_k": 2}}}
    h = GRPO(advantage_estimator=chosen, teacher=teacher).hparams
    rewards, logp, mask = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]), torch.zeros(8, 3), torch.ones(8, 3)
    adv, _ = advantage_estimators.bound(h)(AdvantageInputs(rewards, rewards, 8, distillation=DistillationInputs(logp, logp, mask)))
    direct = {k: advantage_estimators.get("pass-at-k").fn(AdvantageInputs(rewards, rewards, 8), pass_at_k=k) for k in (2, 4)}
    assert not torch.equal(direct[2], direct[4]) and torch.equal(adv, direct[2][:, None] * mask)  # k = 2, not its default 4
    piece, knobs = selected_pieces(h)["opd_reward"]
    assert piece.name == "pass-at-k" and knobs == {"pass_at_k": 2}
    for piece, knobs in selected_pieces(h).values():  # k = 2 ≤ G = 2: the run's check passes
        piece.check_knobs(knobs, {"group_size": 2, "max_response_length": 8})
    assert knobs_run_with(h)["advantage_estimator"]["knobs"]["opd_reward_knobs"] == {"pass_at_k": 2}
    with pytest.raises(ConfigError, match=r"^model.advantage_estimator=opd: opd_reward_knobs: pass-at-k does not read the "
                                          r"knob 'k'; its knobs: pass_at_k"):  # fmt: skip
        GRPO(advantage_estimator={"name": "opd", "knobs": {"opd_reward": "pass-at-k", "opd_reward_knobs": {"k": 2}}},
             teacher=teacher)  # fmt: skip


@pytest.mark.parametrize(
    "args,message",
    [
        ({"advantage_estimator": "opd"}, "distils a teacher: set --model.init_args.teacher.model_name_or_path"),
        ({"teacher": {"model_name_or_path": "embedded"}}, "does not read a teacher"),
        ({"advantage_estimator": "opd", "teacher": {"model_name_or_path": "embedded"}, "policy_loss": "real-anchor"},
         "does not read"),
        ({"advantage_estimator": {"name": "opd", "knobs": {"opd_reward": "opd"}},
          "teacher": {"model_name_or_path": "embedded"}}, "reads the teacher itself"),
        ({"advantage_estimator": {"name": "opd", "knobs": {"opd_coef": 0.0}},
          "teacher": {"model_name_or_path": "embedded"}}, "opd_coef must be > 0"),
        ({"advantage_estimator": "opd", "teacher": {"model_name_or_path": "embedded", "servers": -1}},
         "teacher.servers must be ≥ 0"),
    ],
)  # fmt: skip
def test_a_teacher_without_its_estimator_or_the_reverse_is_a_one_line_error(args, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        GRPO(**args)


def test_the_estimator_with_a_teacher_builds():
    module = GRPO(advantage_estimator={"name": "opd", "knobs": {"opd_reward": "grpo"}}, teacher={"model_name_or_path": "embedded"})
    assert module.settings.teacher.model_name_or_path == "embedded"
    assert module.hparams["teacher"]["servers"] == 0


def test_the_update_trains_on_each_tokens_own_advantage(tiny_policy_dir):
    """Through the step: the teacher (an untrained model) scores a recorded rollout in the trainer (the engine's
    log-probs given by hand),
    and the update's advantages are, token by token, GRPO's sequence advantage plus the teacher's log-prob minus
    the engine's, on the sampled tokens only (an inserted token gets 0); the logged reverse KL is their mean."""
    from rlvr_lightning.data.datamodule import RolloutDataModule
    from rlvr_lightning.rollout.settings import RolloutSettings
    from rlvr_lightning.standalone import standalone

    dm = RolloutDataModule(model_name_or_path=str(tiny_policy_dir), batch_size=2, val_data=None,
                           rollout=RolloutSettings(group_size=2, max_response_length=8, engine="hf"))  # fmt: skip
    module = standalone(
        GRPO(advantage_estimator={"name": "opd", "knobs": {"opd_reward": "grpo"}},
             teacher={"model_name_or_path": str(tiny_policy_dir)}), dm
    )
    try:
        prompts = [[5, 6, 7], [8, 9]]
        comps = [
            Completion([20, 21, 22], [-1.0, -2.0, -0.5], "stop"),
            Completion([23, 24], [-0.25, -3.0], "stop", sampled_mask=[True, False]),  # its second token inserted by a tool
            Completion([25], [-1.5], "stop"),
            Completion([26, 27, 28, 29], [-0.1, -0.2, -0.3, -0.4], "length"),
        ]
        rollout = Rollout(PromptBatch(["a", "b"], ["", ""], ["", ""]), 2, prompts, comps, SamplingConfig(group_size=2), 0,
                          correct=torch.tensor([1.0, 0.0, 0.0, 0.0]))  # fmt: skip
        step = module.step_context()
        scored, inputs, metrics = module.rlvr_step.prepare(step, rollout)
        from transformers import AutoModelForCausalLM

        teacher = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float32).eval()
        sequence = group_advantage(torch.tensor([1.0, 0.0, 0.0, 0.0]), 2)
        gaps = []
        for n, comp in enumerate(comps):
            prompt = prompts[n // 2]
            with torch.no_grad():
                logp = teacher(torch.tensor([prompt + comp.token_ids])).logits.log_softmax(-1)[0, len(prompt) - 1 : -1]
            t_logp = logp.gather(-1, torch.tensor(comp.token_ids)[:, None])[:, 0]
            for k, token_logp in enumerate(t_logp.tolist()):
                sampled = comp.sampled_mask[k]
                expected = sequence[n].item() + token_logp - comp.logprobs[k] if sampled else 0.0
                assert inputs.advantages[n, k].item() == pytest.approx(expected, abs=1e-5), (n, k)
                if sampled:
                    gaps.append(comp.logprobs[k] - token_logp)
        assert metrics["opd_reverse_kl"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-5)
        assert scored.token_advantages is not None
    finally:
        module.teardown("fit")
