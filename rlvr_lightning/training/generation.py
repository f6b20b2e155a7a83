"""Generation stage: sample G completions per prompt with the rollout engine and score them with the
rollout callbacks (the reward verifier); DAPO's dynamic sampling repeats it in rounds."""

from __future__ import annotations

import logging
from functools import partial

from rlvr_lightning.callbacks.rollout import rollout_callbacks
from rlvr_lightning.rollout.dynamic_sampling import OnExhausted, dynamic_sample
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.seeding import derived_seed
from rlvr_lightning.training.step_metrics import StageTimer

log = logging.getLogger(__name__)


def generate(module, batch: PromptBatch, sampling: SamplingConfig | None = None) -> Rollout:
    """Sample completions for a prompt batch (the training sampling settings unless given)."""
    sampling = sampling or module.datamodule.sampling(seed=sampling_seed(module))
    prompt_ids = encode_prompts(module, batch)
    return to_rollout(module, batch, prompt_ids, sampling, module.engine.generate(prompt_ids, sampling),
                      module.policy_version)  # fmt: skip


def encode_prompts(module, batch: PromptBatch) -> list[list[int]]:
    tokenizer = module.datamodule.tokenizer
    return [tokenizer(p, add_special_tokens=False).input_ids for p in batch.prompts]


def to_rollout(module, batch: PromptBatch, prompt_ids: list[list[int]], sampling: SamplingConfig,
               groups: list[list[Completion]], policy_version: int) -> Rollout:  # fmt: skip
    """The engine's completion groups as a Rollout, sampled by policy version `policy_version`."""
    completions = [c for group in groups for c in group]
    texts = module.datamodule.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
    return Rollout(
        batch=batch, group_size=sampling.n, prompt_ids=prompt_ids, completions=completions,
        sampling=sampling, policy_version=policy_version, texts=texts,
    )  # fmt: skip


def sampling_seed(module, round_index: int = 0, rollout_batch: int | None = None) -> int:
    """The engine's seed for generation round `round_index` of rollout batch `rollout_batch` (default:
    the current one) on this rank."""
    step = module.rollout_batches if rollout_batch is None else rollout_batch
    return derived_seed(module.datamodule.hparams.seed, step, round_index, module.global_rank)


def score_rollout(module, rollout: Rollout, timer: StageTimer) -> Rollout:
    """Run the rollout callbacks that score the completions (the reward verifier)."""
    with timer("reward"):
        for cb in rollout_callbacks(module.trainer):
            cb.on_rollout_generated(module.trainer, module, rollout)
    if rollout.rewards is None or rollout.correct is None:
        raise RuntimeError("no rollout callback scored the rollout (is a RewardVerifier configured?)")
    return rollout


def generate_and_score(module, batch: PromptBatch, timer: StageTimer, round_index: int = 0) -> Rollout:
    """Sample G completions per prompt and run the rollout callbacks that score them."""
    with timer("rollout"):
        rollout = generate(module, batch, module.datamodule.sampling(seed=sampling_seed(module, round_index)))
    return score_rollout(module, rollout, timer)


class DynamicSampler:
    """DAPO's dynamic sampling as a generation stage: rounds of `gen_batch_size` prompts (the first
    starts from the dataloader's batch) until the batch holds `data.batch_size` mixed groups; a run
    whose batches keep holding none stops after `max_empty_batches` of them."""

    def __init__(self, gen_batch_size: int | None, max_rounds: int, on_exhausted: OnExhausted, max_empty_batches: int):
        self.gen_batch_size, self.max_rounds = gen_batch_size, max_rounds
        self.on_exhausted, self.max_empty_batches = on_exhausted, max_empty_batches
        self.empty_streak = 0

    def collect(self, module, batch: PromptBatch, timer: StageTimer) -> Rollout | None:
        gen_batch_size = self.gen_batch_size or 3 * len(batch)

        def draw_round(k: int) -> Rollout:
            # Round 0 starts from the dataloader's batch, so every prompt of an epoch is still seen.
            prompts = batch if k == 0 else PromptBatch([], [], [])
            missing = gen_batch_size - len(prompts)
            if missing > 0:
                prompts = PromptBatch.concat([prompts, module.datamodule.extra_prompts(missing)])
            return generate_and_score(module, prompts, timer, round_index=k)

        fewest = partial(module.across_ranks, op="min")
        rollout, stats = dynamic_sample(draw_round, len(batch), self.max_rounds, self.on_exhausted, fewest)
        if rollout is None:
            self.empty_streak += 1
            module.log_train_metrics({f"train/{k}": v for k, v in stats.metrics().items()}, batch_size=len(batch))
            if self.empty_streak >= self.max_empty_batches:
                log.warning(
                    "%d consecutive rollout batches had no group with mixed correctness; stopping the run",
                    self.empty_streak,
                )
                module.trainer.should_stop = True
            return None
        self.empty_streak = 0
        rollout.metrics.update(stats.metrics())
        return rollout
