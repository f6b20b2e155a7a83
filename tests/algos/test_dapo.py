"""DAPO (`algos.dapo`) on the tiny real model: its reward, signed correctness plus the overlong penalty."""

from __future__ import annotations

import torch

from rlvr_lightning.algos import DAPO
from tests.support.update_harness import MAX_LEN, attach, sample_rollout


def test_dapo_reward_is_signed_correctness_plus_overlong_penalty(tiny_policy_dir):
    module = attach(DAPO, tiny_policy_dir, overlong_buffer_len=4)
    rollout = sample_rollout(module)
    lengths = rollout.response_lengths
    expected = (2 * rollout.correct - 1) + ((4 - lengths) / 4).clamp(-1, 0)  # penalty from L > 8 − 4
    torch.testing.assert_close(module.rlvr_step.algorithm.rewards(rollout)[0], expected)
    assert (expected < 2 * rollout.correct - 1).any()  # the sample does contain penalised lengths
    assert attach(DAPO, tiny_policy_dir).rlvr_step.algorithm.buffer == MAX_LEN // 5  # 20% of max_response_length
