"""`make plan`'s update time on a GPU, fitted to the updates `make gpu-check` measured, and checked on an
architecture kept out of the fit.

Each committed GPU run (`bench/results/gpu/**/planner.json` and `throughput.json`: Qwen3-0.6B, Qwen2.5-1.5B and
Qwen3-1.7B, 8,192 and 32,768 tokens a step, with and without activation checkpointing, padded and packed, on an
H100 and an H200) gives one point: the measured step less the planner's AdamW time, against three terms

    counted FLOPs / dense peak  ·  1 / matmul efficiency
    micro-batches × layers × forwards  ·  seconds per layer-forward   (forwards: 2 under activation checkpointing)
    micro-batches × layers             ·  seconds per layer-backward

fitted by non-negative least squares on the relative error, without Qwen3-1.7B. The planner's rounded constants
(`planner/step_time.py`) are then held against every point, the held-out architecture's included. All three
models have 28 layers, so a per-layer cost and a per-micro-batch one cannot be told apart here; per layer is
what scales to the deeper models a user plans.

    .venv/bin/python bench/planner_fit.py     # a second: reads the committed JSON, runs nothing
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

GPU_RESULTS = REPO / "bench" / "results" / "gpu"
HELD_OUT = "Qwen/Qwen3-1.7B"
BOUND = 0.3  # the planned update within ±30% of every measured one


@dataclass(frozen=True)
class MeasuredUpdate:
    source: str  # the JSON file, relative to the repository
    run: str  # its key there
    card: str  # the planner's hardware name
    architecture: str
    flops: float  # the planner's counted FLOPs of the step's micro-batches
    parameters: int
    layers: int
    micro_batches: int
    activation_checkpointing: bool
    measured_s: float


def measured_updates() -> list[MeasuredUpdate]:
    """Every update a committed `make gpu-check` measured on a card the planner lists."""
    from bench.gpu_check.throughput import FULL as A1
    from rlvr_lightning.planner.models import model_config

    points = []
    for path in sorted(GPU_RESULTS.rglob("*.json")):
        if path.name not in ("planner.json", "throughput.json"):
            continue
        result = json.loads(path.read_text())
        if result.get("tiny_shapes") or result.get("device") != "cuda":
            continue
        for run, row in result["runs"].items():
            if "measured" not in row or "hardware" not in row["planned"]:
                continue
            if path.name == "planner.json":
                architecture, checkpointing = run.split()[0], run.endswith(", AC")
                micro_batches = result["shape"]["micro_batches"]
            else:  # prime-rl's A1 setup
                architecture, checkpointing, micro_batches = "Qwen/Qwen3-0.6B", A1.activation_checkpointing, A1.micro_batches
            points.append(MeasuredUpdate(
                str(path.relative_to(REPO)), run, row["planned"]["hardware"], architecture, row["planned"]["update_flops"],
                row["planned"]["parameters"], model_config(architecture).num_hidden_layers, micro_batches, checkpointing,
                row["measured"]["step_s"],
            ))  # fmt: skip
    return points


def planned_seconds(point: MeasuredUpdate) -> float:
    """The planner's time for this update (`planner.step_time`, its own constants)."""
    from rlvr_lightning.planner.hardware import hardware
    from rlvr_lightning.planner.step_time import update_seconds

    return update_seconds(hardware(point.card), point.flops, point.layers, point.micro_batches,
                          point.activation_checkpointing, point.parameters)  # fmt: skip


def fit(points: list[MeasuredUpdate]) -> dict:
    """The three terms' coefficients by non-negative least squares on the relative error."""
    import numpy as np
    from scipy.optimize import nnls

    from rlvr_lightning.planner.hardware import hardware
    from rlvr_lightning.planner.step_time import optimizer_seconds

    rows, targets = [], []
    for p in points:
        hw = hardware(p.card)
        units = p.micro_batches * p.layers
        rows.append([p.flops / (hw.tflops * 1e12), units * (2 if p.activation_checkpointing else 1), units])
        targets.append(p.measured_s - optimizer_seconds(hw, p.parameters))
    a, y = np.array(rows), np.array(targets)
    coefficients, _ = nnls(a / y[:, None], np.ones(len(y)))
    inverse_efficiency, forward_s, backward_s = coefficients
    return {"matmul_efficiency": 1 / inverse_efficiency, "layer_forward_s": forward_s, "layer_backward_s": backward_s}


def main() -> None:
    from common import write

    from rlvr_lightning.planner import step_time

    points = measured_updates()
    fitted = fit([p for p in points if p.architecture != HELD_OUT])
    shipped = {"matmul_efficiency": step_time.GPU_MATMUL_EFFICIENCY, "layer_forward_s": step_time.LAYER_FORWARD_S,
               "layer_backward_s": step_time.LAYER_BACKWARD_S}  # fmt: skip
    rows = []
    for p in points:
        planned = planned_seconds(p)
        rows.append({**asdict(p), "planned_s": round(planned, 4), "ratio": round(planned / p.measured_s, 3),
                     "held_out": p.architecture == HELD_OUT})  # fmt: skip
    ratios = [r["ratio"] for r in rows]
    held = [r["ratio"] for r in rows if r["held_out"]]
    summary = {"points": len(rows), "ratio_min": min(ratios), "ratio_max": max(ratios),
               "held_out": HELD_OUT, "held_out_ratio_min": min(held), "held_out_ratio_max": max(held),
               "within_bound": all(abs(r - 1) <= BOUND for r in ratios), "bound": BOUND}  # fmt: skip
    write("planner_fit", {"fitted": {k: round(v, 5) for k, v in fitted.items()}, "shipped": shipped,
                          "summary": summary, "updates": rows})  # fmt: skip


if __name__ == "__main__":
    main()
