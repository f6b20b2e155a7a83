"""A scored rollout made ready for the update (`training.prepare`), through a real step built without Lightning: the
sequence advantage on each response token and nowhere else, truncated answers left out of the loss where the
algorithm asks, the reference's log-probs where a KL term needs them, and θ_old from the source the step chose."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.algos import DAPO, GRPO
from rlvr_lightning.pieces.advantages import group_advantage
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.training.settings import BehaviourSettings
from tests.support.plain_step import plain_step
from tests.support.update_harness import MAX_LEN, attach, prepared, sample_rollout, set_engine_logprobs

CORRECT = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])


def rollout(max_tokens: int) -> Rollout:
    """Two prompts × 4 answers of lengths 1 … 4; the answers of `max_tokens` tokens are cut (truncated)."""
    g = torch.Generator().manual_seed(0)
    lengths = [1, 3, 2, 4, 4, 2, 3, 1]
    completions = [Completion(torch.randint(3, 50, (n,), generator=g).tolist(), [-1.0] * n,
                              "length" if n == max_tokens else "stop") for n in lengths]  # fmt: skip
    return Rollout(PromptBatch(["a", "b"], ["1+1?\n", "2+2?\n"], ["2", "4"]), 4, [[5, 6], [7]], completions,
                   SamplingConfig(group_size=4, max_tokens=max_tokens), 0, correct=CORRECT)  # fmt: skip


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_each_response_token_carries_its_sequence_advantage_and_truncated_answers_leave_the_loss_if_asked(
    tiny_policy_dir, mask_truncated
):
    run = plain_step(GRPO, tiny_policy_dir, mask_truncated=mask_truncated, kl_coef=0.1)
    try:
        scored, inputs, _ = run.step.prepare(run.context(), rollout(max_tokens=4))
        expected = group_advantage(CORRECT, 4)
        torch.testing.assert_close(scored.advantages, expected)
        response = inputs.tensors.response_mask
        torch.testing.assert_close(inputs.advantages, expected[:, None] * response)  # 0 on padding
        truncated = torch.tensor([n == 4 for n in (1, 3, 2, 4, 4, 2, 3, 1)])
        kept = response * (~truncated)[:, None] if mask_truncated else response
        torch.testing.assert_close(inputs.loss_mask, kept)
        assert inputs.ref_logp is not None and inputs.ref_logp.shape == response.shape  # the KL term's reference
        assert inputs.behaviour.source == "update"  # one optimizer step, on policy: θ_old from the update's forward
    finally:
        run.close()


def test_mask_truncated_takes_truncated_completions_out_of_the_loss(tiny_policy_dir):
    module = attach(DAPO, tiny_policy_dir, mask_truncated=True)
    rollout = sample_rollout(module)
    inputs = prepared(module, rollout)
    truncated = rollout.truncated
    assert truncated.any() and (~truncated).any()
    assert torch.equal(inputs.loss_mask[truncated], torch.zeros_like(inputs.loss_mask[truncated]))
    torch.testing.assert_close(inputs.loss_mask[~truncated], inputs.tensors.response_mask[~truncated])


def test_behaviour_logprobs_from_the_rollout_engine(tiny_policy_dir):
    module = attach(GRPO, tiny_policy_dir, behaviour=BehaviourSettings(logprobs="rollout"))
    rollout = sample_rollout(module)
    engine_logp = -torch.rand(8, MAX_LEN, generator=torch.Generator().manual_seed(4))
    set_engine_logprobs(rollout, engine_logp)
    inputs = prepared(module, rollout)
    torch.testing.assert_close(inputs.behaviour.old_logp_all(), engine_logp * inputs.tensors.response_mask)
