"""What a merged LoRA sync loses to a 16-bit engine: the engine holds bf16(W + scale·B·A), the trainer computes
bf16(W)·x + scale·B·A·x. For adapter updates of a given RMS on N(0, 0.02) base weights (a 1024 × 1024 projection,
rank 16), the share of merged entries that keep their bf16 base value, and the engine–trainer output gap relative to
the update's own effect (above 1: the engine is further from the trainer's policy than from the base model).
The merge is the library's (`models.weights.full_weights`). Seconds on CPU.

    .venv/bin/python bench/merged_precision.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write  # noqa: E402

from rlvr_lightning.models.lora import LoraSettings, apply_lora  # noqa: E402
from rlvr_lightning.models.weights import full_weights  # noqa: E402

DIM, RANK, DTYPES, UPDATE_RMS = 1024, 16, ("bfloat16", "float16"), (1e-6, 1e-5, 1e-4, 1e-3)


class Projection(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(DIM, DIM, bias=False)


def main() -> None:
    torch.manual_seed(0)
    model = Projection()
    torch.nn.init.normal_(model.q_proj.weight, std=0.02)
    apply_lora(model, LoraSettings(rank=RANK, alpha=2 * RANK, target_modules=("q_proj",)))
    layer, x = model.q_proj, torch.randn(256, DIM)
    rows = {}
    for rms in UPDATE_RMS:
        with torch.no_grad():
            layer.lora_B["default"].weight.normal_()
            delta = layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
            layer.lora_B["default"].weight.mul_(rms / delta.pow(2).mean().sqrt())
            delta = x @ (layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight).T
        merged = dict(full_weights(model))["q_proj.weight"]
        base = layer.base_layer.weight
        for dtype in DTYPES:
            dt = getattr(torch, dtype)
            engine = x @ merged.to(dt).float().T
            trainer = x @ base.to(dt).float().T + delta
            rows.setdefault(dtype, {})[f"{rms:g}"] = {
                "entries_keeping_base_value": float((merged.to(dt) == base.to(dt)).float().mean()),
                "gap_over_update": float((engine - trainer).pow(2).mean().sqrt() / delta.pow(2).mean().sqrt()),
            }
    write("merged_precision", {"base_std": 0.02, "shape": [DIM, DIM], "rank": RANK, "by_update_rms": rows})


if __name__ == "__main__":
    main()
