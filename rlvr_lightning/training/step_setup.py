"""The training step built from plain values: the parsed settings (the advantage shapers among them), what the
algorithm changes in the step, the `rollout:` settings, the prompts per rollout batch and the engine session. The
module builds it once, at fit start (`algos.wiring` reads these off Lightning); a test or a script builds the same
step without a Trainer."""

from __future__ import annotations

from rlvr_lightning.device_defaults import Accelerator
from rlvr_lightning.rollout.settings import RolloutSettings
from rlvr_lightning.shapers.build import build_shapers
from rlvr_lightning.training.checks import check_environment, check_sharded_shapers
from rlvr_lightning.training.engine_session import EngineSession
from rlvr_lightning.training.settings import StepSettings
from rlvr_lightning.training.step import StepAlgorithm, TrainingStep
from rlvr_lightning.training.update import NonFiniteGuard


def build_training_step(
    settings: StepSettings,
    algorithm: StepAlgorithm,
    rollout: RolloutSettings,
    batch_size: int,
    session: EngineSession,
    accelerator: Accelerator | None = None,
    environment: str | None = None,
    sharded_ranks: bool = False,
    check: bool = False,
) -> TrainingStep:
    """`batch_size`: prompts per rank per rollout batch; `accelerator`: where the update runs (None: the CPU's
    defaults); `environment`: the option that puts the answers in an environment (`data.tool`), if one does;
    `sharded_ranks`: the policy is sharded over several ranks (FSDP); `check`: run the checks that need the run's
    settings first, as a run does at its start."""
    shapers = build_shapers(settings.shapers)
    named = list(zip(shapers, settings.shapers.names()))
    if check and environment is not None:
        check_environment(environment, tuple(name for s, name in named if not s.weighs_sampled_tokens_only))
    if check and sharded_ranks:
        check_sharded_shapers(tuple(name for s, name in named if not s.runs_on_sharded_ranks))
    resolved = settings.resolve(rollout, batch_size, accelerator, check)
    nonfinite = NonFiniteGuard(settings.compute.max_nonfinite_steps)  # the streak of non-finite updates, across batches
    return TrainingStep(algorithm, resolved, settings.args["mask_truncated"], tuple(shapers), nonfinite, session, rollout)
