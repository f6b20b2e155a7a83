"""`model.optim`: AdamW and its schedule (`training.optim.adamw_with_schedule`)."""

from __future__ import annotations

import torch

from rlvr_lightning.training.optim import adamw_with_schedule


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
