"""What on-policy distillation's teacher costs a run (`model.teacher`): in the trainer, its weights on every rank
(its shard under FSDP2) for the whole step and a no-grad forward of its own; on `vllm serve` replicas, a prefill
of every sequence there and nothing on the trainer's ranks.

The teacher in the trainer is measured as the policy is, by the planner's fake-tensor step on the teacher's own
configuration (`trainer_measurement.measure_trainer`): its θ_old-like no-grad pass gives the forward's peak and
FLOPs at the run's rows and lengths, and its parameters the bytes it holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.planner.trainer_memory import StagePeak, TrainerMemory, TrainerSetup

STAGE = "teacher log-probs (no grad)"
RESIDENT = ("parameters", "optimizer_state", "gradients")  # what a model holds between steps


@dataclass(frozen=True)
class TeacherPlan:
    name: str  # model.teacher.model_name_or_path
    config: object  # its transformers PretrainedConfig
    replicas: int  # vllm serve replicas per rank (model.teacher.servers); 0: in the trainer
    attached: bool = False  # model.teacher.server_urls: replicas someone else runs

    @property
    def served(self) -> bool:
        return self.replicas > 0 or self.attached


def teacher_plan(teacher) -> TeacherPlan | None:
    """The plan's view of `model.init_args.teacher` (a parsed namespace or a dict; None without a teacher)."""
    if teacher is None:
        return None
    get = teacher.get if isinstance(teacher, dict) else lambda k, d=None: getattr(teacher, k, d)
    name = get("model_name_or_path")
    from rlvr_lightning.planner.models import model_config

    try:
        config = model_config(name)
    except ConfigError as err:
        raise ConfigError(str(err).replace("data.model_name_or_path", "model.teacher.model_name_or_path")) from None
    return TeacherPlan(name, config, int(get("servers", 0) or 0), bool(get("server_urls")))


def with_teacher_in_trainer(trainer: TrainerMemory, policy_setup: TrainerSetup, teacher: TeacherPlan, with_flops: bool) -> TrainerMemory:
    """The policy's stages with the teacher's weights held throughout, and the teacher's no-grad forward as a stage
    of its own (first: the teacher scores the rollout before the advantages)."""
    from rlvr_lightning.planner.trainer_measurement import measure_trainer

    setup = dataclasses.replace(
        policy_setup, model_config=teacher.config, with_reference=False, separate_old_pass=True, capture_lm_head=False,
        accumulates=False, lora=None,
    )
    measured = measure_trainer(setup, with_flops)
    forward = next(s for s in measured.stages if s.stage.startswith("θ_old"))
    weights = forward.breakdown.get("parameters", 0)
    transient = forward.peak_bytes - sum(forward.breakdown.get(k, 0) for k in RESIDENT)

    def plus(s: StagePeak) -> StagePeak:
        return StagePeak(s.stage, s.peak_bytes + weights, {**s.breakdown, "teacher": weights}, s.flops)

    resident = trainer.stages[0].breakdown
    held = sum(resident.get(k, 0) for k in ("parameters", "optimizer_state"))
    own = StagePeak(STAGE, held + weights + transient, {**{k: resident.get(k, 0) for k in ("parameters", "optimizer_state")},
                    "teacher": weights, "activations": transient}, forward.flops)  # fmt: skip
    return dataclasses.replace(trainer, stages=[own, *map(plus, trainer.stages)], teacher_parameters=measured.parameters)


def served_teacher_seconds(teacher: TeacherPlan, parameters: int, tokens: float, flop_s: float) -> float:
    """Seconds for the replicas of a rank to prefill its `tokens` (prompt + response of every sequence): 2 FLOPs per
    parameter and token at `flop_s` each, the replicas side by side."""
    return 2 * parameters * tokens / (flop_s * max(1, teacher.replicas))


def parameter_count(config) -> int:
    """The teacher's parameters, from its configuration alone (built on the meta device: no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
