"""DAPO's dynamic sampling (arXiv 2503.14476; docs/algorithms.md#dynamic-sampling): keep only groups that carry signal.

A group whose rollouts are all correct or all wrong has zero advantage everywhere, so it adds
nothing to the gradient but still dilutes the batch. Dynamic sampling generates rounds of
`gen_batch_size` prompts, keeps the mixed groups (0 < n+ < G, judged on correctness c), and stops
as soon as `target_groups` are kept; the batch is cut to exactly that many groups.

On several ranks every rank samples its own rounds, but they decide together (`fewest_over_ranks`):
the next round is drawn until the rank with the fewest mixed groups has enough, so all ranks draw
the same number of rounds, keep the same number of groups, and stop, skip or raise together. A rank
that stopped alone would leave the others waiting in the update's collectives (FSDP all-gathers, the
step normalisers, the weight sync) or in the HF engine's synchronised `generate`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from rlvr_lightning.context import StepContext
from rlvr_lightning.pieces.advantages import mixed_groups
from rlvr_lightning.rollout.types import PromptBatch, Rollout
from rlvr_lightning.training.generation import generate_and_score
from rlvr_lightning.training.step import Skipped
from rlvr_lightning.training.step_metrics import StageTimer

log = logging.getLogger(__name__)

OnExhausted = Literal["error", "train_partial"]


def _this_rank_only(n: int) -> int:
    return n


class DynamicSamplingExhausted(RuntimeError):
    pass


@dataclass
class DynamicSamplingStats:
    rounds: int
    groups_generated: int
    groups_kept: int  # mixed groups found (before cutting to the target)
    exhausted: bool
    accuracy_before_filter: float

    def metrics(self) -> dict[str, float]:
        return {
            "dynamic_sampling_rounds": float(self.rounds),
            "dynamic_sampling_filtered_frac": 1.0 - self.groups_kept / max(1, self.groups_generated),
            "dynamic_sampling_exhausted": float(self.exhausted),
            "accuracy_before_filter": self.accuracy_before_filter,
        }


def dynamic_sample(
    draw_round: Callable[[int], Rollout],
    target_groups: int,
    max_rounds: int = 10,
    on_exhausted: OnExhausted = "error",
    fewest_over_ranks: Callable[[int], int] = _this_rank_only,
) -> tuple[Rollout | None, DynamicSamplingStats]:
    """Call `draw_round(k)` (a generated *and scored* rollout) until `target_groups` mixed groups are kept.

    `max_rounds = 0` means unlimited. When the limit is reached first, a warning is logged and
    either `DynamicSamplingExhausted` is raised (`error`, as in verl's recipe) or the mixed groups
    found so far are returned (`train_partial`; None if there are none). `fewest_over_ranks(n)` is
    the smallest n over all ranks (a collective every rank calls once per round); every decision is
    taken on it, and every rank returns that many groups (at most `target_groups`).
    """
    if target_groups < 1:
        raise ValueError(f"target_groups must be ≥ 1, got {target_groups}")
    kept: list[Rollout] = []
    n_kept = n_generated = n_correct = n_seqs = 0
    fewest = 0  # mixed groups of the rank that has found the fewest
    round_index = 0
    while fewest < target_groups and (max_rounds == 0 or round_index < max_rounds):
        rollout = draw_round(round_index)
        round_index += 1
        if rollout.correct is None:
            raise RuntimeError("dynamic sampling needs scored rollouts (rollout.correct is None)")
        mixed = mixed_groups(rollout.correct, rollout.group_size)
        n_generated += len(mixed)
        n_correct += int(rollout.correct.sum().item())
        n_seqs += rollout.num_sequences
        survivors = mixed.nonzero().flatten().tolist()
        if survivors:
            kept.append(rollout.select_groups(survivors))
            n_kept += len(survivors)
        fewest = fewest_over_ranks(n_kept)
    stats = DynamicSamplingStats(
        rounds=round_index,
        groups_generated=n_generated,
        groups_kept=n_kept,
        exhausted=fewest < target_groups,
        accuracy_before_filter=n_correct / max(1, n_seqs),
    )
    if stats.exhausted:
        message = (
            f"dynamic sampling found {fewest} of {target_groups} groups with mixed rewards in {round_index} "
            f"generation rounds ({n_generated} groups generated{'' if fewest == n_kept else ' on this rank, fewest over ranks'})"
        )
        if on_exhausted == "error":
            raise DynamicSamplingExhausted(
                message + "; raise model.max_num_gen_batches, or set model.on_exhausted=train_partial"
            )
        log.warning("%s; training on the groups found", message)
        if fewest == 0:
            return None, stats
    keep = min(fewest, target_groups)
    batch = Rollout.concat(kept)
    if n_kept > keep:
        batch = batch.select_groups(list(range(keep)))
    return batch, stats


class DynamicSampler:
    """DAPO's dynamic sampling as a generation stage: rounds of `gen_batch_size` prompts (the first
    starts from the dataloader's batch) until the batch holds `data.batch_size` mixed groups; a run
    whose batches keep holding none stops after `max_empty_batches` of them."""

    def __init__(self, gen_batch_size: int | None, max_rounds: int, on_exhausted: OnExhausted, max_empty_batches: int):
        self.gen_batch_size, self.max_rounds = gen_batch_size, max_rounds
        self.on_exhausted, self.max_empty_batches = on_exhausted, max_empty_batches
        self.empty_streak = 0

    def round_size(self, batch: PromptBatch) -> int:
        """Prompts per generation round: `gen_batch_size`, default 3 × the dataloader's batch."""
        return self.gen_batch_size or 3 * len(batch)

    def first_round_prompts(self, step: StepContext, batch: PromptBatch) -> PromptBatch:
        """Round 0's prompts: the dataloader's batch, so every prompt of an epoch is still seen, then extra ones."""
        return self._with_extra(step, batch, self.round_size(batch))

    @staticmethod
    def _with_extra(step: StepContext, prompts: PromptBatch, size: int) -> PromptBatch:
        missing = size - len(prompts)
        return PromptBatch.concat([prompts, step.prompts.extra(missing)]) if missing > 0 else prompts

    def collect(self, step: StepContext, batch: PromptBatch, timer: StageTimer, first: Rollout | None = None) -> Rollout | Skipped:
        """`first`: round 0 already generated and scored (by the rollout stream, ahead); the rounds after it are
        generated now, by the current policy."""
        gen_batch_size = self.round_size(batch)

        def draw_round(k: int) -> Rollout:
            if k == 0 and first is not None:
                return first
            prompts = self.first_round_prompts(step, batch) if k == 0 else self._with_extra(step, PromptBatch([], [], []), gen_batch_size)
            return generate_and_score(step, prompts, timer, round_index=k)

        fewest = lambda n: step.collectives.agree(n, op="min")  # noqa: E731
        rollout, stats = dynamic_sample(draw_round, len(batch), self.max_rounds, self.on_exhausted, fewest)
        if rollout is None:
            self.empty_streak += 1
            stop = self.empty_streak >= self.max_empty_batches
            if stop:
                log.warning(
                    "%d consecutive rollout batches had no group with mixed correctness; stopping the run",
                    self.empty_streak,
                )
            return Skipped(stats.metrics(), stop_run=stop)
        self.empty_streak = 0
        return rollout.with_metrics(stats.metrics())
