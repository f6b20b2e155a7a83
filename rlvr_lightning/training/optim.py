"""AdamW with linear warm-up, then a constant or cosine learning rate, stepped per optimizer step."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def adamw(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float = 0.0, fused: bool = False):
    """AdamW, with its fused kernel (one launch for every parameter) or PyTorch's default. `fused=False` is not
    passed on: PyTorch picks foreach only when neither `fused` nor `foreach` is given, and an explicit False gives
    its per-parameter loop."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **({"fused": True} if fused else {}))


def adamw_with_schedule(
    params: Iterable[torch.nn.Parameter],
    lr: float,
    weight_decay: float,
    warmup_steps: int,
    schedule: str,
    total_steps: int | None,
    fused: bool = False,
) -> dict:
    """Lightning's `configure_optimizers` answer; `cosine` decays to 0 at `total_steps` (if known); `fused`: as `adamw`."""
    opt = adamw(params, lr, weight_decay, fused)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "cosine" and total_steps:
            progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
            return 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
