"""What a plan needs to know about a run, read off exactly the configuration `make train` parses."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

from rlvr_lightning.device_defaults import Accelerator, apply_to_config, config_device_defaults
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.planner.hardware import Hardware
from rlvr_lightning.planner.teacher_cost import TeacherPlan, teacher_plan
from rlvr_lightning.planner.tool_time import ToolPlan, tool_plan


@dataclass(frozen=True)
class RunSpec:
    model: str  # data.model_name_or_path
    model_config: object  # its transformers PretrainedConfig
    hardware: Hardware
    devices: int  # trainer.devices (per node)
    nodes: int  # trainer.num_nodes
    fsdp: bool  # the FSDP2 strategy shards the policy over every rank
    precision: str  # trainer.precision
    fsdp_param_dtype: str
    activation_checkpointing: bool
    micro_batch_size: int
    max_tokens_per_micro_batch: int | None
    chunk_tokens: int  # model.compute.logprob_chunk_tokens
    with_reference: bool  # a KL term against the frozen initial policy, which the run loads
    num_mini_batches: int
    ppo_epochs: int
    separate_old_pass: bool  # θ_old from the trainer's own no-grad pass (behaviour source `trainer`)
    prompts_per_rank: int  # data.batch_size
    group_size: int
    max_prompt_length: int
    max_response_length: int
    engine: str  # rollout.engine
    engine_dtype: str  # rollout.dtype
    gpu_memory_utilization: float
    sleep_level: int
    kv_cache_gib: float  # the CPU engine's KV cache
    engine_elsewhere: bool  # servers on GPUs the trainer does not use (rollout.servers.cuda_devices / urls)
    max_staleness: int  # rollout.stream.max_staleness: versions generated ahead of the update
    thr: bool  # THR attribution reads the LM head's inputs in the update
    oar: bool
    whole_groups: bool = False  # micro-batches hold whole groups (a group-level loss; THR or OAR reading them)
    lora: object | None = None  # models.lora.LoraSettings of a LoRA policy
    partial_rollouts: bool = False  # rollout.stream.partial_rollouts in the reproducible stream: segments, each prefilled again
    # model.compute.packing: micro-batches of real tokens only. The worst case planned has no padding, so a packed
    # forward holds the same tokens as a padded one and the plan is the same (on a GPU attention is planned
    # as a fused kernel either way: varlen packed, flash or memory-efficient padded).
    packing: bool = False
    device_defaults: object | None = None  # device_defaults.DeviceDefaults: what the device chose, for the report
    enforce_eager: bool = False  # rollout.enforce_eager, resolved: vLLM without CUDA graphs
    # The lengths a step time is expected at (plan.mean_prompt_length / mean_response_length); None: the
    # limits. Memory is planned at the limits whatever these are.
    mean_prompt_length: float | None = None
    mean_response_length: float | None = None
    tool: ToolPlan | None = None  # data.tool: its calls' time and its outputs' tokens
    environment: str = ""  # data.environment's class path, if one of the user's (its replies' time is not planned)
    teacher: TeacherPlan | None = None  # model.teacher: on-policy distillation's teacher
    reshard_after_forward: bool = True  # model.compute.reshard_after_forward: FSDP2 frees a layer's gathered weights

    @property
    def world_size(self) -> int:
        return self.devices * self.nodes

    @property
    def sequences_per_rank(self) -> int:
        return self.prompts_per_rank * self.group_size

    @property
    def rows_per_forward(self) -> int:
        """Sequences in the largest forward: a micro-batch at the worst case (every sequence at the longest
        prompt + response), never more than a mini-batch holds. Under a token budget every forward's rows ×
        (its longest prompt + its longest response) stays within the budget (a lone sequence or whole
        group over it excepted), so no forward runs more than one row's tokens beyond this one. Where
        micro-batches hold whole groups the budget packs groups: at least one, however long."""
        per_mini_batch = max(1, self.sequences_per_rank // self.num_mini_batches)
        rows = self.micro_batch_size
        if self.max_tokens_per_micro_batch is not None:
            rows = max(1, self.max_tokens_per_micro_batch // (self.max_prompt_length + self.max_response_length))
            if self.whole_groups:
                rows = max(1, rows // self.group_size) * self.group_size
        return min(rows, per_mini_batch)

    @property
    def expected_prompt_length(self) -> float:
        return self.max_prompt_length if self.mean_prompt_length is None else self.mean_prompt_length

    @property
    def expected_response_length(self) -> float:
        return self.max_response_length if self.mean_response_length is None else self.mean_response_length

    @property
    def micro_batches_per_step(self) -> int:
        return math.ceil(max(1, self.sequences_per_rank // self.num_mini_batches) / self.rows_per_forward)

    def changed(self, **changes) -> RunSpec:
        return dataclasses.replace(self, **changes)


def run_spec(cfg, hardware: Hardware) -> RunSpec:
    """The RunSpec of a parsed `make train` configuration (a jsonargparse Namespace, not instantiated). The
    settings it leaves to the device resolve for `hardware`, as `make train` resolves them on that device."""
    from rlvr_lightning.planner.models import model_config
    from rlvr_lightning.rollout.settings import RolloutSettings
    from rlvr_lightning.training.settings import StepSettings, config_correction_fits

    accelerator = Accelerator("cuda", bf16=True) if hardware.gpu else Accelerator("cpu")  # every listed GPU has bf16
    defaults = config_device_defaults(cfg, accelerator, config_correction_fits(cfg))
    cfg = copy.deepcopy(cfg)  # the caller's configuration stays as it was
    apply_to_config(cfg, defaults)
    settings = StepSettings.of_config(cfg.model)  # light: no module, no weights
    data, trainer = cfg.data, cfg.trainer
    rollout = RolloutSettings(**vars(cfg.rollout))
    shapers = settings.shapers
    step = settings.resolve(rollout, data.batch_size, accelerator)
    strategy = trainer.strategy
    strategy = strategy if isinstance(strategy, str) else getattr(strategy, "class_path", "")
    devices = trainer.devices
    devices = 1 if devices in ("auto", None) else len(devices) if isinstance(devices, list) else int(devices)
    plan = getattr(cfg, "plan", None)
    means = {name: getattr(plan, f"mean_{name}_length", None) for name in ("prompt", "response")}
    for name, cap, flag in (
        ("prompt", data.max_prompt_length, "data.max_prompt_length"),
        ("response", rollout.max_response_length, "rollout.max_response_length"),
    ):
        mean = means[name]
        if mean is not None and not 0 < mean <= cap:
            raise ConfigError(f"plan.mean_{name}_length must be in (0, {flag}={cap}], got {mean:g}")
    return RunSpec(
        model=data.model_name_or_path,
        model_config=model_config(data.model_name_or_path),
        hardware=hardware,
        devices=devices,
        nodes=int(trainer.num_nodes or 1),
        fsdp=strategy.endswith("FSDP2Strategy"),
        precision=str(defaults.values["trainer.precision"]),
        fsdp_param_dtype=settings.fsdp_param_dtype(accelerator),
        activation_checkpointing=settings.compute.activation_checkpointing,
        reshard_after_forward=settings.compute.reshard_after_forward,
        micro_batch_size=step.layout.micro_batch_size,
        max_tokens_per_micro_batch=step.layout.max_tokens_per_micro_batch,
        chunk_tokens=step.layout.logprob_chunk_tokens,
        with_reference=step.needs_reference,
        num_mini_batches=step.layout.num_mini_batches,
        ppo_epochs=step.layout.ppo_epochs,
        separate_old_pass=step.behaviour == "trainer",
        prompts_per_rank=data.batch_size,
        group_size=rollout.group_size,
        max_prompt_length=data.max_prompt_length,
        max_response_length=rollout.max_response_length,
        engine=rollout.engine,
        engine_dtype=rollout.dtype,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        sleep_level=rollout.sleep_level,
        kv_cache_gib=rollout.kv_cache_gib,
        engine_elsewhere=bool(rollout.servers.urls or rollout.servers.cuda_devices),
        max_staleness=rollout.stream.max_staleness,
        # The throughput stream's partial rollouts are requests frozen across a sync (vLLM keeps their KV cache):
        # generation is not cut into segments, so it is planned as one continuous batch.
        partial_rollouts=bool(rollout.stream.partial_rollouts) and rollout.stream.mode == "reproducible",
        thr=shapers.thr is not None,
        oar=shapers.oar is not None,
        whole_groups=step.whole_groups or bool(shapers.names()),
        lora=settings.lora,
        device_defaults=defaults,
        packing=step.layout.packing,
        enforce_eager=bool(rollout.enforce_eager),
        mean_prompt_length=means["prompt"],
        mean_response_length=means["response"],
        tool=tool_plan(data.get("tool"), plan),
        environment=getattr(data.get("environment"), "class_path", "") or "",
        teacher=teacher_plan(getattr(cfg.model.init_args, "teacher", None)),
    )
