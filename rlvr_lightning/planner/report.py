"""The plan as a table for people and as JSON for tools."""

from __future__ import annotations

import json
from pathlib import Path

from rlvr_lightning.planner.planner import Plan


def as_dict(plan: Plan) -> dict:
    spec, hw = plan.spec, plan.spec.hardware
    return {
        "model": spec.model,
        "parameters": plan.trainer.parameters,
        "hardware": hw.name,
        "devices": spec.devices,
        "nodes": spec.nodes,
        "fsdp": spec.fsdp,
        "peak_gib_per_rank": round(plan.peak_gib, 3),
        "peak_stage": plan.peak_stage,
        "device_gib": round(plan.device_gib, 3),
        "fits": plan.fits,
        "breakdown": {k: round(v, 3) for k, v in plan.breakdown().items()},
        "stages_gib": {k: round(v, 3) for k, v in plan.stages.items()},
        "engine": {
            "awake_gib": round(plan.engine.awake_gib, 3),
            "asleep_gib": round(plan.engine.asleep_gib, 3),
            "weights_gib": round(plan.engine.weights_gib, 3),
            "kv_cache_gib": round(plan.engine.kv_cache_gib, 3),
            "kv_tokens": plan.engine.kv_tokens,
            "note": plan.engine.note,
        },
        "step_s_estimate": round(plan.step.total, 2),  # the expected step (kept for earlier readers)
        "step_s_expected": round(plan.step.total, 3),
        "step_s_worst": round(plan.step.worst_total, 3),
        "step_s_by_stage": {k: round(v, 3) for k, v in plan.step.stages.items()},
        "step_s_by_stage_worst": {k: round(v, 3) for k, v in plan.step.worst_stages.items()},
        "expected_lengths": {"prompt": spec.expected_prompt_length, "response": spec.expected_response_length},
        "generation": _generation(plan.step),
        "weight_sync": (
            {"transport": plan.step.sync.transport, **{k: round(v, 3) for k, v in plan.step.sync.parts.items()}}
            if plan.step.sync
            else None
        ),
        "assumptions": plan.step.assumptions,
        "step_notes": plan.step.notes,
        "layout": {
            "sequences_per_rank": spec.sequences_per_rank,
            "rows_per_forward": spec.rows_per_forward,
            "tokens_per_row": spec.max_prompt_length + spec.max_response_length,
            "packed": spec.packing,
        },
        "device_defaults": _device_defaults(spec),
        "fixes": [{"change": change, "peak_gib_per_rank": round(p.peak_gib, 3)} for change, p in plan.fixes],
        "warnings": plan.warnings,
    }


def as_text(plan: Plan) -> str:
    spec, hw = plan.spec, plan.spec.hardware
    lines = [
        f"Plan: {spec.model} ({_count(plan.trainer.parameters)} parameters) on {spec.nodes} × {spec.devices} {hw.name}"
        f" ({plan.device_gib:.1f} GiB each){', FSDP2' if spec.fsdp else ''}",
        f"  per rank: {spec.prompts_per_rank} prompts × {spec.group_size} samples = {spec.sequences_per_rank} sequences of up to "
        f"{spec.max_prompt_length} + {spec.max_response_length} tokens; forwards of {spec.rows_per_forward} rows"
        f" ({'packed: real tokens only' if spec.packing else 'padded'})",
        "",
        *_device_defaults_block(spec),
        "  memory per rank at each stage's peak (GiB):",
    ]
    lines += [f"    {name:<32} {gib:8.2f}" + ("   ← peak" if name == plan.peak_stage else "") for name, gib in plan.stages.items()]
    lines += ["", f"  at the peak ({plan.peak_stage}):"]
    lines += [f"    {name:<32} {gib:8.2f}" for name, gib in plan.breakdown().items() if gib >= 0.005]
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines += ["", f"  peak {plan.peak_gib:.2f} GiB of {plan.device_gib:.1f} GiB: {verdict}", f"  engine: {plan.engine.note}"]
    if plan.engine.kv_tokens:
        lines.append(f"  engine KV cache: {plan.engine.kv_cache_gib:.2f} GiB = {plan.engine.kv_tokens:,} tokens")
    lines += ["", *step_block(plan)]
    lines += [f"  warning: {w}" for w in plan.warnings]
    if not plan.fits:
        lines.append("")
        if plan.fixes:
            lines.append("  changes that fit (each re-planned):")
            lines += [f"    {change}   → peak {p.peak_gib:.2f} GiB" for change, p in plan.fixes]
        else:
            lines.append("  no single change tried fits: more devices, a shorter response or a smaller model")
    return "\n".join(lines)


def step_block(plan: Plan) -> list[str]:
    """The step time, expected and worst case, by stage, with the generation's split and the assumptions."""
    step = plan.step
    if not step.stages:
        return []
    lines = [
        f"  step time, estimated: {step.total:.1f} s per rollout batch expected, {step.worst_total:.1f} s "
        "at the worst case (every response at the limit)",
        f"    {'':<32} {'expected':>9}   {'worst':>9}",
    ]
    lines += [f"    {name:<32} {s:8.2f} s  {step.worst_stages.get(name, s):8.2f} s" for name, s in step.stages.items()]
    for label, g in (("expected", step.generation), ("worst", step.worst_generation)):
        if g is not None:
            lines.append(
                f"    generation, {label}: prefill {g.prefill_s:.1f} s + decode {g.decode_s:.1f} s + per-step overhead "
                f"{g.overhead_s:.1f} s{f' + tool calls {g.tool_s:.1f} s' if g.tool_s else ''}; {g.decode_steps:,} decode steps, {g.mean_in_flight:.0f} sequences in flight "
                f"(peak {g.peak_in_flight}), {g.preemptions} preemptions, tail {g.tail_s:.1f} s ({g.tail_steps:,} "
                f"{g.tail_rule})"
            )
    lines += [f"    ({a})" for a in step.assumptions]
    lines += [f"  note: {n}" for n in step.notes]
    return lines


def _generation(step) -> dict | None:
    if step.generation is None:
        return None
    return {"expected": step.generation.as_dict(), "worst": step.worst_generation.as_dict()}


def _device_defaults(spec) -> dict:
    """{setting: {value, from}} of the settings that follow the device, as planned."""
    d = spec.device_defaults
    return {} if d is None else {k: {"value": d.values[k], "from": d.source(k)} for k in d.keys}


def _device_defaults_block(spec) -> list[str]:
    d = spec.device_defaults
    return [] if d is None else [*("  " + line for line in d.block().splitlines()), ""]


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def write_json(plan: Plan, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(as_dict(plan), indent=2) + "\n")
