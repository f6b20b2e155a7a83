"""One forward of the policy over a laid-out rollout: the per-token log-probs the losses need, their
entropy, and (when asked) the LM head's inputs that THR scores from. Every trainer-side forward of
a training step goes through `policy_forward`, so the three always come from the same pass."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from rlvr_lightning.models.lm_head import (
    chunked_token_logprobs,
    head_transform,
    supports_chunked_head,
    untransformed_head_output,
)
from rlvr_lightning.rollout.types import RolloutTensors
from rlvr_lightning.tensor_math import entropy_from_logprobs, log_softmax_at


@dataclass(frozen=True)
class PolicyForward:
    logp: torch.Tensor  # [n, T] log π(y_t | ·) of every response token at the sampling temperature, 0 on padding
    entropy: torch.Tensor | None  # [n, T] entropy of π(· | ·) at each response position (no grad)
    lm_head_in: torch.Tensor | None  # [n, T+1, d] detached inputs of the LM head; row t predicts token t
    tensors: RolloutTensors  # the laid-out inputs it ran on (T is their response width)


def policy_forward(
    model: torch.nn.Module,
    t: RolloutTensors,
    temperature: float,
    with_entropy: bool = False,
    capture_lm_head: bool = False,
    chunk_tokens: int = 0,
    unpadded: bool = False,
) -> PolicyForward:
    """log_softmax(logits / T) in fp32 gathered at the sampled tokens (grad flows if enabled).

    `unpadded`: the caller vouches that every response position is a real token (one unpadded
    sequence, or the planner's worst case), so the chunked head skips selecting the real tokens: a
    data-dependent selection, one device-to-host sync, and one that tensors without data (the
    planner's fake tensors) cannot run.

    With `chunk_tokens` > 0 (and a plain linear LM head, see `supports_chunked_head`) the logits are
    never materialised: the model's LM head is swapped, for this forward only, for one that computes the
    response tokens' log-probs `chunk_tokens` at a time (`models.lm_head`). The swap happens inside the
    model's own forward, so wrappers that gather the head's weight around it (FSDP) still do."""
    T = t.response_mask.shape[1]
    if chunk_tokens > 0 and supports_chunked_head(model) is None:
        return _chunked_forward(model, t, temperature, with_entropy, capture_lm_head, chunk_tokens, unpadded)
    with lm_head_inputs(model, enabled=capture_lm_head) as grabbed:
        out = _run(model, t, T)
    logp_all = log_softmax_at(out.logits[:, :-1], temperature)  # position P−1+t predicts response token t
    targets = t.input_ids[:, t.prompt_width :]
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1) * t.response_mask
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logprobs(logp_all)
    return PolicyForward(logp, entropy, grabbed[0] if grabbed else None, t)


def _run(model: torch.nn.Module, t: RolloutTensors, T: int):
    return model(
        input_ids=t.input_ids, attention_mask=t.attention_mask, position_ids=t.position_ids,
        logits_to_keep=T + 1, use_cache=False,
    )  # fmt: skip


def _chunked_forward(
    model, t: RolloutTensors, temperature, with_entropy, capture_lm_head, chunk_tokens, unpadded
) -> PolicyForward:
    head, transform = model.get_output_embeddings(), head_transform(model.config)
    valid = None if unpadded else t.response_mask.bool()
    targets = t.input_ids[:, t.prompt_width :]
    targets = targets.flatten() if valid is None else targets[valid]
    found: dict[str, torch.Tensor | None] = {}

    def as_rows(per_token: torch.Tensor) -> torch.Tensor:  # [M] real tokens → [n, T], 0 on padding
        if valid is None:
            return per_token.view(t.response_mask.shape).clone()  # FSDP2 warns of a view as the output
        return torch.zeros(valid.shape, device=per_token.device).masked_scatter(valid, per_token)

    def response_logprobs(hidden: torch.Tensor) -> torch.Tensor:  # hidden [n, T+1, d]
        found["lm_head_in"] = hidden.detach() if capture_lm_head else None
        rows = hidden[:, :-1]
        logp, entropy = chunked_token_logprobs(
            rows.flatten(0, 1) if valid is None else rows[valid], head.weight, targets, temperature, chunk_tokens,
            with_entropy, transform,
        )  # only the real response tokens: padding costs no LM-head work  # fmt: skip
        found["entropy"] = None if entropy is None else as_rows(entropy)
        return as_rows(logp)

    head.forward = response_logprobs  # the model returns these [n, T] log-probs as its "logits"
    try:
        with untransformed_head_output(model):
            out = _run(model, t, t.response_mask.shape[1])
    finally:
        del head.forward
    return PolicyForward(out.logits, found["entropy"], found["lm_head_in"], t)


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module, prompt_ids: list[int], completion_ids: list[int], chunk_tokens: int = 1024
) -> list[float]:
    """log π(completion token | prefix) at temperature 1 for one unpadded sequence, through
    `policy_forward` (so chunked like the update: an 8k-token completion never builds its
    [8k × V] logits). The trainer side of the weight-sync probe and the HF engine's `score`."""
    device = next(model.parameters()).device
    P, L = len(prompt_ids), len(completion_ids)
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=device)
    ones = torch.ones_like(ids)
    t = RolloutTensors(
        ids, ones, torch.arange(P + L, device=device)[None], ones[:, P:], torch.zeros(1, L, device=device), P
    )
    return policy_forward(model, t, 1.0, chunk_tokens=chunk_tokens, unpadded=True).logp[0].tolist()


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
