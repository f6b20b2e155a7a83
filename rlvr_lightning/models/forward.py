"""One forward of the policy over a laid-out rollout: the per-token log-probs the losses need, their
entropy, and (when asked) the LM head's inputs that THR scores from. Every trainer-side forward of
a training step goes through `policy_forward`, so the three always come from the same pass."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from rlvr_lightning.losses import entropy_from_logprobs, log_softmax_at
from rlvr_lightning.rollout.types import RolloutTensors


@dataclass(frozen=True)
class PolicyForward:
    logp: torch.Tensor  # [n, T] log π(y_t | ·) of every response token at the sampling temperature, 0 on padding
    entropy: torch.Tensor | None  # [n, T] entropy of π(· | ·) at each response position (no grad)
    lm_head_in: torch.Tensor | None  # [n, T+1, d] detached inputs of the LM head; row t predicts token t


def policy_forward(
    model: torch.nn.Module,
    t: RolloutTensors,
    temperature: float,
    with_entropy: bool = False,
    capture_lm_head: bool = False,
) -> PolicyForward:
    """log_softmax(logits / T) in fp32 gathered at the sampled tokens (grad flows if enabled)."""
    T = t.response_mask.shape[1]
    with lm_head_inputs(model, enabled=capture_lm_head) as grabbed:
        out = model(
            input_ids=t.input_ids, attention_mask=t.attention_mask, position_ids=t.position_ids,
            logits_to_keep=T + 1, use_cache=False,
        )  # fmt: skip
    logp_all = log_softmax_at(out.logits[:, :-1], temperature)  # position P−1+t predicts response token t
    targets = t.input_ids[:, t.prompt_width :]
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1) * t.response_mask
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logprobs(logp_all)
    return PolicyForward(logp, entropy, grabbed[0] if grabbed else None)


def response_hidden(
    lm_head_in: torch.Tensor, rows: list[int], response_mask: torch.Tensor
) -> dict[int, torch.Tensor]:
    """{sequence n: [L_n, d]}: the LM-head inputs of a forward's i-th row that predict its L_n response
    tokens, for each (i, n) in `enumerate(rows)` with n not None."""
    lengths = response_mask.sum(1).long().tolist()
    return {n: lm_head_in[i, : lengths[i]] for i, n in enumerate(rows) if n is not None}


@contextmanager
def lm_head_inputs(model: torch.nn.Module, enabled: bool = True):
    """Collect the inputs of the model's output embedding (the last hidden state after the final
    norm, whatever the architecture calls it) during the forwards run inside the block."""
    grabbed: list[torch.Tensor] = []
    if not enabled:
        yield grabbed
        return
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda mod, args, out: grabbed.append(args[0].detach()))
    try:
        yield grabbed
    finally:
        handle.remove()
