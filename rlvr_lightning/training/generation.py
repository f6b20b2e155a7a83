"""Generation stage: sample G completions per prompt with the rollout engine and score them with the module's
scoring stage (`training.scoring`, the one source of correctness); the rollout callbacks then see the scored
rollout. It returns the scored rollout; nothing writes into it later."""

from __future__ import annotations

from dataclasses import replace

import torch

from rlvr_lightning.context import StepContext
from rlvr_lightning.environments.base import Environment
from rlvr_lightning.environments.episodes import Episode, episode_metrics, generate_episodes
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rollout.engine import RolloutEngine
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.seeding import derived_seed
from rlvr_lightning.training.step_metrics import StageTimer


def generate(step: StepContext, batch: PromptBatch, sampling: SamplingConfig | None = None) -> Rollout:
    """Sample completions for a prompt batch (the training sampling settings unless given)."""
    sampling = sampling or step.sampling(seed=sampling_seed(step))
    return sample(step.engine, step.tokenizer, batch, sampling, step.policy_version, step.environment)


def sample(
    engine: RolloutEngine,
    tokenizer,
    batch: PromptBatch,
    sampling: SamplingConfig,
    policy_version: int = 0,
    environment: Environment | None = None,
) -> Rollout:
    """`engine`'s completions for a prompt batch as a Rollout of policy version `policy_version`, answered in
    turns with `environment` when given (`environments.episodes`): the training step's generation, and
    `make eval`'s, which has no training step."""
    prompt_ids = encode_prompts(tokenizer, batch)
    if environment is None:
        return to_rollout(tokenizer, batch, prompt_ids, sampling, engine.generate(prompt_ids, sampling), policy_version)
    groups = generate_episodes(engine, tokenizer, prompt_ids, sampling, environment, batch)
    return episodes_rollout(tokenizer, batch, prompt_ids, sampling, groups, policy_version, environment)


def episodes_rollout(
    tokenizer,
    batch: PromptBatch,
    prompt_ids: list[list[int]],
    sampling: SamplingConfig,
    groups: list[list[Episode]],
    policy_version: int,
    environment: Environment,
) -> Rollout:
    """Finished episodes as a Rollout: their completions (what a stability guard leaves out marked), the model's
    own words for the reward, the environment's rewards as the reward term `environment` (0 for an answer it
    gave none, where it gives any), and the episode metrics."""
    completions = [[e.completion(environment.excluded(e)) for e in group] for group in groups]
    rollout = to_rollout(tokenizer, batch, prompt_ids, sampling, completions, policy_version)
    episodes = [e for group in groups for e in group]
    own = tokenizer.batch_decode([e.own_ids for e in episodes], skip_special_tokens=True)
    terms = {}
    if any(e.reward is not None for e in episodes):
        terms["environment"] = torch.tensor([e.reward or 0.0 for e in episodes], dtype=torch.float32)
    rollout = replace(rollout, own_texts=own, reward_terms={**rollout.reward_terms, **terms})
    return rollout.with_metrics(episode_metrics(episodes, environment))


def encode_prompts(tokenizer, batch: PromptBatch) -> list[list[int]]:
    return [tokenizer(p, add_special_tokens=False).input_ids for p in batch.prompts]


def to_rollout(
    tokenizer,
    batch: PromptBatch,
    prompt_ids: list[list[int]],
    sampling: SamplingConfig,
    groups: list[list[Completion]],
    policy_version: int,
) -> Rollout:
    """The engine's completion groups as a Rollout, sampled by policy version `policy_version`."""
    completions = [c for group in groups for c in group]
    texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
    return Rollout(
        batch=batch,
        group_size=sampling.group_size,
        prompt_ids=prompt_ids,
        completions=completions,
        sampling=sampling,
        policy_version=policy_version,
        texts=texts,
    )


def sampling_seed(step: StepContext, round_index: int = 0, rollout_batch: int | None = None) -> int:
    """The engine's seed for generation round `round_index` of rollout batch `rollout_batch` (default:
    the current one) on this rank."""
    index = step.rollout_batch if rollout_batch is None else rollout_batch
    return derived_seed(step.seed, index, round_index, step.collectives.rank)


def score_rollout(step: StepContext, rollout: Rollout, timer: StageTimer) -> Rollout:
    """The rollout scored by the scoring stage, then shown to the rollout callbacks, which only watch: correctness
    and reward terms come from the model's `rewards` section alone, and a callback that returns anything is refused
    in one line (a verdict it returned would otherwise be dropped without a word)."""
    if step.scoring is None:
        raise RuntimeError("nothing gave the rollout's correctness (the step's context has no scoring stage)")
    with timer("reward"):
        rollout = step.scoring.score(rollout, step.rollout_batch, step.collectives.rank)
    for observer in step.observers:
        if observer.on_rollout_generated(step, rollout) is not None:
            raise ConfigError(
                f"trainer.callbacks: {type(observer).__name__}.on_rollout_generated returned a value; the hook only "
                "watches (it returns None): give correctness with --model.init_args.rewards.correctness <module.function>"
            )
    return rollout


def generate_and_score(step: StepContext, batch: PromptBatch, timer: StageTimer, round_index: int = 0) -> Rollout:
    """Sample G completions per prompt, score them, and show them to the rollout callbacks."""
    with timer("rollout"):
        rollout = generate(step, batch, step.sampling(seed=sampling_seed(step, round_index)))
    return score_rollout(step, rollout, timer)
