"""RLVRModule: the training step every RLVR algorithm shares.

One `training_step` = one rollout batch (DESIGN.md, "Data flow"):
  1. the rollout engine samples G completions per prompt         (`collect_rollout`; DAPO: dynamic sampling)
  2. rollout callbacks score them (RewardVerifier → `rollout.correct`, `rollout.rewards`)
  3. the algorithm shapes rewards and turns them into advantages (`compute_rewards`, `compute_advantages`)
  4. θ_old (and reference) log-probs under the trainer's model, no grad; loss mask; truncated-IS weights
  5. attribution callbacks may reshape advantages per token      (`rollout.token_weights`; THR reads
     θ_old's LM-head inputs: captured in step 4, or, with one update per rollout batch, in step 6's own
     forward, which then runs at θ_old — either way no extra transformer forward)
  6. K mini-batches × micro-batches: the algorithm's loss → manual backward → clip → step
  7. the new weights go to the engine, whose change is probed
  8. metrics are logged

Manual optimisation, because global token normalisation (DAPO) and several updates per rollout
batch conflict with Lightning's automatic accumulation scaling. An algorithm subclass only
overrides what differs: usually `policy_loss`, sometimes `compute_rewards`, `compute_advantages`,
`collect_rollout` or `micro_batch_loss`.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from rlvr_lightning.advantages import group_advantage, group_reward_stats, mixed_groups
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.losses import LossAgg, TISLevel, aggregate, kl_penalty, masked_mean, truncated_is_weights
from rlvr_lightning.rollout.engine import RolloutEngine
from rlvr_lightning.rollout.hf_engine import completion_logprobs
from rlvr_lightning.rollout.sync import WeightSyncProbe
from rlvr_lightning.rollout.types import PromptBatch, Rollout, RolloutTensors, SamplingConfig

log = logging.getLogger(__name__)


class RolloutCallback(Callback):
    """A Lightning callback with two extra hooks, called by the module inside the training step."""

    def on_rollout_generated(self, trainer: L.Trainer, module: RLVRModule, rollout: Rollout) -> None:
        """After generation: fill `rollout.rewards` / `rollout.correct` (the reward verifier)."""

    def on_advantages_computed(self, trainer: L.Trainer, module: RLVRModule, rollout: Rollout) -> None:
        """After advantages and the θ_old pass: fill `rollout.token_weights` (THR / OAR attribution)."""

    def hidden_states_needed(self, rollout: Rollout) -> torch.Tensor | None:
        """Bool [N], whole groups: sequences whose θ_old LM-head inputs `token_weights_from_hidden` reads."""
        return None

    def token_weights_from_hidden(
        self, trainer: L.Trainer, module: RLVRModule, rollout: Rollout, hidden: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """Token weights [L_n] per sequence n from its θ_old LM-head inputs `hidden[n]` [L_n, d] (THR).

        `hidden` holds whole groups of the sequences `hidden_states_needed` asked for: all of them at
        once after the θ_old pass, or a micro-batch's worth at a time inside the update's forward when
        that runs at θ_old (then called before the micro-batch's loss). Runs after
        `on_advantages_computed`; a weight multiplies the token's advantage."""
        return {}


def reshapes_advantages(callback: Callback) -> bool:
    """Whether a callback writes token weights (overrides `on_advantages_computed` or `token_weights_from_hidden`)."""
    if not isinstance(callback, RolloutCallback):
        return False
    return any(
        getattr(type(callback), hook) is not getattr(RolloutCallback, hook)
        for hook in ("on_advantages_computed", "token_weights_from_hidden")
    )


@dataclass
class StepNorms:
    """Global normalisers of one optimizer step (ALGORITHMS.md §1.2), summed over micro-batches and ranks."""

    num_seqs: float  # N_S
    num_tokens: float  # T_S (loss-masked response tokens)
    num_groups: float  # B: prompts (REAL's normaliser)
    num_mixed_seqs: float  # M: rollouts in groups with mixed correctness (REAL-BCE's normaliser)
    world_size: int
    norm_const: float  # C of seq-mean-token-sum-norm: max_response_length, never an observed length


@dataclass
class LossInputs:
    """What the loss needs for a set of sequences: the whole rollout batch, or one micro-batch of it."""

    tensors: RolloutTensors
    advantages: torch.Tensor  # [n, T] token advantages (reshaped by attribution if any)
    # [n, T] behaviour log-probs θ_old (0 on padding); None until the update's own forward fills it in
    # when that forward runs at θ_old (`RLVRModule.old_logprobs_from_update`).
    old_logp: torch.Tensor | None
    ref_logp: torch.Tensor | None  # [n, T] reference log-probs when a KL term is used
    loss_mask: torch.Tensor  # [n, T] response tokens that enter the loss (truncated ones may be masked)
    is_weight: torch.Tensor | None  # [n, T] truncated importance-sampling weights, if enabled
    correct: torch.Tensor  # [n] verifier correctness c (REAL's class labels)
    seq_index: torch.Tensor  # positions of these sequences in the rollout
    group_size: int  # G; sequences are stored group-contiguously
    at_old: FromUpdateForward | None = None  # shared by every micro-batch's `select`

    def select(self, idx: torch.Tensor) -> LossInputs:
        def pick(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[idx]

        return LossInputs(
            self.tensors.select(idx), self.advantages[idx], pick(self.old_logp), pick(self.ref_logp),
            self.loss_mask[idx], pick(self.is_weight), self.correct[idx], self.seq_index[idx], self.group_size,
            self.at_old,
        )  # fmt: skip


@dataclass
class FromUpdateForward:
    """What the update's own forward supplies when it runs exactly at θ_old (one optimizer step per
    rollout batch, `RLVRModule.old_logprobs_from_update`), so that no separate no-grad forward is needed:
    θ_old's log-probs, and the LM-head inputs of the token shapers that read them (THR), whose weights
    then reshape each micro-batch's advantages just before its loss (micro-batches hold whole groups)."""

    old_logp: torch.Tensor  # [N, T], filled micro-batch by micro-batch (for logging after the update)
    rollout: Rollout
    shapers: list[RolloutCallback]  # empty unless hidden states are read in the update
    hidden_rows: torch.Tensor | None  # bool [N] (host): sequences whose LM-head inputs the shapers read
    token_weights: torch.Tensor | None  # [N, T] the shapers' weights, filled like old_logp

    def reshape(self, module: RLVRModule, mb: LossInputs, lm_head_in: torch.Tensor) -> torch.Tensor:
        """The micro-batch's token advantages times the shapers' weights from its forward's LM-head inputs."""
        if not self.shapers:
            return mb.advantages
        rows = mb.seq_index.cpu()
        hidden = response_hidden(lm_head_in, rows, self.hidden_rows[rows], mb.tensors.response_mask)
        weights = hidden_token_weights(module, self.rollout, self.shapers, hidden, rows, mb.advantages.shape[1])
        self.token_weights[rows] = weights
        return mb.advantages * weights.to(mb.advantages)


def response_hidden(
    lm_head_in: torch.Tensor, rows: torch.Tensor, need: torch.Tensor, response_mask: torch.Tensor
) -> dict[int, torch.Tensor]:
    """{sequence n: [L_n, d]} of the rows in `need` from the LM-head inputs [n, T+1, d] of a forward with
    `logits_to_keep=T+1`: its first T positions predict the response tokens."""
    lengths = response_mask.sum(1).long().tolist()
    return {int(rows[i]): lm_head_in[i, : lengths[i]] for i in need.nonzero().squeeze(1).tolist()}


def hidden_token_weights(
    module: RLVRModule, rollout: Rollout, shapers: list[RolloutCallback], hidden: dict[int, torch.Tensor],
    rows: torch.Tensor, width: int,
) -> torch.Tensor:  # fmt: skip
    """Token weights [len(rows), width] of the sequences `rows`: the product of every shaper's weights
    from θ_old's LM-head inputs `hidden`; 1 where none reweights."""
    weights = torch.ones(len(rows), width)
    position = {int(n): i for i, n in enumerate(rows.tolist())}
    for cb in shapers:
        for n, w in cb.token_weights_from_hidden(module.trainer, module, rollout, hidden).items():
            weights[position[n], : len(w)] *= w.cpu()
    return weights


class RLVRModule(L.LightningModule):
    def __init__(
        self,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        lr_schedule: str = "constant",
        max_grad_norm: float = 1.0,
        mini_batches: int = 1,
        ppo_epochs: int = 1,
        micro_batch_size: int = 64,
        loss_agg: LossAgg = "seq-mean-token-mean",
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        use_adv_std: bool = True,
        mask_truncated: bool = False,
        behaviour_logprobs: Literal["trainer", "rollout"] = "trainer",
        tis_level: TISLevel = "off",
        tis_cap: float = 2.0,
        allow_filtered_rollout_logprobs: bool = False,
        sync_check_tol: float = 1e-3,
        sync_check_every: int = 10,
        max_nonfinite_steps: int = 10,
        fsdp_param_dtype: str = "float32",
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
            loss_agg: how per-token losses are reduced (ALGORITHMS.md §1.2).
            kl_coef: β of the KL penalty to the frozen initial policy; 0 = no reference model.
            kl_estimator: k1, k2 or k3.
            use_adv_std: divide group-centred rewards by the group std.
            mask_truncated: leave completions cut at max_response_length out of the loss (DAPO's
                "overlong filtering"; TRL's mask_truncated_completions).
            behaviour_logprobs: θ_old log-probs from a no-grad forward of the trainer (`trainer`, default)
                or the rollout engine's own (`rollout`: saves that forward, trusts the engine's numerics).
            tis_level: truncated importance sampling against the engine ≠ trainer mismatch:
                `off`, `token` or `sequence`; weights min(π_old/π_rollout, tis_cap) on the policy term.
            tis_cap: upper bound of the truncated-IS weight.
            allow_filtered_rollout_logprobs: permit rollout log-probs as the behaviour policy (TIS or
                behaviour_logprobs=rollout) while sampling with top-p/top-k; the engine's log-probs
                are then those of the truncated distribution, not of the policy being trained.
            sync_check_tol: max |engine − trainer| log-prob on the probe sequence after a weight sync.
            sync_check_every: probe the first sync and every N-th after it (1 = every sync; the probe is
                one engine call and one trainer forward of a short sequence, ~1% of a step on the default).
            max_nonfinite_steps: stop after this many consecutive updates with a non-finite loss or gradient.
            fsdp_param_dtype: under FSDP (`configs/strategy/fsdp.yaml`), `bfloat16` computes in bf16 with
                fp32 master weights and gradient reduction; raise sync_check_tol with it (the engine's
                log-probs then differ from the bf16 trainer's by more than fp32 rounding).
            activation_checkpointing: recompute each decoder layer's activations in the backward pass.
        """
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        if lr_schedule not in ("constant", "cosine"):
            raise ConfigError(f"model.lr_schedule={lr_schedule!r}; valid: constant, cosine")
        if mini_batches < 1 or ppo_epochs < 1 or micro_batch_size < 1:
            raise ConfigError("model.mini_batches, model.ppo_epochs and model.micro_batch_size must be ≥ 1")
        if behaviour_logprobs not in ("trainer", "rollout"):
            raise ConfigError(f"model.behaviour_logprobs={behaviour_logprobs!r}; valid: trainer, rollout")
        if tis_level not in ("off", "token", "sequence"):
            raise ConfigError(f"model.tis_level={tis_level!r}; valid: off, token, sequence")
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
        self.policy_version = 0
        self.rollout_batches = 0  # completed training steps (rollout batches); the x-axis of every metric
        self.updates_since_rollout = 0
        self.latest_val: dict[str, float] = {}
        self._sync_probe = WeightSyncProbe(tol=sync_check_tol)
        self._nonfinite_streak = 0

    # ---- model, engine, optimiser ------------------------------------------------------------
    def configure_model(self) -> None:
        if self.policy is not None:
            return
        from transformers import AutoModelForCausalLM

        path = self.datamodule.policy_path
        self.policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.policy.config.use_cache = False
        # The policy stays in eval mode on purpose: no dropout, so trainer log-probs equal the
        # engine's and repeated forwards (old log-probs, REAL two-pass) are deterministic.
        warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode at the start of training")
        if self.hparams.kl_coef > 0:
            self.ref_policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            self.ref_policy.requires_grad_(False)
        mesh = self.device_mesh  # set by ModelParallelStrategy (FSDP2); None otherwise
        if mesh is not None:
            from rlvr_lightning.parallel import shard_policy

            h = self.hparams
            dp_mesh = mesh["data_parallel"] if mesh.mesh_dim_names else mesh
            shard_policy(self.policy, dp_mesh, h.fsdp_param_dtype, h.activation_checkpointing)
            if self.ref_policy is not None:
                shard_policy(self.ref_policy, dp_mesh, h.fsdp_param_dtype)
        elif self.hparams.activation_checkpointing:
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    @property
    def datamodule(self):
        return self.trainer.datamodule

    @property
    def engine(self) -> RolloutEngine:
        return self.datamodule.engine(self.policy)

    def configure_callbacks(self) -> list[Callback]:
        from rlvr_lightning.callbacks.reward import RewardVerifier

        # The reward is part of the algorithm: add the default verifier unless the user configured one.
        if any(isinstance(c, RewardVerifier) for c in self.trainer.callbacks):
            return []
        return [RewardVerifier()]

    def configure_optimizers(self):
        h = self.hparams
        opt = torch.optim.AdamW(self.policy.parameters(), lr=h.lr, weight_decay=h.weight_decay)
        total = self.trainer.max_steps if self.trainer.max_steps and self.trainer.max_steps > 0 else None

        def factor(step: int) -> float:
            if step < h.warmup_steps:
                return (step + 1) / h.warmup_steps
            if h.lr_schedule == "cosine" and total:
                progress = min(1.0, (step - h.warmup_steps) / max(1, total - h.warmup_steps))
                return 0.5 * (1 + math.cos(math.pi * progress))
            return 1.0

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_fit_start(self) -> None:
        self.validate_config()
        self.engine  # build now, so its start-up cost is not charged to the first step
        if self.policy_version > 0:  # resumed: the engine was built from the base weights
            self.engine.load_weights(self.engine_weights())

    def validate_config(self) -> None:
        """Checks that need the data settings too; run before anything expensive starts."""
        self._check_batch_layout()
        self._check_behaviour_logprobs()
        shapers = [type(cb).__name__ for cb in self.trainer.callbacks if reshapes_advantages(cb)]
        reason = self.token_advantages_unsupported()
        if shapers and reason:
            raise ConfigError(f"{', '.join(shapers)} reshape(s) token advantages, but {reason}")

    def old_logprobs_from_update(self) -> bool:
        """True when θ_old's log-probs can come from the update's own forward instead of a separate
        no-grad pass: with one optimizer step per rollout batch the update runs exactly at θ_old, so
        log π_θ detached *is* log π_old (the ratio is exactly 1 and its gradient that of log π_θ).
        Saves one forward over the rollout batch per step. Not with truncated IS (its weights are
        needed before the update) nor rollout log-probs as the behaviour policy."""
        h = self.hparams
        return h.mini_batches * h.ppo_epochs == 1 and h.behaviour_logprobs == "trainer" and h.tis_level == "off"

    def token_advantages_unsupported(self) -> str | None:
        """Why this algorithm's loss cannot honour per-token advantages (THR/OAR), or None if it can."""
        return None

    def _check_behaviour_logprobs(self) -> None:
        dm, h = self.datamodule.hparams, self.hparams
        filtered = dm.top_p < 1 or dm.top_k > 0
        uses_rollout_logprobs = h.tis_level != "off" or h.behaviour_logprobs == "rollout"
        if filtered and uses_rollout_logprobs and not h.allow_filtered_rollout_logprobs:
            what = f"model.tis_level={h.tis_level}" if h.tis_level != "off" else "model.behaviour_logprobs=rollout"
            raise ConfigError(
                f"{what} uses the rollout engine's log-probs as the behaviour policy, but data.top_p={dm.top_p} / "
                f"data.top_k={dm.top_k} sample from a truncated distribution whose log-probs are not the "
                "policy's. Sample with top_p=1 and top_k=-1, or set model.allow_filtered_rollout_logprobs=true "
                "to accept the bias."
            )

    def _check_batch_layout(self) -> None:
        dm = self.datamodule.hparams
        if dm.batch_size % self.hparams.mini_batches:
            raise ConfigError(
                f"data.batch_size={dm.batch_size} prompts must divide into model.mini_batches="
                f"{self.hparams.mini_batches} mini-batches of whole groups"
            )

    # ---- the algorithm's hooks ---------------------------------------------------------------
    def compute_advantages(self, rollout: Rollout) -> torch.Tensor:
        """Sequence advantages [N] from `rollout.rewards` (default: group-relative, §1.1)."""
        return group_advantage(rollout.rewards, rollout.group_size, use_std=self.hparams.use_adv_std)

    def policy_loss(
        self, logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token policy loss [n, T] and boolean/float per-token statistics. Subclasses define it."""
        raise NotImplementedError

    def micro_batch_loss(self, mb: LossInputs, logp: torch.Tensor, norms: StepNorms) -> tuple[torch.Tensor, dict]:
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

    def kl_loss(self, mb: LossInputs, logp: torch.Tensor, norms: StepNorms, stats: dict) -> torch.Tensor:
        """β·KL(π_θ‖π_ref) inside the loss, with the same aggregator as the policy term (§1.3)."""
        if self.hparams.kl_coef <= 0:
            return logp.new_zeros(())
        kl = kl_penalty(logp, mb.ref_logp, self.hparams.kl_estimator)
        stats["kl"] = kl.detach()
        return self.hparams.kl_coef * self.aggregate(kl, mb.loss_mask, norms)

    # ---- one training step -------------------------------------------------------------------
    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        result = self.train_on_batch(batch)
        if result is not None:
            self._log_step(*result)
        self.rollout_batches += 1

    def train_on_batch(
        self, batch: PromptBatch
    ) -> tuple[Rollout, LossInputs, dict[str, float], dict[str, float]] | None:
        """Steps 1–7 on one prompt batch; returns what is logged, or None when there was nothing to
        learn from (e.g. dynamic sampling found no mixed group). Benchmarks call it directly."""
        times: dict[str, float] = {}
        t_step = time.perf_counter()
        rollout = self.collect_rollout(batch, times)
        if rollout is None:
            return None
        rollout.rewards = self.compute_rewards(rollout)
        rollout.advantages = self.compute_advantages(rollout)
        inputs, is_stats = self.loss_inputs(rollout, times)
        with _timed(times, "update"):
            update_metrics = self.update(rollout, inputs)
        with _timed(times, "weight_sync"):
            self.sync_engine(rollout)
        times["step"] = time.perf_counter() - t_step
        return rollout, inputs, {**update_metrics, **is_stats}, times

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        run_id = getattr(self.logger, "run_id", None)  # the CLI reopens this MLflow run on resume
        checkpoint["rlvr"] = {"policy_version": self.policy_version, "rollout_batches": self.rollout_batches,
                              "mlflow_run_id": run_id}  # fmt: skip

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("rlvr", {})
        self.policy_version = state.get("policy_version", 0)
        self.rollout_batches = state.get("rollout_batches", 0)

    def collect_rollout(self, batch: PromptBatch, times: dict[str, float]) -> Rollout | None:
        """The scored rollout batch to train on. DAPO overrides this with dynamic sampling."""
        return self.generate_and_score(batch, times)

    def generate_and_score(self, batch: PromptBatch, times: dict[str, float], round_index: int = 0) -> Rollout:
        """Sample G completions per prompt and run the rollout callbacks that score them."""
        with _timed(times, "rollout"):
            rollout = self.generate(batch, self.datamodule.sampling(seed=self._sampling_seed(round_index)))
        with _timed(times, "reward"):
            self._run_rollout_hooks("on_rollout_generated", rollout)
        if rollout.rewards is None or rollout.correct is None:
            raise RuntimeError("no rollout callback scored the rollout (is a RewardVerifier configured?)")
        return rollout

    def compute_rewards(self, rollout: Rollout) -> torch.Tensor:
        """Scalar reward r [N] fed to the advantage estimator; default r = c (DAPO shapes it)."""
        return rollout.rewards

    def loss_inputs(
        self, rollout: Rollout, times: dict[str, float] | None = None
    ) -> tuple[LossInputs, dict[str, float]]:
        """Lay the rollout out as tensors; θ_old / reference log-probs; attribution callbacks; token
        advantages; loss mask; truncated-IS weights."""
        h = self.hparams
        times = {} if times is None else times
        t = rollout.tensors(self.datamodule.tokenizer.pad_token_id).to(self.device)
        from_update = self.old_logprobs_from_update()
        shapers, hidden_rows = self._hidden_readers(rollout)
        # The shapers read θ_old's LM-head inputs in the update's forward when that runs at θ_old and
        # every micro-batch holds whole groups (THR scores a group from all its responses).
        in_update = from_update and h.micro_batch_size % rollout.group_size == 0
        with _timed(times, "old_logprob"):
            old_logp, ref_logp, hidden = self.reference_logprobs(
                t, rollout.sampling.temperature, with_old=h.behaviour_logprobs == "trainer" and not from_update,
                hidden_rows=None if in_update else hidden_rows,
            )  # fmt: skip
        with _timed(times, "attribution"):
            self._run_rollout_hooks("on_advantages_computed", rollout)
            if hidden:
                N, T = t.response_mask.shape
                rows = torch.arange(N)
                rollout.multiply_token_weights(hidden_token_weights(self, rollout, shapers, hidden, rows, T))
        del hidden  # B·G·L·d floats: free them before the update
        adv_tok = rollout.advantages.to(self.device)[:, None] * t.response_mask
        if rollout.token_weights is not None:
            adv_tok = adv_tok * rollout.token_weights.to(self.device)
        loss_mask = t.response_mask
        if h.mask_truncated:
            loss_mask = loss_mask * (~rollout.truncated).to(self.device, loss_mask.dtype)[:, None]
        if old_logp is None and not from_update:
            old_logp = t.rollout_logp
        at_old = None
        if from_update:
            at_old = FromUpdateForward(
                old_logp=torch.zeros_like(t.rollout_logp), rollout=rollout, shapers=shapers if in_update else [],
                hidden_rows=hidden_rows, token_weights=torch.ones_like(t.response_mask, device="cpu") if in_update else None,
            )  # fmt: skip
        is_weight, is_stats = truncated_is_weights(old_logp, t.rollout_logp, loss_mask, h.tis_level, h.tis_cap)
        seq_index = torch.arange(t.input_ids.shape[0], device=self.device)
        correct = rollout.correct.to(self.device, torch.float32)
        inputs = LossInputs(
            t, adv_tok, old_logp, ref_logp, loss_mask, is_weight, correct, seq_index, rollout.group_size, at_old
        )
        return inputs, is_stats

    def generate(self, batch: PromptBatch, sampling: SamplingConfig | None = None) -> Rollout:
        """Sample completions for a prompt batch (training sampling settings unless given)."""
        dm = self.datamodule
        prompt_ids = [dm.tokenizer(p, add_special_tokens=False).input_ids for p in batch.prompts]
        sampling = sampling or dm.sampling(seed=self._sampling_seed())
        groups = self.engine.generate(prompt_ids, sampling)
        completions = [c for group in groups for c in group]
        texts = dm.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        return Rollout(
            batch=batch, group_size=sampling.n, prompt_ids=prompt_ids, completions=completions,
            sampling=sampling, policy_version=self.policy_version, texts=texts,
        )  # fmt: skip

    def _sampling_seed(self, round_index: int = 0) -> int:
        # Reproducible across runs and resumes; distinct per step, per generation round and per rank.
        return self.datamodule.hparams.seed * 1_000_003 + self.rollout_batches * 101 + round_index * 10_007 + self.global_rank

    def _run_rollout_hooks(self, hook: str, rollout: Rollout) -> None:
        for cb in self.trainer.callbacks:
            if isinstance(cb, RolloutCallback):
                getattr(cb, hook)(self.trainer, self, rollout)

    # ---- log-probs ---------------------------------------------------------------------------
    def token_logprobs(
        self, model: torch.nn.Module, t: RolloutTensors, temperature: float, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return token_logprobs(model, t, temperature, with_entropy)

    def _hidden_readers(self, rollout: Rollout) -> tuple[list[RolloutCallback], torch.Tensor | None]:
        """The callbacks that read θ_old's LM-head inputs, and the union (bool [N], host) of the
        sequences they read; ([], None) when none does."""
        readers, rows = [], None
        for cb in self.trainer.callbacks:
            if isinstance(cb, RolloutCallback) and (need := cb.hidden_states_needed(rollout)) is not None:
                readers.append(cb)
                rows = need.bool().cpu() if rows is None else rows | need.bool().cpu()
        return readers, rows

    @torch.no_grad()
    def reference_logprobs(
        self, t: RolloutTensors, temperature: float, with_old: bool = True, hidden_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[int, torch.Tensor] | None]:
        """θ_old log-probs recomputed by the trainer (if `with_old`), reference log-probs if KL is on,
        and the θ_old LM-head inputs [L_n, d] of the sequences in `hidden_rows` (bool [N]), all from
        the same forward."""
        old, ref, hidden = [], [], {}
        for idx in self._micro_batches(torch.arange(t.input_ids.shape[0], device=self.device)):
            mb = t.select(idx)
            capture = hidden_rows[idx.cpu()] if hidden_rows is not None else torch.zeros(len(idx), dtype=torch.bool)
            if with_old or capture.any():
                with lm_head_inputs(self.policy, enabled=bool(capture.any())) as grabbed:
                    logp = self.token_logprobs(self.policy, mb, temperature)[0]
                if with_old:
                    old.append(logp)
                if capture.any():
                    # Kept in host memory: B·G·L·d values would crowd the accelerator during the update.
                    found = response_hidden(grabbed[0], idx.cpu(), capture, mb.response_mask)
                    hidden.update({n: h.to("cpu", copy=True) for n, h in found.items()})
            if self.ref_policy is not None:
                ref.append(self.token_logprobs(self.ref_policy, mb, temperature)[0])
        old_logp, ref_logp = (torch.cat(old) if old else None), (torch.cat(ref) if ref else None)
        return old_logp, ref_logp, (hidden if hidden_rows is not None else None)

    def _micro_batches(self, seq_index: torch.Tensor) -> list[torch.Tensor]:
        return list(seq_index.split(self.hparams.micro_batch_size))

    # ---- updates -----------------------------------------------------------------------------
    def update(self, rollout: Rollout, inputs: LossInputs) -> dict[str, float]:
        """K mini-batches (× ppo_epochs) of whole groups, each one optimizer step over micro-batches."""
        opt = self.optimizers()
        sched = self.lr_schedulers()
        h = self.hparams
        G = rollout.group_size
        acc = MetricAccumulator()
        self.updates_since_rollout = 0  # 0 = the policy still is θ_old (the first mini-batch is on policy)
        for _epoch in range(h.ppo_epochs):
            # Mini-batches hold whole groups: prompt-level split, sequences stay group-contiguous.
            for prompt_idx in torch.arange(len(rollout.batch)).chunk(h.mini_batches):
                seq_index = (prompt_idx[:, None] * G + torch.arange(G)).flatten().to(self.device)
                opt.zero_grad(set_to_none=True)
                acc.add("loss", self.accumulate_gradients(inputs, seq_index, rollout.sampling.temperature, acc))
                grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), h.max_grad_norm)
                if isinstance(grad_norm, DTensor):  # FSDP: the norm over all shards
                    grad_norm = grad_norm.full_tensor()
                if not torch.isfinite(grad_norm):
                    self._skip_nonfinite_update(opt, grad_norm)
                    acc.add("skipped_updates", torch.tensor(1.0))
                    continue
                self._nonfinite_streak = 0
                opt.step()
                sched.step()
                self.updates_since_rollout += 1
                acc.add("grad_norm", grad_norm.detach())
        metrics = acc.result()
        metrics["lr"] = sched.get_last_lr()[0]
        return metrics

    def accumulate_gradients(
        self, inputs: LossInputs, seq_index: torch.Tensor, temperature: float, acc: MetricAccumulator | None = None
    ) -> torch.Tensor:
        """Backward of one optimizer step's loss over its micro-batches; returns the step's loss.

        Each micro-batch loss is already divided by the step's global normalisers, so the
        accumulated gradient does not depend on the micro-batch size or the number of ranks.
        """
        norms = self.step_norms(inputs, seq_index)
        at_old = inputs.at_old if inputs.old_logp is None else None  # this update runs at θ_old
        if at_old is not None and at_old.shapers and self.hparams.micro_batch_size % inputs.group_size:
            raise RuntimeError("token shapers read the update's LM-head inputs, but micro-batches split groups")
        step_loss = torch.zeros((), device=self.device)
        for idx in self._micro_batches(seq_index):
            mb = inputs.select(idx)
            with lm_head_inputs(self.policy, enabled=at_old is not None and bool(at_old.shapers)) as grabbed:
                logp, entropy = self.token_logprobs(self.policy, mb.tensors, temperature, with_entropy=acc is not None)
            if at_old is not None:
                mb.old_logp = logp.detach()
                at_old.old_logp[idx] = mb.old_logp
                mb.advantages = at_old.reshape(self, mb, grabbed[0] if grabbed else None)
            loss, stats = self.micro_batch_loss(mb, logp, norms)
            self.manual_backward(loss)
            if acc is not None:
                acc.add_tokens(stats, entropy, mb.loss_mask)
            step_loss += loss.detach()  # already globally normalised: the step's loss is their sum
        if at_old is not None:  # θ_old and the reshaped advantages from now on (logging, a repeated call)
            inputs.old_logp = at_old.old_logp
            if at_old.token_weights is not None:
                at_old.rollout.multiply_token_weights(at_old.token_weights)
                inputs.advantages = inputs.advantages * at_old.token_weights.to(inputs.advantages)
        return step_loss

    def step_norms(self, inputs: LossInputs, seq_index: torch.Tensor) -> StepNorms:
        """The optimizer step's global counts, summed over its micro-batches and all ranks (one all-reduce)."""
        G = inputs.group_size
        mask = inputs.loss_mask[seq_index]
        mixed = mixed_groups(inputs.correct[seq_index], G)
        counts = torch.tensor(
            [float(mask.shape[0]), mask.sum().item(), mask.shape[0] / G, G * mixed.sum().item()], device=self.device
        )
        counts = self.trainer.strategy.reduce(counts, reduce_op="sum").tolist()
        C = float(self.datamodule.hparams.max_response_length)
        return StepNorms(*counts, world_size=self.trainer.world_size, norm_const=C)

    def _skip_nonfinite_update(self, opt, grad_norm: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        self._nonfinite_streak += 1
        log.warning("skipped an update with a non-finite gradient norm (%s)", grad_norm.item())
        if self._nonfinite_streak >= self.hparams.max_nonfinite_steps:
            raise RuntimeError(
                f"{self._nonfinite_streak} consecutive updates had a non-finite loss or gradient; stopping. "
                "Lower model.lr or check the reward and the data."
            )

    # ---- weight sync -------------------------------------------------------------------------
    @torch.no_grad()
    def engine_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) pairs for the engine, one at a time: under FSDP each parameter is
        all-gathered from its shards as it is handed over, so no rank ever holds two full copies."""
        for name, tensor in self.policy.state_dict().items():
            yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    @torch.no_grad()
    def sync_engine(self, rollout: Rollout) -> None:
        self.engine.load_weights(self.engine_weights())
        self.policy_version += 1
        if (self.policy_version - 1) % self.hparams.sync_check_every == 0:
            self._sync_probe.check(self.engine, partial(completion_logprobs, self.policy), rollout)

    # ---- logging -----------------------------------------------------------------------------
    def log_train_metrics(self, metrics: dict[str, float], batch_size: int) -> None:
        """Write one step's metrics to the loggers now, at this rollout batch, and keep them as callback
        metrics (for monitors such as EarlyStopping). Not through Lightning's deferred logging: it hands
        a step's metrics to the loggers only after every on_train_batch_end hook, so a checkpoint saved
        there and a kill right after it would resume past metrics that never reached MLflow."""
        for logger in self.loggers:
            logger.log_metrics(metrics, step=self.rollout_batches)
        self.log_dict(metrics, logger=False, on_step=True, on_epoch=False, batch_size=batch_size)

    def _log_step(self, rollout: Rollout, inputs: LossInputs, update_metrics, times) -> None:
        t = inputs.tensors
        mask = t.response_mask
        lengths = rollout.response_lengths
        log_ratio = (inputs.old_logp - t.rollout_logp) * mask  # log π_old/π_rollout per token
        mismatch = log_ratio.abs()
        valid = mask.bool()
        seq_log_ratio = log_ratio.sum(1)
        metrics = {f"train/{k}": v for k, v in group_reward_stats(rollout.rewards, rollout.group_size).items()}
        metrics.update({f"train/{k}": v for k, v in update_metrics.items()})
        metrics.update({f"train/{k}": v for k, v in rollout.metrics.items()})
        metrics.update(
            {
                "train/accuracy": rollout.correct.float().mean().item(),
                "train/response_length_mean": lengths.mean().item(),
                "train/response_length_max": lengths.max().item(),
                "train/response_clip_ratio": rollout.truncated.float().mean().item(),
                "train/logprob_mismatch_mean": masked_mean(mismatch, mask).item(),
                "train/logprob_mismatch_max": mismatch.max().item(),
                "train/rollout_is_ratio_min": log_ratio[valid].min().exp().item() if valid.any() else 1.0,
                "train/rollout_is_ratio_max": log_ratio[valid].max().exp().item() if valid.any() else 1.0,
                "train/rollout_is_seq_ratio_min": seq_log_ratio.min().clamp(-20, 20).exp().item(),
                "train/rollout_is_seq_ratio_max": seq_log_ratio.max().clamp(-20, 20).exp().item(),
                "train/policy_version": float(self.policy_version),
                "train/sync_probe_max_abs_diff": self._sync_probe.last_diff,
                "throughput/rollout_tokens_per_s": lengths.sum().item() / max(times["rollout"], 1e-9),
            }
        )
        metrics.update({f"time/{k}": v for k, v in times.items()})
        self.log_train_metrics(metrics, batch_size=len(rollout.batch))
        bar = {"reward": metrics["train/reward_mean"]}
        if "val/accuracy" in self.latest_val:
            bar["val_acc"] = self.latest_val["val/accuracy"]
        self.log_dict(bar, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=len(rollout.batch))


def token_logprobs(
    model: torch.nn.Module, t: RolloutTensors, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(y_t | ·) of every response token, log_softmax(logits / T) in fp32, 0 on padding."""
    T = t.response_mask.shape[1]
    out = model(
        input_ids=t.input_ids, attention_mask=t.attention_mask, position_ids=t.position_ids,
        logits_to_keep=T + 1, use_cache=False,
    )  # fmt: skip
    logits = out.logits[:, :-1].float() / temperature  # position P−1+t predicts response token t
    logp_all = logits.log_softmax(-1)
    targets = t.input_ids[:, t.prompt_width :]
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1) * t.response_mask
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@contextmanager
def lm_head_inputs(model: torch.nn.Module, enabled: bool = True):
    """Collect the inputs of the model's output embedding (the last hidden state after the final
    norm, whatever the architecture calls it) during the forwards run inside the block."""
    grabbed: list[torch.Tensor] = []
    if not enabled:
        yield grabbed
        return
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda mod, args, out: grabbed.append(args[0].detach()))
    try:
        yield grabbed
    finally:
        handle.remove()


@contextmanager
def _timed(times: dict[str, float], key: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        times[key] = times.get(key, 0.0) + time.perf_counter() - start


class MetricAccumulator:
    """Token-weighted means of per-token statistics and plain means of scalars over micro-batches."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}
        self.extremes: dict[str, float] = {}

    def add(self, key: str, value: torch.Tensor, weight: float = 1.0) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(value) * weight
        self.counts[key] = self.counts.get(key, 0.0) + weight

    def add_tokens(self, stats: dict[str, torch.Tensor], entropy: torch.Tensor | None, mask: torch.Tensor) -> None:
        n_tok = float(mask.sum())
        per_token = dict(stats)
        if entropy is not None:
            per_token["entropy"] = entropy
        for key, value in per_token.items():
            if value.dim() == 1:  # a set of per-sequence samples: mean, or min/max by its name
                self.add_samples(key, value)
            else:
                self.add(key, masked_mean(value.float(), mask), weight=n_tok)
        if "ratio" in stats:
            self.extremes["ratio_max"] = max(self.extremes.get("ratio_max", 0.0), float((stats["ratio"] * mask).max()))

    def add_samples(self, key: str, values: torch.Tensor) -> None:
        if values.numel() == 0:
            return
        if key.endswith("_max"):
            self.extremes[key] = max(self.extremes.get(key, -math.inf), float(values.max()))
        elif key.endswith("_min"):
            self.extremes[key] = min(self.extremes.get(key, math.inf), float(values.min()))
        else:
            self.add(key, values.float().mean(), weight=float(values.numel()))

    def result(self) -> dict[str, float]:
        out = {k: self.sums[k] / self.counts[k] for k in self.sums if self.counts[k] > 0}
        for old, new in (("clipped_low", "clip_frac_low"), ("clipped_high", "clip_frac_high"), ("ratio", "ratio_mean")):
            if old in out:
                out[new] = out.pop(old)
        if "clip_frac_low" in out:
            out["clip_frac"] = out["clip_frac_low"] + out["clip_frac_high"]
        return {**out, **self.extremes}
