"""RLVRModule: the LightningModule every RLVR algorithm shares, a thin shell (docs/layout.md) over its `StepSettings`,
the `TrainingStep` built once at fit start (`algos.wiring` reads what it needs off Lightning) and the `EngineSession`.
An algorithm is a choice of registered pieces (`rlvr_lightning.pieces`); a subclass (one per paper) sets its defaults
and returns a `StepAlgorithm` for what its paper changes in the step (DAPO's). Manual optimisation: global token
normalisation and several updates per rollout batch conflict with Lightning's automatic accumulation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L

from rlvr_lightning.algos import wiring
from rlvr_lightning.models.checkpoint import check_state_fits
from rlvr_lightning.models.lora import LoraSettings
from rlvr_lightning.pieces import choices
from rlvr_lightning.rewards.settings import RewardSettings
from rlvr_lightning.shapers.settings import ShaperSettings
from rlvr_lightning.training.engine_session import EngineSession
from rlvr_lightning.training.settings import BehaviourSettings, ComputeSettings, OptimSettings, StepSettings
from rlvr_lightning.training.step import Skipped, StepAlgorithm, StepResult, TrainingStep
from rlvr_lightning.training.teacher import TeacherSettings


class RLVRModule(L.LightningModule):
    docs = "docs/algorithms.md#the-training-step"

    def __init__(
        self,
        advantage_estimator: choices.AdvantageEstimatorChoice = choices.AdvantageEstimatorChoice("grpo"),
        policy_loss: choices.PolicyLossChoice = choices.PolicyLossChoice("ppo-clip"),
        loss_agg: choices.LossAggChoice = choices.LossAggChoice("seq-mean-token-mean"),
        kl_estimator: choices.KLEstimatorChoice = choices.KLEstimatorChoice("k3"),
        rollout_correction: choices.RolloutCorrectionChoice = choices.RolloutCorrectionChoice(),
        proximal_policy: choices.ProximalPolicyChoice = choices.ProximalPolicyChoice("recompute"),
        kl_coef: float = 0.0,
        mask_truncated: bool = False,
        num_mini_batches: int = 1,
        ppo_epochs: int = 1,
        optim: OptimSettings = OptimSettings(),
        compute: ComputeSettings = ComputeSettings(),
        behaviour: BehaviourSettings = BehaviourSettings(),
        lora: LoraSettings | None = None,
        teacher: TeacherSettings | None = None,
        rewards: RewardSettings = RewardSettings(),
        shapers: ShaperSettings = ShaperSettings(),
    ) -> None:
        """Every argument is a CLI flag, `--model.init_args.<name>` (a group's: `--model.init_args.optim.lr`).

        Args:
            advantage_estimator: a registered advantage estimator (`python -m rlvr_lightning list`) or a dotted
                path, and its knobs: `--model.init_args.advantage_estimator.name`, `….knobs.<knob>` (`pieces.choices`).
            policy_loss: a registered policy loss (token level, reduced by `loss_agg`; or group level, REAL's) and its
                knobs (`--model.init_args.policy_loss.knobs.clip_eps_high 0.28`).
            loss_agg: a registered loss aggregator: how per-token losses are reduced.
            kl_estimator: a registered KL estimator for the penalty to the frozen initial policy (when kl_coef > 0).
            rollout_correction: a registered correction of the engine ≠ trainer mismatch (`tis-token`, …) and its
                knobs; name None (default): the device's (`none` on the CPU, `icepop` on CUDA; `device_defaults`).
            proximal_policy: with a rollout correction, the clip's anchor: `recompute` (θ_old) or `loglinear` (A-3PO).
            kl_coef: β of the KL penalty; 0 = no KL term and no reference model (`kimi`: τ of its regulariser).
            mask_truncated: leave completions cut at max_response_length out of the loss (DAPO's overlong filtering).
            num_mini_batches: K optimizer steps per rollout batch; the prompts are split into K mini-batches.
            ppo_epochs: passes over the rollout batch.
            optim: AdamW and its schedule (`training.settings.OptimSettings`).
            compute: how the update is computed: micro-batches, chunks, packing, memory (`ComputeSettings`).
            behaviour: where θ_old's log-probs come from (`BehaviourSettings`).
            lora: train a LoRA adapter (PEFT) instead of every weight (`models.lora.LoraSettings`).
            teacher: on-policy distillation's teacher, for `advantage_estimator: opd` (`training.teacher.TeacherSettings`).
            rewards: correctness's source and weight, your reward functions, math-verify's options (`rewards.settings`).
            shapers: the advantage shapers, each off unless given: THR, OAR, yours (`shapers.settings`).
        """
        super().__init__()
        self.save_hyperparameters()  # a subclass's own arguments too (DAPO's), which its step algorithm reads
        shared = dict(advantage_estimator=advantage_estimator, policy_loss=policy_loss, loss_agg=loss_agg,
                      kl_estimator=kl_estimator, rollout_correction=rollout_correction, proximal_policy=proximal_policy,
                      kl_coef=kl_coef, mask_truncated=mask_truncated, num_mini_batches=num_mini_batches,
                      ppo_epochs=ppo_epochs, optim=optim, compute=compute, behaviour=behaviour, lora=lora,
                      teacher=teacher, rewards=rewards, shapers=shapers)  # fmt: skip
        self.settings = StepSettings.of({**self.hparams, **shared})  # groups checked, pieces bound, combination checked
        self.hparams.update(self.settings.hparams())  # every knob the pieces run with; the groups as plain dicts
        self.automatic_optimization, self.policy, self.ref_policy, self.teacher = False, None, None, None  # models: configure_model
        self.rollout_batches = 0  # completed rollout batches: the x-axis of every metric
        self.latest_val, self.last_result = {}, None  # the last held-out metrics; the last step's result (callbacks)
        self.session = EngineSession()  # the engine, weight sync, stream; attached at fit start
        self.scoring = wiring.scoring(self.settings)  # correctness and reward terms; math-verify's pool between batches
        self._step: TrainingStep | None = None  # built once, at fit start

    def setup(self, stage: str) -> None:
        wiring.keep_scorable_problems(self.scoring, self.trainer.datamodule)  # after the data module's own setup

    def configure_model(self) -> None:
        if self.policy is None:  # built here, where FSDP shards them
            self.policy, self.ref_policy = wiring.policies(self.settings, self.trainer.datamodule, self.device_mesh)
            self.teacher = wiring.teacher(self.settings, self.trainer, self.device_mesh)

    def configure_callbacks(self) -> list:
        return wiring.default_callbacks(self.trainer)

    def configure_optimizers(self):
        return wiring.optimizer(self.settings.optim, self.policy, self.trainer.max_steps)

    def on_fit_start(self) -> None:
        self._step = wiring.start(self)  # the engine session, a served teacher, the step checked against the run

    def on_train_start(self) -> None:
        self.session.start()  # after FSDP restored a resumed run's weights (between on_fit_start and here)

    def teardown(self, stage: str) -> None:
        wiring.close(self)

    @classmethod
    def step_algorithm(cls, args: Mapping[str, Any], rollout: Any, batch_size: int) -> StepAlgorithm:
        """What the algorithm changes in the step on a run of these `rollout:` settings and prompts per rank: nothing."""
        return StepAlgorithm()

    @property
    def rlvr_step(self) -> TrainingStep:
        """The training step (`training.step`): built at fit start, or on first use outside `fit` (`standalone`)."""
        if self._step is None:
            self._step = wiring.training_step(self)
        return self._step

    def drop_step(self) -> None:  # forget the built step: its next use builds it from the settings as they are then
        self._step = None

    def step_context(self):
        return wiring.step_context(self)

    def generate(self, batch, sampling=None):  # evaluation's: the training sampling settings unless given
        return wiring.generate(self, batch, sampling)

    def training_step(self, batch, batch_idx: int) -> None:
        self.last_result = None  # the last batch's result goes before this one's tensors are made (memory at scale)
        self.last_result = self.train_on_batch(batch)  # read at the batch's end by callbacks (`CompletionsTable`)
        wiring.finish_rollout_batch(self, self.last_result, len(batch))
        self.rollout_batches += 1

    def train_on_batch(self, batch) -> StepResult | Skipped:  # one step, outside Lightning's loop too (tests, benches)
        return self.rlvr_step.run(self.step_context(), batch, wiring.optimization(self))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        run_id = getattr(self.logger, "run_id", None)  # the CLI reopens this MLflow run on resume
        checkpoint["rlvr"] = {**self.session.state_dict(), "rollout_batches": self.rollout_batches, "mlflow_run_id": run_id}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        check_state_fits(checkpoint.get("state_dict"), self.state_dict())
        self.session.load_state_dict(checkpoint.get("rlvr", {}))
        self.rollout_batches = checkpoint.get("rlvr", {}).get("rollout_batches", 0)
