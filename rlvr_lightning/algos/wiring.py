"""What Lightning hands a training module (its trainer, datamodule, device and policy), turned into the step's
plain objects: the resolved step, the engine's spec, the step's context, the optimizer. Each reads the module
through public Lightning API only, once, and hands back values; nothing here is kept or called back later.
"""

from __future__ import annotations

from typing import Any

from rlvr_lightning.callbacks.closing import CloseOnError
from rlvr_lightning.callbacks.completions import CompletionsTable
from rlvr_lightning.callbacks.progress import bar_metrics, rollout_batches_total
from rlvr_lightning.callbacks.rollout import rollout_callbacks
from rlvr_lightning.context import Collectives, StepContext
from rlvr_lightning.device_defaults import accelerator_of_device
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.models.fast_paths import apply_fast_paths
from rlvr_lightning.models.lora import trainable_parameters
from rlvr_lightning.models.policy import load_policies
from rlvr_lightning.parallel import ranks_barrier, ranks_reduce
from rlvr_lightning.training.engine_setup import EngineSpec, RankPlace, engine_compute_dtype, trainer_compute_dtype
from rlvr_lightning.training.generation import generate as sample_completions
from rlvr_lightning.training.layout import Optimization
from rlvr_lightning.training.optim import adamw_with_schedule
from rlvr_lightning.training.scoring import Scoring
from rlvr_lightning.training.settings import OptimSettings, StepSettings
from rlvr_lightning.training.step import Skipped, StepResult, TrainingStep, logged_metrics
from rlvr_lightning.training.step_setup import build_training_step
from rlvr_lightning.training.teacher import ServerSite, build_teacher


def policies(settings: StepSettings, datamodule: Any, device_mesh: Any) -> tuple[Any, Any]:
    """The policy, with the fast paths `model.compute` asks for (`models.fast_paths`), and, where the objective has a
    KL term, its frozen reference (`models.policy.load_policies`)."""
    policy, reference = load_policies(
        datamodule.policy_path,
        settings.pieces.objective.needs_reference,
        device_mesh,
        settings.fsdp_param_dtype(),
        settings.compute.activation_checkpointing,
        settings.lora,
        datamodule.hparams.seed,
        reshard_after_forward=settings.compute.reshard_after_forward,
    )
    apply_fast_paths(policy, settings.compute.compile_layers, settings.compute.fused_kernels)
    return policy, reference


def teacher(settings: StepSettings, trainer: Any, device_mesh: Any) -> Any:
    """On-policy distillation's teacher of this rank (`training.teacher`), or None without one."""
    if settings.teacher is None:
        return None
    dm = trainer.datamodule
    rollout = dm.rollout
    site = ServerSite(dm.max_model_len(), dm.hparams.seed + trainer.global_rank, rollout.kv_cache_gib,
                      (trainer.local_rank, trainer.num_devices), rollout.dtype)
    return build_teacher(settings.teacher, dm.tokenizer, device_mesh, settings.fsdp_param_dtype(), site)


def trainer_dtype(settings: StepSettings, trainer: Any, sharded: bool) -> str:
    """What the trainer's forwards compute in: the precision plugin's, or FSDP2's parameter dtype (`sharded`:
    the module has a device mesh)."""
    return trainer_compute_dtype(str(trainer.precision), settings.fsdp_param_dtype() if sharded else None)


def engine_spec(module: Any) -> EngineSpec:
    """What builds the module's engine on this rank, from its policy once that is on its device: values read from
    the trainer and the data module here, once."""
    settings, trainer, policy = module.settings, module.trainer, module.policy
    dm, trainer_dt = trainer.datamodule, trainer_dtype(settings, trainer, module.device_mesh is not None)
    engine_dt = engine_compute_dtype(dm.rollout, policy.config, trainer_dt, accelerator_of_device(module.device))
    return EngineSpec(
        rollout=dm.rollout,
        policy_path=dm.policy_path,
        max_model_len=dm.max_model_len(),
        seed=dm.hparams.seed,
        tokenizer=dm.tokenizer,
        ranks=RankPlace(trainer.global_rank, trainer.world_size, trainer.local_rank, trainer.num_devices),
        make_environment=dm.environment_factory(),
        policy=policy,
        lora=settings.lora,
        engine_dtype=engine_dt,
        trainer_dtype=trainer_dt,
        chunk_tokens=settings.compute.logprob_chunk_tokens,
        barrier=ranks_barrier(module.device),
    )


def training_step(module: Any, check: bool = False) -> TrainingStep:
    """The module's training step on its run (`training.step_setup`; `check`: check the settings against the run
    first, as a run does at its start)."""
    dm = module.trainer.datamodule
    algorithm = module.step_algorithm(module.settings.args, dm.rollout, dm.hparams.batch_size)
    environment = next((f"data.{name}" for name in ("tool", "environment") if getattr(dm, name, None) is not None), None)
    return build_training_step(
        module.settings,
        algorithm,
        dm.rollout,
        dm.hparams.batch_size,
        module.session,
        accelerator=accelerator_of_device(module.device),
        environment=environment,
        sharded_ranks=module.device_mesh is not None and module.trainer.world_size > 1,
        check=check,
    )


def step_context(module: Any) -> StepContext:
    """The context of the module's next rollout batch."""
    trainer = module.trainer
    dm = trainer.datamodule
    collectives = Collectives(trainer.world_size, module.global_rank, ranks_reduce(), module.device, ranks_barrier(module.device))
    return StepContext(
        policy=module.policy,
        ref_policy=module.ref_policy,
        teacher=module.teacher,
        engines=module.session,
        tokenizer=dm.tokenizer,
        prompts=dm.prompts,
        sampling=dm.rollout.sampling,
        collectives=collectives,
        device=module.device,
        rollout_batch=module.rollout_batches,
        policy_version=module.session.policy_version,
        total_rollout_batches=rollout_batches_total(trainer, module),
        seed=dm.hparams.seed,
        scoring=module.scoring,
        observers=tuple(rollout_callbacks(trainer)),
        entropy_groups=token_view_groups(trainer, module.rollout_batches),
    )


def token_view_groups(trainer: Any, rollout_batch: int) -> int:
    """The groups of rollout batch `rollout_batch` whose per-token entropy the step keeps: those the run's token view
    shows, on rank 0, which alone logs it (no collective depends on it)."""
    if trainer.global_rank != 0:
        return 0
    return max((c.entropy_groups(rollout_batch) for c in trainer.callbacks if isinstance(c, CompletionsTable)), default=0)


def keep_scorable_problems(scoring: Any, dm: Any) -> None:
    """Leave out the problems whose gold the run cannot score (math-verify cannot parse it), reported once; too few
    left for one rollout batch is one error line."""
    if dm is None or not hasattr(dm, "train_records"):
        return
    dm.train_records = scoring.drop_unparseable_golds(dm.train_records, "data.train_data")
    dm.val_records = scoring.drop_unparseable_golds(dm.val_records, "data.val_data")
    if len(dm.train_records) < dm.hparams.batch_size:
        raise ConfigError(f"data.train_data has {len(dm.train_records)} problems with a gold answer the verifier can "
                          f"parse, fewer than data.batch_size={dm.hparams.batch_size}")  # fmt: skip


def start(module: Any) -> TrainingStep:
    """At fit start: the engine session attached (the policy is on its device from here on), a served teacher's
    replicas started, then the step built and checked against the run before anything expensive starts, then the
    engine built (not charged to the first step)."""
    module.session.attach(engine_spec(module))
    if module.teacher is not None:
        module.teacher.start()
    step = training_step(module, check=True)
    _ = step.session.engine
    return step


def close(module: Any) -> None:
    """At the end of a run, or on its error: the engine session, the scoring stage's pool, the teacher."""
    module.session.close()
    module.scoring.close()
    if module.teacher is not None:
        module.teacher.close()


def scoring(settings: StepSettings) -> Scoring:
    """The scoring stage of the module's `rewards` section (its functions imported now: one error line if not)."""
    return Scoring(settings.rewards)


def generate(module: Any, batch: Any, sampling: Any = None) -> Any:
    """The module's completions of a prompt batch, with the training sampling settings unless given (evaluation)."""
    return sample_completions(step_context(module), batch, sampling)


def default_callbacks(trainer: Any) -> list:
    """What every run adds to the user's callbacks: the default reward verifier unless the user configured one (the
    reward is part of the algorithm), and the closing of the run's engines on an error."""
    return [CloseOnError()]


def optimization(module: Any) -> Optimization:
    """The optimizer, its schedule, the parameters it clips, and Lightning's `manual_backward` (the strategy may wrap it)."""
    return Optimization(module.optimizers(), module.lr_schedulers(), module.policy.parameters, module.manual_backward)


def optimizer(optim: OptimSettings, policy: Any, max_steps: int | None) -> Any:
    """AdamW over what trains (a LoRA policy's frozen base gets neither gradients nor optimizer state), with
    its schedule over the run's optimizer steps."""
    total = max_steps if max_steps and max_steps > 0 else None
    return adamw_with_schedule(
        trainable_parameters(policy), optim.lr, optim.weight_decay, optim.warmup_steps, optim.lr_schedule, total, optim.fused
    )


def finish_rollout_batch(module: Any, result: StepResult | Skipped, prompts: int) -> None:
    """Write one rollout batch's metrics to the module's loggers now (Lightning's deferred logging would reach
    them after a checkpoint of on_train_batch_end: a kill then would lose them), keep them as callback metrics,
    and show a trained batch's reward and accuracy on the progress bar (`prompts`: the dataloader's batch); a
    skipped batch may stop the run (DAPO's batches without a mixed group)."""
    if isinstance(result, Skipped):
        module.trainer.should_stop = module.trainer.should_stop or result.stop_run
    metrics = logged_metrics(result, module.session)
    if not metrics:
        return
    for logger in module.loggers:
        logger.log_metrics(metrics, step=module.rollout_batches)
    trained = not isinstance(result, Skipped)
    module.log_dict(metrics, logger=False, on_step=True, on_epoch=False, batch_size=len(result.rollout.batch) if trained else prompts)
    if trained:
        module.log_dict(bar_metrics(metrics, module.latest_val), prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=prompts)
