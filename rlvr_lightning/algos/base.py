"""RLVRModule: the training step every RLVR algorithm shares, read top to bottom in `train_on_batch`:

  generate → score → rewards, advantages → behaviour/reference log-probs, token weights → update → sync → log

Each stage lives in `rlvr_lightning.training` (see its package docstring); this class holds the
configuration, the model and optimizer, and the algorithm's hooks. An algorithm subclass overrides
only what its paper changes: `policy_loss` (the surrogate), sometimes `compute_rewards`,
`compute_advantages`, `micro_batch_loss`, or `collect_rollout`; docs/algorithms.md maps each
algorithm to its pieces.

Manual optimisation, because global token normalisation (DAPO) and several updates per rollout
batch conflict with Lightning's automatic accumulation scaling.
"""

from __future__ import annotations

from functools import partial
from typing import Literal, NamedTuple

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from rlvr_lightning.advantages import group_advantage
from rlvr_lightning.callbacks.reward import RewardVerifier
from rlvr_lightning.callbacks.rollout import advantage_shapers
from rlvr_lightning.errors import ConfigError, check_choice
from rlvr_lightning.losses import KLEstimator, LossAgg, TISLevel, aggregate, kl_penalty
from rlvr_lightning.models.forward import sequence_logprobs
from rlvr_lightning.models.policy import load_policies
from rlvr_lightning.rollout.engine import RolloutEngine
from rlvr_lightning.rollout.sync import EngineSync, full_weights
from rlvr_lightning.rollout.types import PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.training.async_rollouts import RolloutsAhead
from rlvr_lightning.training.batch import LossBatch, StepNorms, UpdateInputs
from rlvr_lightning.training.behaviour import BehaviourSource, behaviour_source
from rlvr_lightning.training.generation import generate, generate_and_score
from rlvr_lightning.training.optim import adamw_with_schedule
from rlvr_lightning.training.prepare import prepare_update
from rlvr_lightning.training.shaping import compose_token_weights
from rlvr_lightning.training.step_metrics import StageTimer, step_metrics
from rlvr_lightning.training.update import PolicyUpdate


class StepResult(NamedTuple):
    """One trained rollout batch: what the step logs, and what tests and benchmarks inspect."""

    rollout: Rollout
    inputs: UpdateInputs
    metrics: dict[str, float]  # the update's and truncated-IS statistics (without the `train/` prefix)
    times: dict[str, float]  # seconds per stage


class RLVRModule(L.LightningModule):
    def __init__(
        self,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        lr_schedule: Literal["constant", "cosine"] = "constant",
        max_grad_norm: float = 1.0,
        mini_batches: int = 1,
        ppo_epochs: int = 1,
        micro_batch_size: int = 64,
        max_tokens_per_micro_batch: int | None = None,
        logprob_chunk_tokens: int = 1024,
        loss_agg: LossAgg = "seq-mean-token-mean",
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        use_adv_std: bool = True,
        mask_truncated: bool = False,
        behaviour_logprobs: Literal["trainer", "rollout"] = "trainer",
        tis_level: TISLevel = "off",
        tis_cap: float = 2.0,
        allow_filtered_rollout_logprobs: bool = False,
        sync_check_tol: float = 1e-3,
        sync_check_every: int = 10,
        max_nonfinite_steps: int = 10,
        fsdp_param_dtype: Literal["float32", "bfloat16"] = "float32",
        activation_checkpointing: bool = False,
    ) -> None:
        """
        Args:
            lr: AdamW learning rate.
            warmup_steps: linear warm-up, in optimizer steps.
            lr_schedule: `constant` or `cosine` (to 0 at `trainer.max_steps`) after warm-up.
            max_grad_norm: gradient clipping by global norm.
            mini_batches: K optimizer steps per rollout batch; the prompts are split into K mini-batches.
            ppo_epochs: passes over the rollout batch.
            micro_batch_size: sequences per forward/backward (gradient accumulation inside a mini-batch).
            max_tokens_per_micro_batch: micro-batches by token budget instead (micro_batch_size is then
                unused): sequences sorted by length, packed while rows × longest row (prompt + response)
                stays within it. Removes most padding when response lengths spread; the update is the same.
            logprob_chunk_tokens: response tokens per LM-head chunk when computing log-probs and entropy,
                so the [tokens × vocabulary] logits never exist whole (~0.6 GB per 1,024 tokens at a
                151,936 vocabulary, fp32); 0 = materialise the full logits (the model's own forward).
            loss_agg: how per-token losses are reduced (docs/algorithms.md, loss aggregation).
            kl_coef: β of the KL penalty to the frozen initial policy; 0 = no reference model.
            kl_estimator: k1, k2 or k3.
            use_adv_std: divide group-centred rewards by the group std.
            mask_truncated: leave completions cut at max_response_length out of the loss (DAPO's
                "overlong filtering"; TRL's mask_truncated_completions).
            behaviour_logprobs: θ_old log-probs from the trainer (`trainer`, default: a no-grad forward, or
                the update's own forward when it runs at θ_old) or the rollout engine's own (`rollout`:
                saves that forward, trusts the engine's numerics).
            tis_level: truncated importance sampling against the engine ≠ trainer mismatch:
                `off`, `token` or `sequence`; weights min(π_old/π_rollout, tis_cap) on the policy term.
            tis_cap: upper bound of the truncated-IS weight.
            allow_filtered_rollout_logprobs: permit rollout log-probs as the behaviour policy (TIS or
                behaviour_logprobs=rollout) while sampling with top-p/top-k; the engine's log-probs
                are then those of the truncated distribution, not of the policy being trained.
            sync_check_tol: max |engine − trainer| log-prob on the probe sequence after a weight sync.
            sync_check_every: probe the first sync and every N-th after it (1 = every sync).
            max_nonfinite_steps: stop after this many consecutive updates with a non-finite loss or gradient.
            fsdp_param_dtype: under FSDP (`configs/strategy/fsdp.yaml`), `bfloat16` computes in bf16 with
                fp32 master weights and gradient reduction; raise sync_check_tol with it.
            activation_checkpointing: recompute each decoder layer's activations in the backward pass.
        """
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        for flag, value, choices in (
            ("lr_schedule", lr_schedule, ("constant", "cosine")), ("loss_agg", loss_agg, LossAgg),
            ("kl_estimator", kl_estimator, KLEstimator), ("behaviour_logprobs", behaviour_logprobs, ("trainer", "rollout")),
            ("tis_level", tis_level, TISLevel), ("fsdp_param_dtype", fsdp_param_dtype, ("float32", "bfloat16")),
        ):  # fmt: skip
            check_choice(f"model.{flag}", value, choices)
        if mini_batches < 1 or ppo_epochs < 1 or micro_batch_size < 1:
            raise ConfigError("model.mini_batches, model.ppo_epochs and model.micro_batch_size must be ≥ 1")
        if max_tokens_per_micro_batch is not None and max_tokens_per_micro_batch < 1:
            raise ConfigError(f"model.max_tokens_per_micro_batch must be ≥ 1 (or null), got {max_tokens_per_micro_batch}")
        if logprob_chunk_tokens < 0:
            raise ConfigError(f"model.logprob_chunk_tokens must be ≥ 0 (0 = no chunking), got {logprob_chunk_tokens}")
        if tis_level != "off" and behaviour_logprobs == "rollout":
            raise ConfigError(
                "model.tis_level corrects θ_old (trainer) against the rollout engine; with "
                "model.behaviour_logprobs=rollout both are the engine's and every weight is 1. Use one or the other."
            )
        if tis_cap <= 0:
            raise ConfigError(f"model.tis_cap must be > 0, got {tis_cap}")
        if sync_check_every < 1:
            raise ConfigError(f"model.sync_check_every must be ≥ 1, got {sync_check_every}")
        self.policy: torch.nn.Module | None = None
        self.ref_policy: torch.nn.Module | None = None
        self.policy_version = 0  # weight syncs so far: the engine runs this version of the policy
        self.rollout_batches = 0  # completed training steps (rollout batches); the x-axis of every metric
        self.latest_val: dict[str, float] = {}
        self.engine_sync = EngineSync(tol=sync_check_tol, check_every=sync_check_every)
        self.policy_update = PolicyUpdate(self)
        self.rollouts_ahead: RolloutsAhead | None = None  # data.async_rollouts: the batch generated ahead

    # ---- model, engine, optimiser, configuration checks --------------------------------------
    def configure_model(self) -> None:
        if self.policy is None:
            h = self.hparams
            self.policy, self.ref_policy = load_policies(
                self.datamodule.policy_path, h.kl_coef > 0, self.device_mesh, h.fsdp_param_dtype,
                h.activation_checkpointing,
            )  # fmt: skip

    @property
    def datamodule(self):
        return self.trainer.datamodule

    @property
    def engine(self) -> RolloutEngine:
        return self.datamodule.engine(self.policy)

    def configure_callbacks(self) -> list[Callback]:
        # The reward is part of the algorithm: add the default verifier unless the user configured one.
        return [] if any(isinstance(c, RewardVerifier) for c in self.trainer.callbacks) else [RewardVerifier()]

    def configure_optimizers(self):
        h, max_steps = self.hparams, self.trainer.max_steps
        total = max_steps if max_steps and max_steps > 0 else None
        return adamw_with_schedule(self.policy.parameters(), h.lr, h.weight_decay, h.warmup_steps, h.lr_schedule, total)

    def on_fit_start(self) -> None:
        self.validate_config()
        _ = self.engine  # built now, so its start-up cost is not charged to the first step

    def teardown(self, stage: str) -> None:
        if self.rollouts_ahead is not None:  # before the datamodule's teardown closes the engine
            self.rollouts_ahead.close()
            self.rollouts_ahead = None

    def on_train_start(self) -> None:
        # Resumed: the engine was built from the base weights. Here, not in `on_fit_start`: strategies
        # that restore the checkpoint after setup (FSDP) restore it between the two hooks. Every rank
        # takes part (gathering sharded weights is a collective). Servers the trainer attached to (rather
        # than started) may hold any weights: they get the trainer's before the first rollout.
        if self.policy_version > 0 or getattr(self.engine, "holds_foreign_weights", False):
            self.engine.load_weights(full_weights(self.policy), version=self.policy_version)

    def validate_config(self) -> None:
        """Checks that need the data settings or the callbacks too; run before anything expensive starts."""
        dm, h = self.datamodule.hparams, self.hparams
        if dm.batch_size % h.mini_batches:
            raise ConfigError(
                f"data.batch_size={dm.batch_size} prompts must divide into model.mini_batches="
                f"{h.mini_batches} mini-batches of whole groups"
            )
        self._check_behaviour_logprobs()
        if self.async_rollouts and getattr(h, "dynamic_sampling", False):
            raise ConfigError(
                "data.async_rollouts=1 with model.dynamic_sampling=true is not supported: dynamic sampling "
                "decides how many prompts to generate from the rewards of the rounds before"
            )
        shapers = [type(cb).__name__ for cb in advantage_shapers(self.trainer)]
        reason = self.token_advantages_unsupported()
        if shapers and reason:
            raise ConfigError(f"{', '.join(shapers)} reshape(s) token advantages, but {reason}")

    def _check_behaviour_logprobs(self) -> None:
        dm, h = self.datamodule.hparams, self.hparams
        filtered = dm.top_p < 1 or dm.top_k > 0
        uses_engine = h.tis_level != "off" or h.behaviour_logprobs == "rollout" or self.async_rollouts
        if filtered and uses_engine and not h.allow_filtered_rollout_logprobs:
            what = (f"model.tis_level={h.tis_level}" if h.tis_level != "off" else
                    "model.behaviour_logprobs=rollout" if h.behaviour_logprobs == "rollout" else "data.async_rollouts=1")  # fmt: skip
            raise ConfigError(
                f"{what} uses the rollout engine's log-probs as the behaviour policy, but data.top_p={dm.top_p} / "
                f"data.top_k={dm.top_k} sample from a truncated distribution whose log-probs are not the "
                "policy's. Sample with top_p=1 and top_k=-1, or set model.allow_filtered_rollout_logprobs=true "
                "to accept the bias."
            )

    def behaviour_source(self) -> BehaviourSource:
        """Where θ_old's log-probs come from (`rlvr_lightning.training.behaviour`)."""
        h = self.hparams
        return behaviour_source(
            h.behaviour_logprobs, h.mini_batches * h.ppo_epochs, h.tis_level, self.two_pass, self.async_rollouts
        )

    @property
    def async_rollouts(self) -> bool:
        """Whether rollouts are generated one step ahead (`data.async_rollouts`), hence one version behind."""
        dm = getattr(self._trainer, "datamodule", None)
        return bool(getattr(getattr(dm, "hparams", None), "async_rollouts", 0))

    @property
    def two_pass(self) -> bool:
        """Accumulate with the two-pass method (`training.update`); losses of per-sequence scalars only."""
        return False

    @property
    def needs_whole_groups(self) -> bool:
        """Whether `micro_batch_loss` reads a group's rollouts together (micro-batches must not split groups)."""
        return False

    def token_advantages_unsupported(self) -> str | None:
        """Why this algorithm's loss cannot honour per-token advantages (THR/OAR), or None if it can."""
        return None

    # ---- the algorithm's hooks ---------------------------------------------------------------
    def compute_rewards(self, rollout: Rollout) -> torch.Tensor:
        """Scalar reward r [N] fed to the advantage estimator; default r = c (DAPO shapes it)."""
        return rollout.rewards

    def compute_advantages(self, rollout: Rollout) -> torch.Tensor:
        """Sequence advantages [N] from `rollout.rewards` (default: group-relative)."""
        return group_advantage(rollout.rewards, rollout.group_size, use_std=self.hparams.use_adv_std)

    def policy_loss(
        self, logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token policy loss [n, T] and boolean/float per-token statistics. Subclasses define it."""
        raise NotImplementedError

    def micro_batch_loss(self, mb: LossBatch, logp: torch.Tensor, norms: StepNorms) -> tuple[torch.Tensor, dict]:
        """Scalar loss of one micro-batch, already divided by the step's global normalisers."""
        per_tok, stats = self.policy_loss(logp, mb.old_logp, mb.advantages, mb.loss_mask)
        if mb.is_weight is not None:  # truncated IS re-weights the policy term only, as in verl
            per_tok = per_tok * mb.is_weight
        return self.aggregate(per_tok, mb.loss_mask, norms) + self.kl_loss(mb, logp, norms, stats), stats

    def aggregate(self, per_tok: torch.Tensor, mask: torch.Tensor, norms: StepNorms) -> torch.Tensor:
        return aggregate(
            per_tok, mask, self.hparams.loss_agg, norms.num_seqs, norms.num_tokens,
            norm_const=norms.norm_const, world_size=norms.world_size,
        )  # fmt: skip

    def kl_loss(self, mb: LossBatch, logp: torch.Tensor, norms: StepNorms, stats: dict) -> torch.Tensor:
        """β·KL(π_θ‖π_ref) inside the loss, with the same aggregator as the policy term."""
        if self.hparams.kl_coef <= 0:
            return logp.new_zeros(())
        kl = kl_penalty(logp, mb.ref_logp, self.hparams.kl_estimator)
        stats["kl"] = kl.detach()
        return self.hparams.kl_coef * self.aggregate(kl, mb.loss_mask, norms)

    def across_ranks(self, value: int, op: Literal["min", "max"]) -> int:
        """The min or max of `value` over all ranks (a collective: every rank must call it)."""
        if self.trainer.world_size == 1:
            return value
        return int(self.trainer.strategy.reduce(torch.tensor(value, device=self.device), reduce_op=op))

    def collect_rollout(self, batch: PromptBatch, timer: StageTimer) -> Rollout | None:
        """The scored rollout batch to train on, or None to skip the step. DAPO samples dynamically."""
        if self.async_rollouts:
            self.rollouts_ahead = self.rollouts_ahead or RolloutsAhead()
            return self.rollouts_ahead.collect(self, batch, timer)
        return generate_and_score(self, batch, timer)

    def generate(self, batch: PromptBatch, sampling: SamplingConfig | None = None) -> Rollout:
        """Sample completions for a prompt batch (training sampling settings unless given)."""
        return generate(self, batch, sampling)

    # ---- one training step -------------------------------------------------------------------
    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        result = self.train_on_batch(batch)
        if result is not None:
            old_logp = result.inputs.behaviour.old_logp_all()
            metrics = step_metrics(
                result.rollout, result.inputs.tensors, old_logp, result.metrics, result.times,
                self.policy_version, self.engine_sync.probe.last_diff,
            )  # fmt: skip
            self.log_train_metrics(metrics, batch_size=len(result.rollout.batch))
            bar = {"reward": metrics["train/reward_mean"], "acc": metrics["train/accuracy"]}
            if "val/accuracy" in self.latest_val:
                bar["val_acc"] = self.latest_val["val/accuracy"]
            self.log_dict(bar, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=len(batch))
        self.rollout_batches += 1

    def train_on_batch(self, batch: PromptBatch) -> StepResult | None:
        """The stages of one step on a prompt batch; None when there was nothing to learn from (e.g.
        dynamic sampling found no mixed group). Benchmarks and tests call it directly."""
        timer = StageTimer()
        rollout = self.collect_rollout(batch, timer)
        if rollout is None:
            return None
        self.engine.release_memory()  # vLLM sleep mode (data.sleep_level); the weight sync wakes it
        rollout.metrics["policy_lag"] = float(self.policy_version - rollout.policy_version)
        rollout.rewards = self.compute_rewards(rollout)
        rollout.advantages = self.compute_advantages(rollout)
        inputs, is_stats = prepare_update(self, rollout, timer)
        with timer("update"):
            update_metrics = self.policy_update.run(inputs, len(rollout.batch))
        rollout.token_weights = compose_token_weights(rollout.token_weights, inputs.behaviour.token_weights())
        if self.rollouts_ahead is not None:
            self.rollouts_ahead.wait(timer)  # the servers take new weights once the batch ahead is done
        with timer("weight_sync"):
            trainer_score = partial(sequence_logprobs, self.policy, chunk_tokens=self.hparams.logprob_chunk_tokens)
            self.engine_sync.sync(self.engine, self.policy, self.policy_version + 1, rollout, trainer_score)
            self.policy_version += 1
        return StepResult(rollout, inputs, {**update_metrics, **is_stats}, timer.finish())

    def log_train_metrics(self, metrics: dict[str, float], batch_size: int) -> None:
        """Write one step's metrics to the loggers now, at this rollout batch, and keep them as callback
        metrics (for monitors such as EarlyStopping). Not through Lightning's deferred logging: it hands
        a step's metrics to the loggers only after every on_train_batch_end hook, so a checkpoint saved
        there and a kill right after it would resume past metrics that never reached MLflow."""
        for logger in self.loggers:
            logger.log_metrics(metrics, step=self.rollout_batches)
        self.log_dict(metrics, logger=False, on_step=True, on_epoch=False, batch_size=batch_size)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        run_id = getattr(self.logger, "run_id", None)  # the CLI reopens this MLflow run on resume
        checkpoint["rlvr"] = {"policy_version": self.policy_version, "rollout_batches": self.rollout_batches,
                              "mlflow_run_id": run_id}  # fmt: skip

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("rlvr", {})
        self.policy_version = state.get("policy_version", 0)
        self.rollout_batches = state.get("rollout_batches", 0)
