"""A run's plan: each rank's memory by category and stage, whether it fits the device beside the rollout
engine, a step-time estimate, and (when it does not fit) the smallest changes that do, each re-planned."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlvr_lightning.device_defaults import gpu_memory_share
from rlvr_lightning.planner.engine_memory import EngineShare, engine_share, rollout_buffers_bytes
from rlvr_lightning.planner.hardware import GIB
from rlvr_lightning.planner.run_spec import RunSpec
from rlvr_lightning.planner.step_time import StepTime, estimate_step
from rlvr_lightning.planner.teacher_cost import with_teacher_in_trainer
from rlvr_lightning.planner.trainer_measurement import measure_trainer
from rlvr_lightning.planner.trainer_memory import TrainerMemory, TrainerSetup

GPU_RUNTIME_GIB = 1.0  # the CUDA context and NCCL's buffers, outside PyTorch's allocator: an assumption


@dataclass
class Plan:
    spec: RunSpec
    trainer: TrainerMemory
    engine: EngineShare
    buffers_gib: float  # the rollout batch's tensors on the device
    runtime_gib: float  # outside the trainer's and engine's tensors (CUDA context, or the CPU process's libraries)
    step: StepTime
    fixes: list[tuple[str, Plan]] = field(default_factory=list)  # (change, its plan), when this one does not fit

    @property
    def stages(self) -> dict[str, float]:
        """GiB per rank at each stage's peak, everything on the device included."""
        fixed = self.buffers_gib + self.runtime_gib
        out = {s.stage: s.peak_bytes / GIB + fixed + self.engine.asleep_gib for s in self.trainer.stages}
        if self.engine.awake_gib > self.engine.asleep_gib or self.spec.engine == "hf":
            resident = self.trainer.stages[-1].breakdown  # the optimizer step: parameters and optimizer state
            kept = (resident.get("parameters", 0) + resident.get("optimizer_state", 0)) / GIB
            out["generation"] = kept + fixed + self.engine.awake_gib
        return out

    @property
    def warnings(self) -> list[str]:
        """What stops this run before memory does."""
        from rlvr_lightning.data.datamodule import context_length_problem

        spec = self.spec
        problem = context_length_problem(spec.model_config, spec.max_prompt_length, spec.max_response_length, spec.model)
        return [f"{problem} (the run is refused at start)"] if problem else []

    @property
    def peak_stage(self) -> str:
        return max(self.stages, key=self.stages.get)

    @property
    def peak_gib(self) -> float:
        return self.stages[self.peak_stage]

    @property
    def device_gib(self) -> float:
        return self.spec.hardware.memory_gib

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.device_gib

    def breakdown(self) -> dict[str, float]:
        """GiB by category at the peak stage."""
        if self.peak_stage == "generation":
            resident = self.trainer.stages[-1].breakdown
            out = {k: resident.get(k, 0) / GIB for k in ("parameters", "optimizer_state")}
            engine = self.engine.awake_gib
        else:
            stage = next(s for s in self.trainer.stages if s.stage == self.peak_stage)
            out = {k: v / GIB for k, v in stage.breakdown.items()}
            engine = self.engine.asleep_gib
        return {**out, "rollout_buffers": self.buffers_gib, "engine": engine, "runtime": self.runtime_gib}


def engine_parameters(spec: RunSpec, trainer: TrainerMemory) -> int:
    """What the engine holds of the policy: its weights (a LoRA policy's merged ones: the base's size), and with
    an adapter sync the adapter too, in vLLM's buffers padded to `max_lora_rank`."""
    if spec.lora is None:
        return trainer.parameters
    base = trainer.parameters - trainer.trained
    padded = trainer.trained * spec.lora.engine_max_rank // spec.lora.rank
    return base + (padded if spec.lora.sync == "adapter" else 0)


def plan_run(spec: RunSpec, estimate_time: bool = True) -> Plan:
    """The plan of `spec`; without `estimate_time` (a fix being tried) no FLOPs are counted and the step
    time is left empty."""
    trainer = measure_trainer(trainer_setup(spec), with_flops=estimate_time)
    if spec.teacher is not None and not spec.teacher.served:
        trainer = with_teacher_in_trainer(trainer, trainer_setup(spec), spec.teacher, estimate_time)
    held = engine_parameters(spec, trainer)
    engine = engine_share(spec, held)
    runtime = GPU_RUNTIME_GIB if spec.hardware.gpu else process_libraries_gib(spec)
    step = estimate_step(spec, trainer, engine, held) if estimate_time else StepTime({}, [])
    return Plan(spec, trainer, engine, rollout_buffers_bytes(spec) / GIB, runtime, step)


def trainer_setup(spec: RunSpec) -> TrainerSetup:
    return TrainerSetup(
        spec.model_config,
        spec.world_size,
        spec.fsdp,
        spec.fsdp_param_dtype,
        spec.precision,
        spec.activation_checkpointing,
        spec.rows_per_forward,
        spec.max_prompt_length,
        spec.max_response_length,
        spec.chunk_tokens,
        spec.with_reference,
        spec.separate_old_pass,
        spec.thr,
        fused_attention=spec.hardware.gpu,
        accumulates=spec.micro_batches_per_step > 1,
        lora=spec.lora,
        reshard_after_forward=spec.reshard_after_forward,
    )


def process_libraries_gib(spec: RunSpec) -> float:
    """On the CPU: the resident memory of the libraries a training process imports (torch, transformers,
    Lightning, MLflow, and vLLM for its engines), measured in this process after importing them."""
    import importlib.util

    import lightning  # noqa: F401
    import psutil

    if importlib.util.find_spec("mlflow") is not None:  # without it the run logs elsewhere and never imports it
        import mlflow  # noqa: F401
    if spec.engine.startswith("vllm"):
        import vllm  # noqa: F401
    return psutil.Process().memory_info().rss / GIB


def candidate_changes(spec: RunSpec) -> list[tuple[str, dict]]:
    """Changes that lower a rank's peak, smallest first; each is re-planned before it is offered."""
    out = []
    if not spec.activation_checkpointing:
        out.append(("--model.init_args.compute.activation_checkpointing true", {"activation_checkpointing": True}))
    if spec.hardware.gpu and spec.engine.startswith("vllm") and not spec.engine_elsewhere and spec.sleep_level == 0:
        out.append(sleep_mode_change(spec))
    rows = spec.rows_per_forward
    while rows > 1:  # rows of 1 and 2 are measured for every plan: trying these costs nothing
        rows //= 2
        out.append((f"--model.init_args.compute.micro_batch_size {rows}", {"micro_batch_size": rows, "max_tokens_per_micro_batch": None}))
    if spec.chunk_tokens == 0 or spec.chunk_tokens > 256:
        chunk = 1024 if spec.chunk_tokens == 0 else spec.chunk_tokens // 4
        out.append((f"--model.init_args.compute.logprob_chunk_tokens {chunk}", {"chunk_tokens": chunk}))
    if spec.hardware.gpu:
        for factor in (2, 4):
            devices, nodes = (spec.devices * factor, spec.nodes) if spec.devices * factor <= 8 else (spec.devices, spec.nodes * factor)
            out.append(
                (
                    f"--trainer.devices {devices} --trainer.num_nodes {nodes} (FSDP2)",
                    {"devices": devices, "nodes": nodes, "fsdp": True},
                )
            )
    return out


def sleep_mode_change(spec: RunSpec) -> tuple[str, dict]:
    """Sleep mode, and the engine's larger share that it allows (its memory comes back for the update): the
    share `make train` resolves for sleep mode when the share follows the device, else the user's share
    raised to it, named in the change."""
    share = gpu_memory_share(1, engine_elsewhere=False)
    d = spec.device_defaults
    follows = d is not None and "rollout.gpu_memory_utilization" in d.from_device
    raised = max(share, spec.gpu_memory_utilization)
    change = {"sleep_level": 1, "gpu_memory_utilization": raised}
    if follows or raised == spec.gpu_memory_utilization:
        return "--rollout.sleep_level 1", change  # the device default follows the sleep level: nothing more to set
    return f"--rollout.sleep_level 1 --rollout.gpu_memory_utilization {raised:g}", change


REDUCES = {  # what a change can lower, at most: a change that cannot fit even if that fell to 0 is not tried alone
    "activation_checkpointing": ("activations",),
    "sleep_level": ("engine",),
    "micro_batch_size": ("activations", "temporaries"),
    "chunk_tokens": ("temporaries",),
    "devices": ("parameters", "gradients", "optimizer_state", "reference", "communication"),
}


def could_fit(plan: Plan, change: dict) -> bool:
    reducible = sum(plan.breakdown().get(c, 0.0) for c in REDUCES[next(iter(change))])
    return plan.peak_gib - reducible <= plan.device_gib


def plan_with_fixes(spec: RunSpec, limit: int = 3, estimate_time: bool = True) -> Plan:
    """The plan; when it does not fit, up to `limit` single changes that make it fit (each re-planned; of the
    micro-batch sizes, the largest that fits), or, when none does alone, the changes taken in order, each
    kept if it lowers the peak, until the run fits."""
    plan = plan_run(spec, estimate_time)
    if plan.fits:
        return plan
    candidates = candidate_changes(spec)
    seen_micro = False
    for description, change in candidates:
        if (seen_micro and "micro_batch_size" in change) or not could_fit(plan, change):
            continue
        trial = plan_run(spec.changed(**change), estimate_time=False)
        if trial.fits:
            plan.fixes.append((description, trial))
            seen_micro = seen_micro or "micro_batch_size" in change
    if not plan.fixes:
        kept: dict[str, tuple[str, dict]] = {}  # the first key a change sets → the change (a later micro-batch replaces an earlier)
        best = plan
        for description, change in candidates:
            trial_changes = {**kept, next(iter(change)): (description, change)}
            merged = {k: v for _, c in trial_changes.values() for k, v in c.items()}
            trial = plan_run(spec.changed(**merged), estimate_time=False)
            if trial.peak_gib < best.peak_gib:
                kept, best = trial_changes, trial
            if best.fits:
                plan.fixes.append((" ".join(d for d, _ in kept.values()), best))
                break
    plan.fixes = plan.fixes[:limit]
    return plan
