"""A real training step on a real model, built without Lightning: the settings an algorithm class parses, the
policy and its reference, the embedded task's prompts, the HF engine in an engine session, the math-verify
verifier, AdamW with its schedule. What a run builds at fit start (`algos.wiring`), from the same plain values;
the step's own tests build it here."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rlvr_lightning.context import Collectives, StepContext
from rlvr_lightning.data.prompt_format import PromptFormat
from rlvr_lightning.data.sources import embedded_records
from rlvr_lightning.data.training_prompts import TrainingPrompts
from rlvr_lightning.models.lora import trainable_parameters
from rlvr_lightning.models.policy import load_policies, load_tokenizer
from rlvr_lightning.rollout.settings import RolloutSettings
from rlvr_lightning.training.engine_session import EngineSession
from rlvr_lightning.training.engine_setup import EngineSpec, RankPlace
from rlvr_lightning.training.layout import Optimization
from rlvr_lightning.training.optim import adamw_with_schedule
from rlvr_lightning.training.scoring import Scoring
from rlvr_lightning.training.settings import StepSettings
from rlvr_lightning.training.step import Skipped, StepResult, TrainingStep
from rlvr_lightning.training.step_setup import build_training_step

SEED = 0


@dataclass
class PlainRun:
    """A built step with what it runs on: the policy, the prompts, the session, the optimizer."""

    step: TrainingStep
    policy: Any
    ref_policy: Any
    tokenizer: Any
    prompts: TrainingPrompts
    session: EngineSession
    optimization: Optimization
    rollout: RolloutSettings
    scoring: Scoring | None = None
    rollout_batches: int = 0  # completed rollout batches
    results: list = field(default_factory=list)
    entropy_groups: int = 0  # the groups whose per-token entropy each result keeps (a token view's)

    def context(self) -> StepContext:
        return StepContext(
            policy=self.policy, ref_policy=self.ref_policy, engines=self.session, tokenizer=self.tokenizer,
            prompts=self.prompts, sampling=self.rollout.sampling, collectives=Collectives(), device=self.policy.device,
            rollout_batch=self.rollout_batches, policy_version=self.session.policy_version,
            total_rollout_batches=math.inf, seed=SEED, scoring=self.scoring, entropy_groups=self.entropy_groups,
        )  # fmt: skip

    def train_on_next_batch(self) -> StepResult | Skipped:
        """One rollout batch: the next batch of prompts, trained on, as the module's `training_step` does."""
        result = self.step.run(self.context(), self.prompts.batch_at(self.rollout_batches), self.optimization)
        self.rollout_batches += 1
        self.results.append(result)
        return result

    def close(self) -> None:
        self.session.close()
        self.scoring.close()


def plain_step(
    algorithm: type,
    model_dir: str,
    batch_size: int = 4,
    rollout: RolloutSettings | None = None,
    **args: Any,
) -> PlainRun:
    """`algorithm`'s step (an `RLVRModule` class: its defaults, with `args` over them) on the model in `model_dir`
    and the embedded task, shaped as `args`' `shapers` section says (THR, OAR), scored as its `rewards` section says
    (math-verify by default),
    generating with the HF engine unless `rollout` says otherwise."""
    rollout = rollout or RolloutSettings(group_size=4, max_response_length=12, engine="hf", temperature=1.0)
    settings = StepSettings.of_config({"class_path": f"{algorithm.__module__}.{algorithm.__name__}", "init_args": args})
    policy, ref_policy = load_policies(
        str(model_dir), settings.pieces.objective.needs_reference, None, settings.fsdp_param_dtype(), lora=settings.lora, seed=SEED
    )
    tokenizer = load_tokenizer(str(model_dir))
    prompt_format = PromptFormat("{problem}", False, tokenizer)
    prompts = TrainingPrompts(embedded_records("train"), batch_size, SEED, prompt_format.batch)
    session = EngineSession()
    session.attach(
        EngineSpec(
            rollout=rollout, policy_path=str(model_dir), max_model_len=64 + rollout.max_response_length, seed=SEED,
            tokenizer=tokenizer, ranks=RankPlace(), make_environment=lambda: None, policy=policy, lora=settings.lora,
            engine_dtype="float32", trainer_dtype="float32", chunk_tokens=settings.compute.logprob_chunk_tokens,
        )
    )  # fmt: skip
    step = build_training_step(
        settings, algorithm.step_algorithm(settings.args, rollout, batch_size), rollout, batch_size, session, check=True
    )
    optim = settings.optim
    configured = adamw_with_schedule(
        trainable_parameters(policy), optim.lr, optim.weight_decay, optim.warmup_steps, optim.lr_schedule, None, optim.fused
    )
    optimization = Optimization(
        configured["optimizer"], configured["lr_scheduler"]["scheduler"], policy.parameters, lambda loss: loss.backward()
    )
    return PlainRun(step, policy, ref_policy, tokenizer, prompts, session, optimization, rollout, Scoring(settings.rewards))
