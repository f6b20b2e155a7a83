"""The stages of the trainer's step that the planner runs, in the run's order: θ_old's and the reference's
no-grad forwards, the update's forward + backward (again with gradients held when micro-batches accumulate)
and the optimizer step, each on a worst-case micro-batch (every row at the longest prompt + response)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

from rlvr_lightning.planner.trainer_memory import TrainerSetup


def step_stages(policy, reference, optimizer, setup: TrainerSetup) -> list[tuple[str, Callable[[], None]]]:
    from rlvr_lightning.models.forward import policy_forward
    from rlvr_lightning.models.lora import trainable_parameters
    from rlvr_lightning.rollout.types import RolloutTensors

    n, P, T = setup.rows, setup.prompt_tokens, setup.response_tokens
    ones = torch.ones(n, P + T, dtype=torch.long)
    batch = RolloutTensors(
        torch.zeros(n, P + T, dtype=torch.long),
        ones,
        torch.arange(P + T).expand(n, -1),
        torch.ones(n, T),
        torch.zeros(n, T),
        P,
        torch.ones(n, T),  # every response token sampled
    )
    autocast = _autocast(setup)

    def forward(model, grad: bool, capture: bool = False):
        with autocast, torch.set_grad_enabled(grad):
            return policy_forward(
                model,
                batch,
                1.0,
                with_entropy=grad,
                capture_lm_head=capture,
                chunk_tokens=setup.chunk_tokens,
                unpadded=True,
            )

    def forward_backward():
        forward(policy, grad=True, capture=setup.capture_lm_head).logp.sum().backward()

    def optimizer_step():
        torch.nn.utils.clip_grad_norm_(trainable_parameters(policy), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    stages = []
    if setup.separate_old_pass:
        stages.append(("θ_old log-probs (no grad)", lambda: forward(policy, grad=False)))
    if reference is not None:
        stages.append(("reference log-probs (no grad)", lambda: forward(reference, grad=False)))
    stages.append(("update forward + backward", forward_backward))
    if setup.accumulates:  # the next micro-batch's pass, with the first one's gradients held
        stages.append(("update forward + backward, gradients held", forward_backward))
    return [*stages, ("optimizer step", optimizer_step)]


def _autocast(setup: TrainerSetup):
    if setup.fsdp or not setup.precision.endswith("-mixed"):
        return nullcontext()  # FSDP2 casts the gathered parameters itself (MixedPrecisionPolicy)
    dtype = torch.bfloat16 if setup.precision.startswith("bf16") else torch.float16
    return torch.autocast("cpu", dtype=dtype)
