"""DAPO — Decoupled Clip and Dynamic sAmpling Policy Optimization (arXiv 2503.14476).

GRPO plus four changes (docs/algorithms.md#dapo; reference framework verl `recipe/dapo`):
  1. clip-higher: ε_low = 0.2, ε_high = 0.28, so low-probability tokens can rise (against entropy collapse)
  2. dynamic sampling: generate rounds of prompts until B groups have mixed correctness (0 < n+ < G)
  3. token-level loss: token-mean over the global token count of the optimizer step
  4. overlong reward shaping: r = (+1 correct / −1 otherwise) + penalty · R_length(L), with
     R_length falling linearly from 0 to −1 over the last L_cache tokens before L_max
No KL. Overlong *filtering* (`mask_truncated`) is available and off, as in the best DAPO runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rlvr_lightning.algos.grpo import GRPO
from rlvr_lightning.context import StepContext
from rlvr_lightning.errors import ConfigError, check_choice
from rlvr_lightning.pieces.advantages import overlong_penalty
from rlvr_lightning.pieces.choices import LossAggChoice, PolicyLossChoice
from rlvr_lightning.pieces.selection import selected_pieces
from rlvr_lightning.rollout.settings import RolloutSettings
from rlvr_lightning.rollout.types import PromptBatch, Rollout
from rlvr_lightning.training.dynamic_sampling import DynamicSampler, OnExhausted
from rlvr_lightning.training.engine_session import Stream
from rlvr_lightning.training.step import Skipped, StepAlgorithm
from rlvr_lightning.training.step_metrics import StageTimer


class DAPO(GRPO):
    docs = "docs/algorithms.md#dapo"

    def __init__(
        self,
        dynamic_sampling: bool = True,
        gen_batch_size: int | None = None,
        max_num_gen_batches: int = 10,
        on_exhausted: OnExhausted = "error",
        max_empty_batches: int = 5,
        signed_reward: bool = True,
        overlong_buffer_len: int | None = None,
        overlong_penalty_factor: float = 1.0,
        policy_loss: PolicyLossChoice = PolicyLossChoice("ppo-clip", {"clip_eps_low": 0.2, "clip_eps_high": 0.28}),
        loss_agg: LossAggChoice = LossAggChoice("token-mean"),
        kl_coef: float = 0.0,
        **kwargs,
    ) -> None:
        """DAPO's own knobs first; then GRPO's with DAPO's defaults (clip-higher, token-mean, no KL).

        Args:
            dynamic_sampling: keep only groups with mixed correctness, regenerating as needed.
            gen_batch_size: prompts per generation round; default 3 × data.batch_size (verl's recipe).
            max_num_gen_batches: generation rounds per training batch before giving up (0 = unlimited).
            on_exhausted: at the round limit, `error` (stop, as the paper's recipe in verl does) or
                `train_partial` (log a warning, train on the mixed groups found: fewer groups than
                data.batch_size, so a smaller token-mean normaliser and possibly fewer mini-batches).
                On several ranks the decision, the number of rounds and the groups kept are the same
                on every rank (the fewest any rank found).
            max_empty_batches: stop the run (gracefully) after this many consecutive rollout batches
                without a single mixed group: the policy has nothing left to learn from this data.
            signed_reward: correctness as +1/−1 (paper) rather than 1/0; with std-scaled advantages the
                two only differ once the overlong penalty is added.
            overlong_buffer_len: L_cache, the last tokens before rollout.max_response_length over which the
                penalty ramps to −1; default 20% of max_response_length (the paper's 4096 of 20480);
                0 turns the shaping off.
            overlong_penalty_factor: scale of the overlong penalty.
            policy_loss: PPO's clip with clip-higher, ε_low = 0.2, ε_high = 0.28 (1).
            loss_agg: token-mean over the optimizer step's tokens (3).
        """
        check_choice("model.on_exhausted", on_exhausted, OnExhausted)
        if max_num_gen_batches < 0 or (gen_batch_size is not None and gen_batch_size < 1):
            raise ConfigError("model.max_num_gen_batches must be ≥ 0 and model.gen_batch_size ≥ 1")
        super().__init__(
            policy_loss=policy_loss, loss_agg=loss_agg, kl_coef=kl_coef, **kwargs
        )

    @classmethod
    def step_algorithm(cls, args: Mapping[str, Any], rollout: RolloutSettings, batch_size: int) -> DAPOStep:
        """DAPO's step on a run of these `rollout:` settings and prompts per rank, checked against them."""
        L_max = rollout.max_response_length
        buffer = args["overlong_buffer_len"] if args["overlong_buffer_len"] is not None else L_max // 5
        gen_batch_size = args["gen_batch_size"]
        if gen_batch_size is not None and gen_batch_size < batch_size:
            raise ConfigError(f"model.gen_batch_size={gen_batch_size} must be ≥ data.batch_size={batch_size}")
        if buffer > L_max:
            raise ConfigError(f"model.overlong_buffer_len={args['overlong_buffer_len']} exceeds rollout.max_response_length={L_max}")
        maxrl = [key for key, (piece, _) in selected_pieces(args).items() if piece.name == "maxrl"]  # opd_reward too
        if maxrl and (args["signed_reward"] or buffer > 0):
            raise ConfigError(
                f"model.{maxrl[0]}=maxrl takes rewards in [0, 1] ((r − r̄)/r̄: on DAPO's ±1 a group at most half "
                "right has no signal); set model.signed_reward=false and model.overlong_buffer_len=0 to use it in DAPO"
            )
        sampler = DynamicSampler(gen_batch_size, args["max_num_gen_batches"], args["on_exhausted"], args["max_empty_batches"])
        return DAPOStep(sampler if args["dynamic_sampling"] else None, args["signed_reward"], buffer, args["overlong_penalty_factor"], L_max)


class DAPOStep(StepAlgorithm):
    """DAPO's changes to the step: the ±1 reward with the overlong penalty (4), and dynamic sampling (2)."""

    def __init__(
        self,
        sampler: DynamicSampler | None,
        signed_reward: bool,
        overlong_buffer_len: int,
        overlong_penalty_factor: float,
        max_response_length: int,
    ) -> None:
        """`sampler`: None when dynamic sampling is off."""
        self.sampler, self.signed_reward = sampler, signed_reward
        self.buffer, self.penalty_factor, self.L_max = overlong_buffer_len, overlong_penalty_factor, max_response_length

    # ---- 4. overlong reward shaping ----------------------------------------------------------
    def rewards(self, rollout: Rollout) -> tuple[torch.Tensor, dict[str, float]]:
        correct = rollout.correct.float()
        reward = 2 * correct - 1 if self.signed_reward else correct
        reward = rollout.reward_with_terms(reward)  # a user's reward functions' terms, if any
        if self.buffer > 0 and self.penalty_factor:
            penalty = overlong_penalty(rollout.response_lengths, self.L_max, self.buffer)
            return reward + self.penalty_factor * penalty, {"overlong_penalty_mean": penalty.mean().item()}
        return reward, {}

    # ---- 2. dynamic sampling -----------------------------------------------------------------
    def collect(self, step: StepContext, batch: PromptBatch, timer: StageTimer, stream: Stream | None) -> Rollout | Skipped:
        if self.sampler is None:
            return super().collect(step, batch, timer, stream)
        # Generated ahead (rollout.stream.max_staleness), the first round comes from the stream; the rounds that
        # refill it are generated now, by the current policy.
        first = stream.collect(step, batch, timer) if stream is not None else None
        return self.sampler.collect(step, batch, timer, first)

    def prompts(self, step: StepContext, index: int) -> PromptBatch:
        batch = super().prompts(step, index)
        return self.sampler.first_round_prompts(step, batch) if self.sampler is not None else batch
