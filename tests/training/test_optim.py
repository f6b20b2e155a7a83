"""`model.optim`: AdamW and its schedule (`training.optim.adamw_with_schedule`)."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr_lightning.algos import GRPO
from rlvr_lightning.training.optim import adamw_with_schedule
from rlvr_lightning.training.settings import OptimSettings
from tests.support.update_harness import attach


def test_fused_adamw_steps_as_the_default_one_to_rounding():
    """`model.optim.fused`: AdamW's fused kernel, the same three steps as PyTorch's default (foreach) to fp32 rounding;
    the default stays unfused (CPU runs keep their bits)."""
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) for p in start] for _ in range(3)]
    params = {}
    for fused in (False, True):
        ps = [torch.nn.Parameter(p.clone()) for p in start]
        opt = adamw_with_schedule(ps, 1e-2, 0.1, 0, "constant", None, fused)["optimizer"]
        assert bool(opt.defaults["fused"]) == fused
        for step in grads:
            for p, grad in zip(ps, step, strict=True):
                p.grad = grad.clone()
            opt.step()
        params[fused] = ps
    for a, b, s in zip(params[False], params[True], start, strict=True):
        assert not torch.equal(a, s)  # the steps moved the parameters
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_weight_decay_warmup_and_cosine_schedule_reach_the_optimizer(tiny_policy_dir):
    module = attach(GRPO, tiny_policy_dir, optim=OptimSettings(lr=1.0, weight_decay=0.1, warmup_steps=2, lr_schedule="cosine"))
    module.trainer.fit_loop.epoch_loop.max_steps = 6  # trainer.max_steps
    config = module.configure_optimizers()
    opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert all(group["weight_decay"] == 0.1 for group in opt.param_groups)
    lrs = []
    for _ in range(6):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    # Linear warm-up over 2 steps, then cosine from 1 to 0 over the remaining 4.
    expected = [0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]
    assert lrs == pytest.approx(expected)
