"""What the planner measures the trainer's step on (`TrainerSetup`, read off the run's configuration) and what
it reads back per rank (`TrainerMemory`: a `StagePeak` for each stage of the step). How the step is measured:
`trainer_measurement.py`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerSetup:
    """What the trainer's step holds in memory, read off the run's configuration."""

    model_config: object  # transformers' PretrainedConfig
    world_size: int  # ranks that shard the policy (1 without FSDP2)
    fsdp: bool
    fsdp_param_dtype: str  # compute dtype under FSDP2 (master weights stay fp32)
    precision: str  # trainer.precision (without FSDP2: 32-true, bf16-mixed, bf16-true, 16-mixed)
    activation_checkpointing: bool
    rows: int  # sequences in the largest forward
    prompt_tokens: int
    response_tokens: int
    chunk_tokens: int  # model.compute.logprob_chunk_tokens
    with_reference: bool  # a KL term against the frozen initial policy: a copy of it
    separate_old_pass: bool  # θ_old from a no-grad forward before the update
    capture_lm_head: bool  # THR reads the LM head's inputs in the update's forward
    fused_attention: bool = False  # plan attention as a GPU's fused kernel (see trainer_measurement.py)
    accumulates: bool = False  # several micro-batches per optimizer step: later ones run with gradients held
    lora: object | None = None  # models.lora.LoraSettings: adapters train, the base is frozen and is the reference
    reshard_after_forward: bool = True  # model.compute.reshard_after_forward (FSDP2)


@dataclass(frozen=True)
class StagePeak:
    stage: str
    peak_bytes: int
    breakdown: dict[str, int]  # plan category → bytes at this stage's peak
    flops: int  # of this stage on this rank, as PyTorch's FlopCounterMode counts the ops that ran


@dataclass(frozen=True)
class TrainerMemory:
    stages: list[StagePeak]
    parameters: int  # the policy's parameter count
    trained: int = 0  # of which a LoRA policy's adapter (0: every parameter trains)
    teacher_parameters: int = 0  # on-policy distillation's teacher in the trainer (`planner.teacher_cost`)

    @property
    def peak(self) -> StagePeak:
        return max(self.stages, key=lambda s: s.peak_bytes)
