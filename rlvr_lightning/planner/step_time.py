"""A step-time estimate per stage, from counted FLOPs and bytes against the hardware's published peaks, at
the lengths the user expects (`plan.mean_prompt_length`, `plan.mean_response_length`) and at the worst
case (every sequence at its limits, what the memory plan takes).

An estimate, not a measurement: the trainer's FLOPs are those PyTorch's `FlopCounterMode` counts in the
planner's own run of one micro-batch at the limits (attention, the chunked LM head's recomputation and
activation checkpointing included), scaled to the expected tokens of a micro-batch (packed: the mean
lengths; padded: the mean prompt and the expected longest response of its rows), divided by the
device's dense peak times the matmuls' efficiency, plus on a GPU a cost per decoder layer and micro-batch for each
forward and backward (`trainer_pass_seconds`: fitted to measured updates by bench/planner_fit.py); FSDP's all-gathers and reduce-scatters are bytes over the
intra-node link, overlapped with compute (the larger of the two counts). Generation is simulated as the
engine schedules it (`planner/generation.py`); the weight sync as the engines do it
(`planner/weight_sync.py`). With `rollout.stream.max_staleness` ≥ 1 generation runs beside the update; with partial
rollouts a step generates one segment of each of s batches in flight, which in the steady state is one batch's
sequences cut at the segment caps ⌈L·i/s⌉ (`partial_segments`), each piece after its prompt and the tokens
before it (vLLM's prefix cache is reset at every weight sync, so those are prefilled again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from rlvr_lightning.planner.engine_memory import EngineShare, dtype_bytes, vllm_batch_limits
from rlvr_lightning.planner.generation import DecodeCosts, Generation, continuous_batching, padded_batch
from rlvr_lightning.planner.lengths import LengthSpread, expected_longest, response_lengths, submission_order
from rlvr_lightning.planner.run_spec import RunSpec
from rlvr_lightning.planner.teacher_cost import STAGE as TEACHER_STAGE
from rlvr_lightning.planner.teacher_cost import parameter_count, served_teacher_seconds
from rlvr_lightning.planner.trainer_memory import TrainerMemory
from rlvr_lightning.planner.weight_sync import WeightSync, weight_sync

CPU_TRAINER_EFFICIENCY = 0.4  # share of the measured fp32 matmul rate the CPU trainer's FLOPs run at
# A GPU update: its counted FLOPs at GPU_MATMUL_EFFICIENCY of the dense bf16 peak, plus what does not scale with FLOPs
# (kernel launches, FSDP2's per-layer hooks, normalisations, activations, the LM head's vocabulary-wide softmax) as a
# cost per decoder layer and micro-batch: one for each forward (activation checkpointing runs it twice) and one for
# the backward. Fitted by bench/planner_fit.py to the updates `make gpu-check` measured on an H100 and an H200
# (Qwen3-0.6B and Qwen2.5-1.5B at 8k and 32k tokens a step; Qwen3-1.7B kept out of the fit to check it): the
# small models' update runs at 0.08-0.31 of the peak, the overheads being half of it or more.
GPU_MATMUL_EFFICIENCY = 0.69
LAYER_FORWARD_S = 3.3e-3
LAYER_BACKWARD_S = 5.2e-3
PREFILL_EFFICIENCY = 0.5
DECODE_EFFICIENCY = 0.7  # share of peak memory bandwidth a decode step sustains


# vLLM's per-decode-step overhead beyond the bytes and FLOPs (scheduling, sampling, detokenising, kernel
# launches): roughly 10–20 ms eager (`rollout.enforce_eager`) and 1–5 ms with CUDA graphs, as vLLM's users
# report it (rlvr_lightning/device_defaults.py); the central values are assumptions, to calibrate on a GPU.
# The HF engine's `generate` and vLLM on the CPU run eager.
STEP_OVERHEAD_EAGER_S = 0.015
STEP_OVERHEAD_GRAPHS_S = 0.003


@dataclass(frozen=True)
class StepTime:
    stages: dict[str, float]  # seconds per rollout batch, by stage, at the expected lengths
    assumptions: list[str]
    worst_stages: dict[str, float] = field(default_factory=dict)  # every sequence at its limits
    generation: Generation | None = None  # at the expected lengths
    worst_generation: Generation | None = None
    sync: WeightSync | None = None
    overlapped: bool = False  # rollout.stream.max_staleness ≥ 1: generation overlaps the update
    notes: list[str] = field(default_factory=list)  # what the user should know (generation dominates, …)

    @property
    def total(self) -> float:
        """The expected step."""
        return step_seconds(self.stages, self.overlapped)

    @property
    def worst_total(self) -> float:
        return step_seconds(self.worst_stages or self.stages, self.overlapped)


def step_seconds(stages: dict[str, float], overlapped: bool) -> float:
    """The stages in sequence; with `overlapped` generation runs beside the update: the longer of the two,
    plus the weight sync, which neither hides."""
    if not overlapped:
        return sum(stages.values())
    generation, sync = stages.get("generation", 0.0), stages.get("weight sync", 0.0)
    return max(generation, sum(stages.values()) - generation - sync) + sync


def estimate_step(spec: RunSpec, trainer: TrainerMemory, engine: EngineShare, engine_parameters: int | None = None) -> StepTime:
    hw = spec.hardware
    engine_parameters = engine_parameters or trainer.parameters
    N, P, T = spec.sequences_per_rank, spec.max_prompt_length, spec.max_response_length
    spread = response_lengths(spec.expected_response_length, T, N)
    worst = response_lengths(T, T, N)
    segments = spec.max_staleness if spec.partial_rollouts else 1
    expected_gen = segmented_generation(spec, engine_parameters, engine, spec.expected_prompt_length, spread, segments)
    worst_gen = segmented_generation(spec, engine_parameters, engine, P, worst, segments, worst=True)
    longest = spread.mean if spec.packing else expected_longest(spread.lengths, spec.rows_per_forward)
    token_share = (spec.expected_prompt_length + longest) / (P + T)
    nbytes = dtype_bytes(spec.engine_dtype, spec.model_config)
    adapter_only = spec.lora is not None and spec.lora.sync == "adapter"
    sent = trainer.trained if adapter_only else trainer.parameters - trainer.trained
    sync = weight_sync(spec, sent * nbytes, engine_parameters * nbytes)
    stages = {"generation": expected_gen.seconds, **trainer_stages(spec, trainer, token_share)}
    worst_stages = {"generation": worst_gen.seconds, **trainer_stages(spec, trainer, 1.0)}
    if spec.engine != "hf":
        stages["weight sync"] = worst_stages["weight sync"] = sync.seconds
    flop_share = "packed: the mean lengths" if spec.packing else f"padded: the expected longest response of {spec.rows_per_forward} rows"
    assumptions = [
        f"lengths: prompts of {spec.expected_prompt_length:g} tokens; {spread.describe()}",
        f"trainer: {trainer_rate(hw)}; FLOPs counted by PyTorch on one micro-batch at the limits × "
        f"{expected_micro_batches(spec, 1.0)} micro-batches, × {token_share:.2f} for the expected tokens ({flop_share}); "
        f"{expected_micro_batches(spec, token_share)} micro-batches per pass expected, each gathering the weights",
        f"generation: {expected_gen.model}; decode at {DECODE_EFFICIENCY:.0%} of {hw.memory_tb_s:.3g} TB/s (the weights "
        f"once, the KV of every live token), compute at {PREFILL_EFFICIENCY:.0%} of peak, "
        f"{step_overhead(spec) * 1e3:.0f} ms per decode step ({overhead_source(spec)})",
        sync.describe(),
    ]
    if spec.tool is not None:
        assumptions.append(spec.tool.describe(T))
    if spec.teacher is not None:
        assumptions.append(teacher_cost(spec, trainer, stages, worst_stages))
    if spec.engine_elsewhere:
        assumptions.append("vLLM servers: each rank's sequences as on one engine of its own (the KV cache of one server's share)")
    if spec.fsdp and spec.world_size > 1:
        between = f" (between nodes: {hw.network_gb_s:.3g} GB/s)" if spec.nodes > 1 else ""
        assumptions.append(f"FSDP collectives over {collective_gb_s(spec):.3g} GB/s per device{between}, overlapped with compute")
    notes = overlap_notes(spec, stages, lambda s: segmented_generation(
        spec, engine_parameters, engine, spec.expected_prompt_length, spread, s).seconds)
    if spec.environment:
        notes.append(f"data.environment {spec.environment}: the time its replies take is not in the plan")
    if spec.engine != "hf" and P + T > engine.kv_tokens:
        notes.append(
            f"the KV cache ({engine.kv_tokens:,} tokens) holds less than one sequence at the limits "
            f"({P + T:,}): vLLM refuses to start; generation is priced as if it held one"
        )
    return StepTime(stages, assumptions, worst_stages, expected_gen, worst_gen, sync, spec.max_staleness > 0, notes)


def teacher_cost(spec: RunSpec, trainer: TrainerMemory, stages: dict[str, float], worst_stages: dict[str, float]) -> str:
    """The teacher's line of the assumptions; a served teacher's prefill added to `stages` (the expected lengths) and
    `worst_stages` (the limits)."""
    teacher = spec.teacher
    if not teacher.served:
        return (f"teacher {teacher.name} ({trainer.teacher_parameters / 1e9:.3g}B parameters) in the trainer: its fp32 "
                f"weights held through the step{' (its shard)' if spec.fsdp else ''} and a no-grad forward, measured "
                "as the policy's")  # fmt: skip
    parameters = parameter_count(teacher.config)
    flop_s = spec.hardware.tflops * 1e12 * PREFILL_EFFICIENCY
    N = spec.sequences_per_rank
    expected = N * (spec.expected_prompt_length + spec.expected_response_length)
    stages["teacher (vllm serve)"] = served_teacher_seconds(teacher, parameters, expected, flop_s)
    worst_stages["teacher (vllm serve)"] = served_teacher_seconds(teacher, parameters, N * (spec.max_prompt_length + spec.max_response_length), flop_s)
    where = "attached replicas" if teacher.attached else f"{teacher.replicas} vllm serve replica(s) per rank"
    return (f"teacher {teacher.name} ({parameters / 1e9:.3g}B parameters) on {where}: a prefill of every sequence at "
            f"{PREFILL_EFFICIENCY:.0%} of peak, its weights and KV cache on the replicas' devices, not in this plan")  # fmt: skip


def trainer_stages(spec: RunSpec, trainer: TrainerMemory, token_share: float) -> dict[str, float]:
    """Seconds per trainer stage: its counted FLOPs × `token_share` (the expected tokens' share of the limits') and
    its micro-batches' per-layer costs, or its micro-batches' FSDP collectives where they take longer (each
    micro-batch gathers the weights anew)."""
    hw = spec.hardware
    at_limits = expected_micro_batches(spec, 1.0)
    micro_batches = expected_micro_batches(spec, token_share)
    W = spec.world_size if spec.fsdp else 1
    per_parameter = (2 if spec.fsdp_param_dtype == "bfloat16" else 4) * (W - 1) / W if spec.fsdp else 0
    link = collective_gb_s(spec) * 1e9
    stages: dict[str, float] = {}
    for s in trainer.stages:
        if s.stage == "optimizer step":
            shard = (trainer.trained or trainer.parameters) / W  # a LoRA policy's optimizer steps its adapter
            stages[s.stage] = spec.num_mini_batches * spec.ppo_epochs * optimizer_seconds(hw, shard)
            continue
        update = s.stage.startswith("update")
        passes = spec.ppo_epochs if update else 1
        teacher = s.stage == TEACHER_STAGE
        gathered = per_parameter * (trainer.teacher_parameters if teacher else trainer.parameters)
        # forward and backward gathers (one, with the weights kept from the forward) and the reduce-scatter
        comm = gathered * ((3 if spec.reshard_after_forward else 2) if update else 1) / link
        layers = (spec.teacher.config if teacher else spec.model_config).num_hidden_layers
        forwards = 2 if update and spec.activation_checkpointing else 1
        # the pass's FLOPs at the expected tokens, and its micro-batches' per-layer costs
        compute = trainer_pass_seconds(hw, at_limits * s.flops * token_share, layers, micro_batches, forwards, update)
        name = "update forward + backward" if update else s.stage
        stages[name] = passes * micro_batches * max(compute / micro_batches, comm)
    return stages


def trainer_pass_seconds(hw, flops: float, layers: int, micro_batches: float, forwards: int = 1, backward: bool = True) -> float:
    """A trainer pass over `micro_batches` on `hw` with these counted FLOPs: on a GPU, the FLOPs at the matmuls'
    efficiency plus each micro-batch's per-layer cost of `forwards` forwards (2: activation checkpointing's
    recomputation) and of the `backward`; on the CPU, the FLOPs at CPU_TRAINER_EFFICIENCY of the measured rate."""
    if not hw.gpu:
        return flops / (hw.tflops * 1e12 * CPU_TRAINER_EFFICIENCY)
    per_layer = forwards * LAYER_FORWARD_S + (LAYER_BACKWARD_S if backward else 0.0)
    return flops / (hw.tflops * 1e12 * GPU_MATMUL_EFFICIENCY) + micro_batches * layers * per_layer


def update_seconds(hw, flops: float, layers: int, micro_batches: int, activation_checkpointing: bool, parameters: int) -> float:
    """One optimizer step's update on one device: its micro-batches' forward + backward (`flops` counted over all of
    them, the forward twice under activation checkpointing) and AdamW's step over `parameters`."""
    forwards = 2 if activation_checkpointing else 1
    return trainer_pass_seconds(hw, flops, layers, micro_batches, forwards) + optimizer_seconds(hw, parameters)


def optimizer_seconds(hw, parameters: float) -> float:
    """AdamW's step over `parameters`: it reads and writes their fp32 values, gradients and two moments (~7 × 4 bytes
    each) at DECODE_EFFICIENCY of the memory bandwidth."""
    return parameters * 28 / (hw.memory_tb_s * 1e12 * DECODE_EFFICIENCY)


def trainer_rate(hw) -> str:
    """The trainer's time model in words, for the plan's assumptions."""
    if not hw.gpu:
        return f"{CPU_TRAINER_EFFICIENCY:.0%} of {hw.tflops:.3g} TFLOP/s"
    return (f"matmuls at {GPU_MATMUL_EFFICIENCY:.0%} of {hw.tflops:.3g} TFLOP/s, + {LAYER_FORWARD_S * 1e3:.1f} ms per "
            f"layer and micro-batch for each forward, {LAYER_BACKWARD_S * 1e3:.1f} ms for the backward")  # fmt: skip


def expected_micro_batches(spec: RunSpec, token_share: float) -> int:
    """Micro-batches per pass at the expected lengths: packed under a token budget they hold the expected real
    tokens, so fewer than at the limits; otherwise (rows, or padded to the longest) as many."""
    at_limits = math.ceil(spec.sequences_per_rank / spec.rows_per_forward)
    if not spec.packing or spec.max_tokens_per_micro_batch is None or token_share >= 1:
        return at_limits
    per_mini_batch = max(1, spec.sequences_per_rank // spec.num_mini_batches)
    tokens = per_mini_batch * (spec.max_prompt_length + spec.max_response_length) * token_share
    return min(at_limits, spec.num_mini_batches * math.ceil(tokens / spec.max_tokens_per_micro_batch))


def collective_gb_s(spec: RunSpec) -> float:
    """FSDP's all-gathers and reduce-scatters run at the slowest link of the ring: between nodes where there
    are several."""
    hw = spec.hardware
    return hw.link_gb_s if spec.nodes == 1 else min(hw.link_gb_s, hw.network_gb_s)


def step_overhead(spec: RunSpec) -> float:
    graphs = spec.hardware.gpu and spec.engine != "hf" and not spec.enforce_eager
    return STEP_OVERHEAD_GRAPHS_S if graphs else STEP_OVERHEAD_EAGER_S


def overhead_source(spec: RunSpec) -> str:
    if spec.engine == "hf":
        return "HF generate, eager"
    if not spec.hardware.gpu:
        return "vLLM on CPU, eager"
    return "enforce_eager: no CUDA graphs" if spec.enforce_eager else "CUDA graphs"


def streamed_parameters(spec: RunSpec, parameters: int) -> int:
    """The parameters a decode step reads: all but the input embedding, whose rows are gathered (an LM head
    tied to it is still read whole for the logits)."""
    cfg = spec.model_config
    if getattr(cfg, "tie_word_embeddings", False):
        return parameters
    return parameters - cfg.vocab_size * cfg.hidden_size


def generation(spec: RunSpec, parameters: int, engine: EngineShare, prompt: int, spread: LengthSpread) -> Generation:
    """One engine's rollout of the rank's sequences, with these response lengths, after `prompt`-token prompts."""
    hw = spec.hardware
    streamed = streamed_parameters(spec, parameters)
    costs = DecodeCosts(
        weight_bytes=streamed * dtype_bytes(spec.engine_dtype, spec.model_config),
        kv_bytes_per_token=engine.kv_bytes_per_token,
        bandwidth=hw.memory_tb_s * 1e12 * DECODE_EFFICIENCY,
        flops_per_token=2 * streamed,
        flop_s=hw.tflops * 1e12 * PREFILL_EFFICIENCY,
        step_overhead_s=step_overhead(spec),
    )
    lengths = [max(1, round(spread.lengths[i])) for i in submission_order(len(spread.lengths))]
    if spec.engine == "hf":
        return padded_batch(prompt, lengths, costs)
    kv_tokens = max(engine.kv_tokens, spec.max_prompt_length + spec.max_response_length)
    return continuous_batching(prompt, lengths, kv_tokens, vllm_batch_limits(hw)[0], costs)


def partial_segments(spread: LengthSpread, segments: int) -> tuple[LengthSpread, float]:
    """One batch's responses cut at the caps ⌈L·(i+1)/segments⌉ into the pieces the segments generate (a
    response that stops before a cap has none after it), ascending, and the mean of the tokens before each
    piece (generated by earlier segments, prefilled again)."""
    caps = [math.ceil(spread.cap * (i + 1) / segments) for i in range(segments)]
    pieces: list[tuple[float, int]] = []
    for length in spread.lengths:
        start = 0
        for cap in caps:
            if length <= start:
                break
            pieces.append((min(length, cap) - start, start))
            start = cap
    pieces.sort()
    return replace(spread, lengths=tuple(p for p, _ in pieces), cap=caps[0]), sum(b for _, b in pieces) / len(pieces)


def segmented_generation(
    spec: RunSpec, parameters: int, engine: EngineShare, prompt: float, spread: LengthSpread, segments: int, worst: bool = False
) -> Generation:
    """A step's generation: the rank's sequences whole (segments = 1) or as partial rollouts' pieces, with the
    Python tool's calls, expected or at the `worst` (a step's calls are one batch's either way: `planner.tool_time`)."""
    if segments <= 1:
        decoded = generation(spec, parameters, engine, round(prompt), spread)
    else:
        pieces, before = partial_segments(spread, segments)
        decoded = generation(spec, parameters, engine, round(prompt + before), pieces)
    if spec.tool is None:
        return decoded
    return replace(decoded, tool_s=spec.tool.seconds(spec.sequences_per_rank, worst))


def overlap_notes(spec: RunSpec, stages: dict[str, float], generation_at=None) -> list[str]:
    """Where generation outlasts the update; what `rollout.stream.max_staleness` hides (or hides already), and with
    partial rollouts, the staleness that would hide it (`generation_at(s)`: a step's generation at s segments)."""
    generation_s, sync = stages["generation"], stages.get("weight sync", 0.0)
    update = sum(stages.values()) - generation_s - sync
    overlapped = max(generation_s, update) + sync
    notes = []
    if spec.max_staleness:
        how = f" with partial rollouts in {spec.max_staleness} segments" if spec.partial_rollouts else ""
        notes.append(
            f"rollout.stream.max_staleness {spec.max_staleness}{how}: generation ({generation_s:.1f} s) runs beside "
            f"the update ({update:.1f} s): the step is the longer plus the weight sync, {overlapped:.1f} s"
        )
    elif generation_s > update:
        notes.append(
            f"generation ({generation_s:.1f} s) outlasts the update ({update:.1f} s): --rollout.stream.max_staleness 1 "
            f"would run the next rollout beside the update (one step off-policy), a step of ≈ {overlapped:.1f} s "
            f"instead of {sum(stages.values()):.1f} s"
        )
    if generation_s > update and generation_at is not None and spec.engine != "hf":
        hidden = next((s for s in range(max(2, spec.max_staleness + 1), 9) if generation_at(s) <= update), None)
        if hidden is not None:
            notes.append(
                f"partial rollouts at --rollout.stream.max_staleness {hidden} --rollout.stream.partial_rollouts true would cut "
                f"each step's generation to {generation_at(hidden):.1f} s, hidden by the update"
            )
        elif not spec.partial_rollouts or spec.max_staleness < 8:
            notes.append(
                f"even partial rollouts at max_staleness 8 leave generation ({generation_at(8):.1f} s) longer "
                "than the update: the rollout side needs more engines"
            )
    return notes
