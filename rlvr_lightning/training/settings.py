"""The training module's settings, grouped and checked once when the module is built.

An algorithm's own arguments stay flat on the module, `--model.init_args.<name>`: its pieces, each with its knobs
(`--model.init_args.policy_loss.knobs.clip_eps_high`, `rlvr_lightning.pieces.choices`), K, the KL coefficient;
how it is optimised and how its update is computed are groups: `--model.init_args.optim.lr`,
`--model.init_args.compute.micro_batch_size`, `--model.init_args.behaviour.logprobs`. Each group checks its
own values (`check`); `StepSettings` binds the pieces and checks how they combine, and `StepSettings.resolve`
adds what needs the run (the `rollout:` section, the device, the callbacks) to give a `ResolvedStep`.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Literal, TypeVar

from rlvr_lightning.device_defaults import Accelerator, default_for
from rlvr_lightning.errors import ConfigError, check_choice
from rlvr_lightning.models.fast_paths import FUSED_KERNELS
from rlvr_lightning.models.lora import LoraSettings, as_settings
from rlvr_lightning.pieces.choices import CHOICES, choice_of
from rlvr_lightning.pieces.kinds import policy_losses
from rlvr_lightning.pieces.selection import knobs_run_with
from rlvr_lightning.rewards.settings import RewardSettings
from rlvr_lightning.shapers.settings import ShaperSettings
from rlvr_lightning.training.algorithm import BoundPieces, class_defaults
from rlvr_lightning.training.behaviour import BehaviourSource, behaviour_source
from rlvr_lightning.training.checks import check_behaviour, check_run, check_teacher
from rlvr_lightning.training.layout import UpdateLayout
from rlvr_lightning.training.teacher import TeacherSettings

Group = TypeVar("Group")


@dataclass(frozen=True)
class OptimSettings:
    """AdamW and its learning-rate schedule (`--model.init_args.optim.<name>`).

    Args:
        lr: AdamW's learning rate.
        weight_decay: AdamW's decoupled weight decay.
        warmup_steps: linear warm-up, in optimizer steps.
        lr_schedule: after warm-up, `constant` or `cosine` (to 0 at `trainer.max_steps`).
        max_grad_norm: gradient clipping by global norm.
        fused: AdamW's fused kernel (one launch for every parameter) instead of PyTorch's default (foreach);
            the same update up to rounding.
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine"] = "constant"
    max_grad_norm: float = 1.0
    fused: bool = False

    def check(self) -> None:
        check_choice("model.optim.lr_schedule", self.lr_schedule, ("constant", "cosine"))
        if self.warmup_steps < 0:
            raise ConfigError(f"model.optim.warmup_steps must be ≥ 0, got {self.warmup_steps}")
        if not self.lr >= 0:  # AdamW's own refusal is a traceback from inside the optimizer, after the engine started
            raise ConfigError(f"model.optim.lr must be ≥ 0, got {self.lr}")
        if self.weight_decay < 0 or not self.max_grad_norm > 0:
            raise ConfigError(f"model.optim: weight_decay must be ≥ 0 and max_grad_norm > 0, got {self.weight_decay} and "
                              f"{self.max_grad_norm}")  # fmt: skip


@dataclass(frozen=True)
class ComputeSettings:
    """How a rollout batch's update runs on the hardware: micro-batches, the LM head's chunks, packing,
    memory and precision (`--model.init_args.compute.<name>`). None of these changes the update's value.

    Args:
        micro_batch_size: sequences per forward/backward (gradient accumulation inside a mini-batch).
        max_tokens_per_micro_batch: micro-batches of ≤ this many tokens, rows × (longest prompt + longest response).
        logprob_chunk_tokens: response tokens per LM-head chunk (never the whole logits); 0 = no chunking.
        packing: padding-free micro-batches: each forward over its sequences' real tokens concatenated
            (varlen attention on CUDA), token budgets counting real tokens; None = the device's default
            (on with CUDA, off on CPU: `rlvr_lightning.device_defaults`).
        activation_checkpointing: recompute each decoder layer's activations in the backward pass.
        fsdp_param_dtype: under FSDP, `bfloat16` computes in bf16 with fp32 master weights and reduction
            (None = the device's: bfloat16 on CUDA, float32 on CPU).
        max_nonfinite_steps: stop after this many consecutive updates with a non-finite loss or gradient.
        reshard_after_forward: under FSDP2, free each layer's gathered weights after its forward (true) or keep
            them for its backward (false: one gather fewer per layer and micro-batch, the weights held meanwhile).
        compile_layers: `torch.compile` each decoder layer's forward (`models.fast_paths`).
        fused_kernels: `liger`: Liger's Triton kernels for RMSNorm, SwiGLU and rotary embeddings (CUDA only);
            `none`: PyTorch's.
    """

    micro_batch_size: int = 64
    max_tokens_per_micro_batch: int | None = None
    logprob_chunk_tokens: int = 1024
    packing: bool | None = None
    activation_checkpointing: bool = False
    fsdp_param_dtype: Literal["float32", "bfloat16"] | None = None
    max_nonfinite_steps: int = 10
    reshard_after_forward: bool = True
    compile_layers: bool = False
    fused_kernels: Literal["none", "liger"] = "none"

    def check(self) -> None:
        check_choice("model.compute.fused_kernels", self.fused_kernels, FUSED_KERNELS)
        if self.fsdp_param_dtype is not None:
            check_choice("model.compute.fsdp_param_dtype", self.fsdp_param_dtype, ("float32", "bfloat16"))
        if self.micro_batch_size < 1:
            raise ConfigError(f"model.compute.micro_batch_size must be ≥ 1, got {self.micro_batch_size}")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ConfigError(f"model.compute.max_tokens_per_micro_batch must be ≥ 1 (or null), got {self.max_tokens_per_micro_batch}")
        if self.logprob_chunk_tokens < 0:
            raise ConfigError(f"model.compute.logprob_chunk_tokens must be ≥ 0 (0 = no chunking), got {self.logprob_chunk_tokens}")


@dataclass(frozen=True)
class BehaviourSettings:
    """Where θ_old's log-probs come from (`--model.init_args.behaviour.<name>`, `training.behaviour`).

    Args:
        logprobs: `trainer` (a no-grad forward, or the update's own where that is exact) or the `rollout`
            engine's own.
        allow_filtered_rollout_logprobs: accept the engine's log-probs as θ_old under top-p/top-k sampling.
    """

    logprobs: Literal["trainer", "rollout"] = "trainer"
    allow_filtered_rollout_logprobs: bool = False

    def check(self) -> None:
        check_choice("model.behaviour.logprobs", self.logprobs, ("trainer", "rollout"))


def correction_fits(values: Mapping[str, Any], rollout: Any = None) -> bool:
    """Whether the device's default rollout correction (a token-level mask, on CUDA) applies to a run with these
    algorithm arguments, as `check_pieces` and `check_behaviour_logprobs` would have it: a policy loss that weighs
    each token (not a group-level one, nor one term per sequence), θ_old from the trainer (not the engine's own
    log-probs), and sampling from the untruncated distribution (where `rollout`, its `rollout:` section, is known)."""
    loss = policy_losses.selected(values)
    behaviour = values.get("behaviour") or {}
    logprobs = behaviour.get("logprobs") if isinstance(behaviour, Mapping) else getattr(behaviour, "logprobs", None)
    truncated = rollout is not None and (rollout.top_p < 1 or rollout.top_k > 0)
    return loss["level"] == "token" and bool(loss["token_weights"]) and logprobs != "rollout" and not truncated


def config_correction_fits(cfg: Any) -> bool:
    """`correction_fits` of a parsed `make train` configuration (its `model:` section with the class's defaults)."""
    model = cfg.model.as_dict() if hasattr(cfg.model, "as_dict") else dict(cfg.model)
    module_path, _, name = model["class_path"].rpartition(".")
    algorithm = getattr(importlib.import_module(module_path), name)
    return correction_fits(class_defaults(algorithm) | dict(model.get("init_args") or {}), cfg.rollout)


def optimizer_steps_per_rollout_batch(args: Any) -> int:
    """K, from an algorithm's arguments (a mapping or a parsed namespace): the mini-batches of one pass, times
    the passes."""
    get = args.get if isinstance(args, Mapping) else partial(getattr, args)
    return get("num_mini_batches") * get("ppo_epochs")


def group_of(cls: type[Group], value: Group | Mapping[str, Any] | None) -> Group:
    """A settings group from the CLI's dataclass, a plain dict (Python, a checkpoint's hyper-parameters) or
    None (its defaults)."""
    if isinstance(value, cls):
        return value
    try:
        return cls(**dict(value or {}))
    except TypeError as e:  # an unknown key: one line naming the group's fields
        fields = ", ".join(f.name for f in dataclasses.fields(cls))
        raise ConfigError(f"{cls.__name__}: {e}; its settings are {fields}") from None


@dataclass(frozen=True)
class StepSettings:
    """An algorithm's settings as the step runs them, made once when the module is built: its flat
    arguments (`args`: each kind's `PieceChoice`, K, the KL coefficient, a subclass's own), the checked groups, and
    the bound pieces."""

    args: dict[str, Any]
    optim: OptimSettings
    compute: ComputeSettings
    behaviour: BehaviourSettings
    lora: LoraSettings | None
    pieces: BoundPieces
    teacher: TeacherSettings | None = None  # on-policy distillation's teacher, for an estimator that reads one
    rewards: RewardSettings = RewardSettings()  # where correctness comes from, the reward terms, math-verify's options
    shapers: ShaperSettings = ShaperSettings()  # the advantage shapers (THR, OAR, the user's)

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> StepSettings:
        """`values`: the module's arguments (groups as dataclasses or dicts, pieces as choices, names or dicts)."""
        groups = {
            "optim": group_of(OptimSettings, values.get("optim")),
            "compute": group_of(ComputeSettings, values.get("compute")),
            "behaviour": group_of(BehaviourSettings, values.get("behaviour")),
        }
        for group in groups.values():
            group.check()
        if values["num_mini_batches"] < 1 or values["ppo_epochs"] < 1:
            raise ConfigError("model.num_mini_batches and model.ppo_epochs must be ≥ 1")
        args = {k: v for k, v in values.items() if k not in (*groups, "lora", "teacher", "rewards", "shapers")}
        args.update({key: choice_of(key, values.get(key)) for key in CHOICES})
        if args["rollout_correction"].name is None:  # the device's (a module built in Python; the CLI resolved it)
            device = default_for("model.rollout_correction.name", correction_fits=correction_fits(args))
            args["rollout_correction"] = dataclasses.replace(args["rollout_correction"], name=device)
        pieces = BoundPieces.of(args)  # each piece checks its knobs; the combination is checked
        check_behaviour(groups["behaviour"].logprobs, pieces.corrects_rollouts, pieces.proximal)
        teacher = None if values.get("teacher") is None else group_of(TeacherSettings, values.get("teacher"))
        check_teacher(args, teacher)
        rewards, shapers = RewardSettings.of(values.get("rewards")), ShaperSettings.of(values.get("shapers"))
        rewards.check()
        shapers.check()
        return cls(args, **groups, lora=as_settings(values.get("lora")), pieces=pieces, teacher=teacher, rewards=rewards,
                   shapers=shapers)  # fmt: skip

    @classmethod
    def of_config(cls, model: Any) -> StepSettings:
        """From a configuration's `model:` section without building the module: as the CLI parsed it (`make plan`,
        `make doctor`), or a preset's YAML as a dict, whose unset arguments take the class's own defaults
        (`make results`)."""
        model = model.as_dict() if hasattr(model, "as_dict") else dict(model)
        module_path, _, name = model["class_path"].rpartition(".")
        algorithm = getattr(importlib.import_module(module_path), name)
        return cls.of(class_defaults(algorithm) | dict(model.get("init_args") or {}))

    @property
    def optimizer_steps_per_rollout_batch(self) -> int:
        return optimizer_steps_per_rollout_batch(self.args)

    def hparams(self) -> dict[str, Any]:
        """What the module records: the flat arguments, each piece with every knob it runs with, and the groups as
        plain dicts (flat MLflow params `model.init_args.optim.lr`; plain pickles in checkpoints: piece names as
        plain strings, not the CLI's checked `str` subtypes, which `torch.load(weights_only=True)` refuses)."""
        groups = {"optim": asdict(self.optim), "compute": asdict(self.compute), "behaviour": asdict(self.behaviour)}
        lora = None if self.lora is None else asdict(self.lora)
        teacher = None if self.teacher is None else asdict(self.teacher)
        return {**self.args, **knobs_run_with(self.args), **groups, "lora": lora, "teacher": teacher,
                "rewards": asdict(self.rewards), "shapers": asdict(self.shapers)}

    def fsdp_param_dtype(self, accelerator: Accelerator | None = None) -> str:
        """The FSDP2 parameter dtype: the user's, else the device's default (a module built in Python; the
        CLI has resolved it from the trainer's accelerator)."""
        return self.compute.fsdp_param_dtype or default_for("model.compute.fsdp_param_dtype", accelerator)

    def layout(self, max_response_length: int, accelerator: Accelerator | None = None) -> UpdateLayout:
        """The update's layout; packing the user's, else the device's default."""
        u = self.compute
        packing = u.packing if u.packing is not None else default_for("model.compute.packing", accelerator)
        return UpdateLayout(
            self.args["num_mini_batches"],
            self.args["ppo_epochs"],
            u.micro_batch_size,
            u.max_tokens_per_micro_batch,
            u.logprob_chunk_tokens,
            self.optim.max_grad_norm,
            float(max_response_length),
            packing,
        )

    def behaviour_source(self, max_staleness: int) -> BehaviourSource:
        """Where θ_old's log-probs come from (`rlvr_lightning.training.behaviour`)."""
        p = self.pieces
        return behaviour_source(
            self.behaviour.logprobs,
            self.optimizer_steps_per_rollout_batch,
            p.corrects_rollouts,
            p.objective.reads_step_first,
            max_staleness > 0,
            p.approximates_proximal,
        )

    def resolve(self, rollout: Any, batch_size: int, accelerator: Accelerator | None = None, check: bool = False) -> ResolvedStep:
        """These settings on a run: `rollout` its `rollout:` section (`RolloutSettings`), `batch_size` its
        prompts per rollout batch, `accelerator` where the update runs; `check`: run the checks that need them (a run
        does at its start)."""
        layout = self.layout(rollout.max_response_length, accelerator)
        max_staleness = int(rollout.stream.max_staleness)
        if check:
            check_run(
                self.args,
                batch_size,
                rollout,
                self.pieces.objective,
                layout,
                list(self.shapers.names()),
                self.pieces.corrects_rollouts,
                max_staleness,
                self.behaviour,
            )
            if self.compute.compile_layers and getattr(rollout, "engine", None) == "hf":
                raise ConfigError(
                    "model.compute.compile_layers with rollout.engine hf: the HF engine generates with the trainer's "
                    "own policy, and its decoding steps would recompile the compiled layers until torch.compile gives "
                    "up on them; use a vLLM engine, or leave compile_layers off"
                )
        return ResolvedStep(self, layout, self.behaviour_source(max_staleness), self.pieces.objective.needs_whole_groups)


@dataclass(frozen=True)
class ResolvedStep:
    """The step's settings on one run: what `TrainingStep` runs, and what the planner and doctor read."""

    settings: StepSettings
    layout: UpdateLayout  # mini-batches, micro-batches, packing
    behaviour: BehaviourSource  # where θ_old's log-probs come from
    whole_groups: bool  # micro-batches must hold whole groups (a group-level loss without the two-pass method)

    @property
    def pieces(self) -> BoundPieces:
        return self.settings.pieces

    @property
    def needs_reference(self) -> bool:
        """A KL term against the frozen initial policy, which the run then loads."""
        return self.pieces.objective.needs_reference
