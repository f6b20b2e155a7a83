"""RLVRModule: the LightningModule every RLVR algorithm shares. It keeps Lightning's hooks, the model and
optimizer, logging and the checkpoint hand-off; the step itself is `rlvr_lightning.training.step.TrainingStep`
(generate → score → rewards, advantages → θ_old/reference log-probs, token weights → update → sync), which
it builds from its settings each rollout batch, and the engine lives in its `EngineSession`.

An algorithm is a choice of registered pieces (`rlvr_lightning.pieces`: advantage estimator, policy
loss, loss aggregator, KL estimator, rollout correction), each selected by its config key. A subclass
(one per paper) sets its paper's defaults and returns a `StepAlgorithm` for what its paper changes in the
step's structure (DAPO's reward shaping and dynamic sampling). Manual optimisation: global token
normalisation (DAPO) and several updates per rollout batch conflict with Lightning's automatic
accumulation scaling.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Literal

import lightning as L
from lightning.pytorch.callbacks import Callback

from rlvr_lightning.callbacks.progress import rollout_batches_total
from rlvr_lightning.callbacks.reward import RewardVerifier
from rlvr_lightning.callbacks.rollout import advantage_shapers, rollout_callbacks
from rlvr_lightning.context import Collectives, StepContext
from rlvr_lightning.device_defaults import accelerator_of_device, default_for
from rlvr_lightning.models.lora import LoraSettings, as_settings, trainable_parameters
from rlvr_lightning.models.policy import load_policies
from rlvr_lightning.pieces import kinds
from rlvr_lightning.pieces.selection import piece_args_run_with
from rlvr_lightning.rollout.engine import RolloutEngine
from rlvr_lightning.rollout.types import PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.training.algorithm import BoundPieces, algorithm_args
from rlvr_lightning.training.behaviour import BehaviourSource, behaviour_source
from rlvr_lightning.training.checks import check_run, check_values
from rlvr_lightning.training.engine_session import EngineSession, EngineSpec
from rlvr_lightning.training.engine_setup import engine_compute_dtype, trainer_compute_dtype
from rlvr_lightning.training.generation import generate
from rlvr_lightning.training.objective import Objective
from rlvr_lightning.training.optim import adamw_with_schedule
from rlvr_lightning.training.plan import Optimization, UpdatePlan
from rlvr_lightning.training.step import Skipped, StepAlgorithm, TrainingStep
from rlvr_lightning.training.step_metrics import StepResult, step_metrics
from rlvr_lightning.training.update import NonFiniteGuard


class RLVRModule(L.LightningModule):
    docs = "docs/algorithms.md#the-training-step"

    def __init__(
        self,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        lr_schedule: Literal["constant", "cosine"] = "constant",
        max_grad_norm: float = 1.0,
        num_mini_batches: int = 1,
        ppo_epochs: int = 1,
        micro_batch_size: int = 64,
        max_tokens_per_micro_batch: int | None = None,
        logprob_chunk_tokens: int = 1024,
        packing: bool | None = None,
        advantage_estimator: kinds.AdvantageEstimatorName = "grpo",
        policy_loss: kinds.PolicyLossName = "ppo-clip",
        loss_agg: kinds.LossAggName = "seq-mean-token-mean",
        kl_estimator: kinds.KLEstimatorName = "k3",
        rollout_correction: kinds.RolloutCorrectionName = "none",
        proximal_policy: kinds.ProximalPolicyName = "recompute",
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        dual_clip_c: float | None = None,
        kl_coef: float = 0.0,
        tis_cap: float = 2.0,
        two_pass: bool = False,
        piece_args: dict | None = None,
        mask_truncated: bool = False,
        behaviour_logprobs: Literal["trainer", "rollout"] = "trainer",
        allow_filtered_rollout_logprobs: bool = False,
        sync_check_tol: float | None = None,
        sync_check_every: int = 10,
        max_nonfinite_steps: int = 10,
        fsdp_param_dtype: Literal["float32", "bfloat16"] | None = None,
        activation_checkpointing: bool = False,
        lora: LoraSettings | None = None,
    ) -> None:
        """Every argument is a CLI flag, `--model.init_args.<name>`.

        Args:
            lr: AdamW's learning rate.
            weight_decay: AdamW's decoupled weight decay.
            warmup_steps: linear warm-up, in optimizer steps.
            lr_schedule: after warm-up, `constant` or `cosine` (to 0 at `trainer.max_steps`).
            max_grad_norm: gradient clipping by global norm.
            num_mini_batches: K optimizer steps per rollout batch; the prompts are split into K mini-batches.
            ppo_epochs: passes over the rollout batch.
            micro_batch_size: sequences per forward/backward (gradient accumulation inside a mini-batch).
            max_tokens_per_micro_batch: micro-batches of ≤ this many tokens, rows × (longest prompt + longest response).
            logprob_chunk_tokens: response tokens per LM-head chunk (never the whole logits); 0 = no chunking.
            packing: padding-free micro-batches: each forward over its sequences' real tokens concatenated
                (varlen attention on CUDA), token budgets counting real tokens; None = the device's default
                (on with CUDA, off on CPU: `rlvr_lightning.device_defaults`).
            advantage_estimator: a registered advantage estimator (`python -m rlvr_lightning list`) or a dotted path.
            policy_loss: a registered policy loss (token level, reduced by `loss_agg`; or group level, REAL's).
            loss_agg: a registered loss aggregator: how per-token losses are reduced.
            kl_estimator: a registered KL estimator for the penalty to the frozen initial policy.
            rollout_correction: a registered correction of the engine ≠ trainer mismatch (`tis-token`, …).
            proximal_policy: with a rollout correction, the policy the clip is anchored to (decoupled PPO):
                `recompute` (θ_old from the trainer's pass before the update) or `loglinear` (A-3PO's
                interpolation between the engine's and the update's log-probs, no extra forward).
            clip_eps_low: ε_low of the clip range [1−ε_low, 1+ε_high] of clipped losses.
            clip_eps_high: ε_high (ε_high > ε_low is DAPO's clip-higher).
            dual_clip_c: dual-clip PPO's c > 1 (`ppo-clip`, `gspo`, `gspo-token`): where Â < 0 the loss is also
                capped at c·|Â|; None (default) = off. verl and SkyRL use 3.
            kl_coef: β of the KL penalty; 0 = no KL term and no reference model (`kimi`: τ of its regulariser
                to the behaviour policy, which needs no reference model).
            tis_cap: upper bound of the truncated-IS weight.
            two_pass: group-level losses only: micro-batches may split groups (the exact two-pass method).
            piece_args: knobs of pieces that are not arguments of the algorithm (your own pieces').
            mask_truncated: leave completions cut at max_response_length out of the loss (DAPO's overlong filtering).
            behaviour_logprobs: θ_old log-probs from the `trainer` (a no-grad forward) or the `rollout` engine's own.
            allow_filtered_rollout_logprobs: accept the engine's log-probs as θ_old under top-p/top-k sampling.
            sync_check_tol: max |engine − trainer| log-prob on the probe sequence after a weight sync, and
                between `vllm serve` replicas; None follows the precision (`rollout.sync.default_sync_tol`:
                1e-4 when the engine and the trainer both compute in fp32, else 0.05).
            sync_check_every: probe the first sync and every N-th after it.
            max_nonfinite_steps: stop after this many consecutive updates with a non-finite loss or gradient.
            fsdp_param_dtype: under FSDP, `bfloat16` computes in bf16 with fp32 master weights and reduction
                (default: the device's, bfloat16 on CUDA, float32 on CPU: `rlvr_lightning.device_defaults`).
            activation_checkpointing: recompute each decoder layer's activations in the backward pass.
            lora: train a LoRA adapter (PEFT) instead of every weight (`models.lora.LoraSettings`,
                `--model.init_args.lora.rank 16`); the KL reference is then the base model with the adapter off.
        """
        super().__init__()
        if fsdp_param_dtype is None:  # built in Python (the CLI resolves it from the trainer's accelerator)
            fsdp_param_dtype = default_for("model.fsdp_param_dtype")
        self.save_hyperparameters()
        # What the module runs with, not only what the config gave (LightningCLI passes its config here);
        # piece names as plain strings (the CLI parses them into checked `str` subtypes).
        effective = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        self.hparams.update({k: str(v) if isinstance(v, str) else v for k, v in effective.items()})
        self.lora = as_settings(lora)
        self.hparams["lora"] = None if self.lora is None else asdict(self.lora)  # flat MLflow params, plain pickles
        self.automatic_optimization = False
        check_values(self.hparams)
        args = algorithm_args(self.hparams, type(self))  # what the pieces read: which arguments the algorithm sets
        self.pieces = BoundPieces.of(args)  # each piece checks its knobs; the combination is checked
        self.hparams["piece_args"] = piece_args_run_with(args)  # every knob the pieces run with, for the record
        self.policy, self.ref_policy = None, None  # built in configure_model (FSDP shards them there)
        self.rollout_batches = 0  # completed training steps (rollout batches); the x-axis of every metric
        self.latest_val: dict[str, float] = {}
        self.session = EngineSession(sync_check_tol, sync_check_every)  # the engine, weight sync, stream
        self.nonfinite = NonFiniteGuard(max_nonfinite_steps)

    # ---- the pieces ----------------------------------------------------------------------------
    @property
    def objective(self) -> Objective:
        """The update's loss, from the pieces and knobs in `hparams` (bound when the module was built)."""
        return self.pieces.objective

    @property
    def corrects_rollouts(self) -> bool:
        return self.pieces.corrects_rollouts

    def update_plan(self) -> UpdatePlan:
        packing = self.hparams.packing
        if packing is None:  # built in Python (the CLI resolves it): the default of the device the module is on
            packing = default_for("model.packing", accelerator_of_device(self.device))
        return UpdatePlan.of(self.hparams, float(self.datamodule.rollout.max_response_length), packing)

    # ---- model, engine, optimiser, configuration checks --------------------------------------
    def configure_model(self) -> None:
        if self.policy is None:
            h = self.hparams
            self.policy, self.ref_policy = load_policies(self.datamodule.policy_path, self.objective.needs_reference, self.device_mesh,
                                                         h.fsdp_param_dtype, h.activation_checkpointing, self.lora,
                                                         self.datamodule.hparams.seed)  # fmt: skip

    @property
    def datamodule(self):
        return self.trainer.datamodule

    @property
    def engines(self) -> EngineSession:
        """The engine session, given what builds the engine once the policy is on its device."""
        if self.session.spec is None:
            self.session.attach(EngineSpec(self.datamodule, self.trainer, self.policy, self.lora, self.engine_dtype(),
                                           self.trainer_dtype(), self.hparams.logprob_chunk_tokens, self.trainer.strategy.barrier))  # fmt: skip
        return self.session

    @property
    def engine(self) -> RolloutEngine:
        return self.engines.engine

    @property
    def policy_version(self) -> int:
        """Weight syncs so far: the engine runs this version of the policy."""
        return self.session.policy_version

    def engine_dtype(self) -> str:
        return engine_compute_dtype(self.datamodule.rollout, self.policy.config, self.trainer_dtype(),
                                    accelerator_of_device(self.device))  # fmt: skip

    def trainer_dtype(self) -> str:
        """The dtype the trainer's forwards compute in: the precision plugin's, or FSDP2's parameter dtype."""
        fsdp_param_dtype = self.hparams.fsdp_param_dtype if self.device_mesh is not None else None
        return trainer_compute_dtype(str(self.trainer.precision), fsdp_param_dtype)

    def configure_callbacks(self) -> list[Callback]:
        # The reward is part of the algorithm: add the default verifier unless the user configured one.
        return [] if any(isinstance(c, RewardVerifier) for c in self.trainer.callbacks) else [RewardVerifier()]

    def configure_optimizers(self):
        h, max_steps = self.hparams, self.trainer.max_steps
        total = max_steps if max_steps and max_steps > 0 else None
        # Only what trains: a LoRA policy's frozen base gets neither gradients nor optimizer state.
        return adamw_with_schedule(trainable_parameters(self.policy), h.lr, h.weight_decay, h.warmup_steps, h.lr_schedule, total)

    def on_fit_start(self) -> None:
        self.validate_config()
        _ = self.engine  # built now, so its start-up cost is not charged to the first step

    def teardown(self, stage: str) -> None:
        self.session.close()

    def on_train_start(self) -> None:
        self.engines.start()  # after FSDP restored a resumed run's weights (between on_fit_start and here)

    def validate_config(self) -> None:
        """Checks that need the data settings or the callbacks too; run before anything expensive starts."""
        shapers = [type(cb).__name__ for cb in advantage_shapers(self.trainer)]
        check_run(algorithm_args(self.hparams, type(self)), self.datamodule.hparams.batch_size, self.datamodule.rollout, self.objective,
                  self.update_plan(), shapers, self.corrects_rollouts, self.max_staleness)  # fmt: skip

    def behaviour_source(self) -> BehaviourSource:
        """Where θ_old's log-probs come from (`rlvr_lightning.training.behaviour`)."""
        h, steps = self.hparams, self.hparams.num_mini_batches * self.hparams.ppo_epochs
        return behaviour_source(h.behaviour_logprobs, steps, self.corrects_rollouts, self.objective.reads_step_first,
                                self.max_staleness > 0, self.pieces.approximates_proximal)  # fmt: skip

    @property
    def max_staleness(self) -> int:
        """How many versions ahead of the trainer the rollouts may be generated (`rollout.max_staleness`)."""
        return int(getattr(getattr(getattr(self._trainer, "datamodule", None), "rollout", None), "max_staleness", 0))

    # ---- the step's context and the algorithm's own stages -----------------------------------
    def step_context(self) -> StepContext:
        trainer = self.trainer
        strategy = trainer.strategy
        collectives = Collectives(trainer.world_size, self.global_rank, strategy.reduce, self.device, strategy.barrier)
        return StepContext(
            policy=self.policy, ref_policy=self.ref_policy, engines=self.engines,
            tokenizer=self.datamodule.tokenizer, data=self.datamodule, sampling=self.datamodule.rollout.sampling,
            collectives=collectives, device=self.device, rollout_batch=self.rollout_batches,
            policy_version=self.policy_version, total_rollout_batches=rollout_batches_total(trainer, self),
            seed=self.datamodule.hparams.seed, scorers=tuple(rollout_callbacks(trainer)),
        )  # fmt: skip

    def step_algorithm(self) -> StepAlgorithm:
        """What this algorithm changes in the step's structure: nothing (DAPO returns its own)."""
        return StepAlgorithm()

    @property
    def rlvr_step(self) -> TrainingStep:
        """The training step of this module's settings (`rlvr_lightning.training.step`)."""
        return TrainingStep(self.step_algorithm(), self.pieces, self.update_plan(), self.behaviour_source(),
                            self.hparams.mask_truncated, advantage_shapers(self.trainer), self.nonfinite, self.engines,
                            self.datamodule.rollout)  # fmt: skip

    def generate(self, batch: PromptBatch, sampling: SamplingConfig | None = None) -> Rollout:
        """Sample completions for a prompt batch (training sampling settings unless given)."""
        return generate(self.step_context(), batch, sampling)

    # ---- one training step -------------------------------------------------------------------
    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        result = self.train_on_batch(batch)
        if isinstance(result, Skipped):
            if result.metrics:
                self.log_train_metrics({f"train/{k}": v for k, v in result.metrics.items()}, batch_size=len(batch))
            self.trainer.should_stop = self.trainer.should_stop or result.stop_run
        else:
            old_logp = result.inputs.behaviour.old_logp_all()
            metrics = step_metrics(
                result.batch, result.inputs.tensors, old_logp, result.metrics, result.times,
                self.policy_version, self.session.sync.probe.last_diff,
            )  # fmt: skip
            self.log_train_metrics(metrics, batch_size=len(result.rollout.batch))
            bar = {"reward": metrics["train/reward_mean"], "acc": metrics["train/accuracy"]}
            if "val/accuracy" in self.latest_val:
                bar["val_acc"] = self.latest_val["val/accuracy"]
            self.log_dict(bar, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=len(batch))
        self.rollout_batches += 1

    def train_on_batch(self, batch: PromptBatch) -> StepResult | Skipped:
        """One step on a prompt batch, outside Lightning's loop too (tests, benches)."""
        return self.rlvr_step.run(self.step_context(), batch, self.optimization())

    def optimization(self) -> Optimization:
        return Optimization(self.optimizers(), self.lr_schedulers(), self.policy.parameters, self.manual_backward)

    def log_train_metrics(self, metrics: dict[str, float], batch_size: int) -> None:
        """Write one step's metrics to the loggers now (Lightning's deferred logging would reach them after a
        checkpoint of on_train_batch_end: a kill then would lose them) and keep them as callback metrics."""
        for logger in self.loggers:
            logger.log_metrics(metrics, step=self.rollout_batches)
        self.log_dict(metrics, logger=False, on_step=True, on_epoch=False, batch_size=batch_size)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        run_id = getattr(self.logger, "run_id", None)  # the CLI reopens this MLflow run on resume
        checkpoint["rlvr"] = {**self.session.state_dict(), "rollout_batches": self.rollout_batches, "mlflow_run_id": run_id}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("rlvr", {})
        self.session.load_state_dict(state)
        self.rollout_batches = state.get("rollout_batches", 0)
