"""One forward of the policy over a laid-out rollout: the per-token log-probs the losses need, their
entropy, and (when asked) the LM head's inputs that THR scores from. Every trainer-side forward of
a training step goes through `policy_forward`, so the three always come from the same pass.

Padded (the default), the forward runs over the micro-batch as laid out, [n, P+T]; packed
(`packed=True`, `model.compute.packing`), over its real tokens only, concatenated into one row
(`models.packing`), and the response tokens' results are put back in the same [n, T] grid, so every
consumer reads the same shapes either way."""

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
from rlvr_lightning.models.packed_attention import packed_forward, prepare_packed_attention, varlen_kwargs
from rlvr_lightning.models.packing import packed_layout
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
    packed: bool = False,
) -> PolicyForward:
    """log_softmax(logits / T) in fp32 gathered at the sampled tokens (grad flows if enabled).

    `unpadded`: the caller vouches that every response position is a real token (one unpadded
    sequence, or the planner's worst case), so the chunked head skips selecting the real tokens: a
    data-dependent selection, one device-to-host sync, and one that tensors without data (the
    planner's fake tensors) cannot run.

    With `chunk_tokens` > 0 (and a plain linear LM head, see `supports_chunked_head`) the logits are
    never materialised: the model's LM head is swapped, for this forward only, for one that computes the
    response tokens' log-probs `chunk_tokens` at a time (`models.lm_head`). The swap happens inside the
    model's own forward, so wrappers that gather the head's weight around it (FSDP) still do.

    `packed`: the forward runs over the real tokens only (`_packed_forward`); the same results."""
    if packed:
        return _packed_forward(model, t, temperature, with_entropy, capture_lm_head, chunk_tokens)
    T = t.response_mask.shape[1]
    if chunk_tokens > 0 and supports_chunked_head(model) is None:
        return _chunked_forward(model, t, temperature, with_entropy, capture_lm_head, chunk_tokens, unpadded)
    with lm_head_inputs(model, enabled=capture_lm_head) as grabbed:
        out = _run(model, t, T)
    # Position P−1+t predicts response token t.
    logp, entropy = _full_logprobs(out.logits[:, :-1], t.input_ids[:, t.prompt_width :], temperature, with_entropy)
    return PolicyForward(logp * t.response_mask, entropy, grabbed[0] if grabbed else None, t)


def _full_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """log π of `targets` [...] from the model's own `logits` [..., V], and the entropy [...] if asked (no grad)."""
    logp_all = log_softmax_at(logits, temperature)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logprobs(logp_all)
    return logp, entropy


def _run(model: torch.nn.Module, t: RolloutTensors, T: int):
    return model(
        input_ids=t.input_ids,
        attention_mask=t.attention_mask,
        position_ids=t.position_ids,
        logits_to_keep=T + 1,
        use_cache=False,
    )


@contextmanager
def _head_returning(model: torch.nn.Module, compute):
    """Within the block the model's LM head returns `compute(hidden)` (the chunked log-probs) in place of
    logits, untouched by the family's logit transform."""
    head = model.get_output_embeddings()
    head.forward = compute
    try:
        with untransformed_head_output(model):
            yield
    finally:
        del head.forward


def _chunked_head(model: torch.nn.Module, temperature: float, chunk_tokens: int, with_entropy: bool):
    """hidden [M, d], targets [M] → (log π [M], entropy [M] or None) through the model's LM head and its
    family's transform, read now: inside `_head_returning` the configuration's transform is neutral."""
    head, transform = model.get_output_embeddings(), head_transform(model.config)
    return lambda hidden, targets: chunked_token_logprobs(
        hidden, head.weight, targets, temperature, chunk_tokens, with_entropy, transform
    )


def _chunked_forward(
    model, t: RolloutTensors, temperature, with_entropy, capture_lm_head, chunk_tokens, unpadded
) -> PolicyForward:
    head = _chunked_head(model, temperature, chunk_tokens, with_entropy)
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
        # Only the real response tokens: padding costs no LM-head work.
        logp, entropy = head(rows.flatten(0, 1) if valid is None else rows[valid], targets)
        found["entropy"] = None if entropy is None else as_rows(entropy)
        return as_rows(logp)

    with _head_returning(model, response_logprobs):  # the model returns these [n, T] log-probs as its "logits"
        out = _run(model, t, t.response_mask.shape[1])
    return PolicyForward(out.logits, found["entropy"], found["lm_head_in"], t)


def _packed_forward(model, t: RolloutTensors, temperature, with_entropy, capture_lm_head, chunk_tokens) -> PolicyForward:
    """`policy_forward` over the micro-batch's real tokens packed into one row [1, S] (`models.packing`):
    no padding in the forward, and only the S − n hidden states that predict response tokens reach the
    LM head (`logits_to_keep` as an index; with `chunk_tokens` > 0 the chunked head). The same
    `PolicyForward`: logp and entropy [n, T], 0 on padding; `lm_head_in` [n, T+1, d] holds each row's
    response-predicting inputs (rows :L of a response of L tokens, what THR reads), zeros elsewhere.

    The layout comes from `t.token_counts` (one device-to-host copy of [n, 2] counts). On CUDA the model's
    attention is switched to a varlen one first (`models.packed_attention`)."""
    n, T = t.response_mask.shape
    layout = packed_layout(t.token_counts, t.prompt_width, T, t.input_ids.device)
    prepare_packed_attention(model)
    chunked = chunk_tokens > 0 and supports_chunked_head(model) is None
    head = _chunked_head(model, temperature, chunk_tokens, with_entropy) if chunked else None
    where = (layout.response_row, layout.response_col)
    targets = t.input_ids[:, t.prompt_width :][where]
    found: dict[str, torch.Tensor | None] = {}

    def as_grid(per_token: torch.Tensor) -> torch.Tensor:  # [M] response tokens → [n, T], 0 on padding
        return per_token.new_zeros(n, T).index_put(where, per_token)

    def as_lm_head_in(hidden: torch.Tensor) -> torch.Tensor:  # [M, d] → [n, T+1, d]
        return hidden.new_zeros(n, T + 1, hidden.shape[-1]).index_put(where, hidden)

    def response_logprobs(hidden: torch.Tensor) -> torch.Tensor:  # hidden [1, M, d]: exactly the predicting rows
        found["lm_head_in"] = as_lm_head_in(hidden[0].detach()) if capture_lm_head else None
        logp, entropy = head(hidden[0], targets)
        found["entropy"] = None if entropy is None else as_grid(entropy)
        return as_grid(logp)

    kwargs = dict(
        input_ids=t.input_ids.flatten()[layout.token_index][None],
        attention_mask=None,
        position_ids=layout.position_ids,
        logits_to_keep=layout.predicting,
        use_cache=False,
        **varlen_kwargs(model, layout),
    )
    if chunked:
        with packed_forward(), _head_returning(model, response_logprobs):
            out = model(**kwargs)
        return PolicyForward(out.logits, found["entropy"], found["lm_head_in"], t)
    with packed_forward(), lm_head_inputs(model, enabled=capture_lm_head) as grabbed:
        out = model(**kwargs)
    logp, entropy = _full_logprobs(out.logits[0], targets, temperature, with_entropy)
    lm_head_in = as_lm_head_in(grabbed[0][0]) if grabbed else None
    return PolicyForward(as_grid(logp), None if entropy is None else as_grid(entropy), lm_head_in, t)


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module, prompt_ids: list[int], completion_ids: list[int], chunk_tokens: int = 1024
) -> list[float]:
    """log π(completion token | prefix) at temperature 1 for one unpadded sequence, through
    `policy_forward` (so chunked like the update: an 8k-token completion never builds its
    [8k × V] logits). The trainer side of the weight-sync probe and the HF engine's `logprobs`."""
    device = next(model.parameters()).device
    P, L = len(prompt_ids), len(completion_ids)
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=device)
    ones = torch.ones_like(ids)
    response = ones[:, P:]
    t = RolloutTensors(ids, ones, torch.arange(P + L, device=device)[None], response, torch.zeros(1, L, device=device), P, response)
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
