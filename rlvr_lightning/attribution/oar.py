"""OAR — Outcome-grounded Advantage Reshaping (arXiv 2601.07408; docs/algorithms.md#oar).

Each rollout's reasoning tokens are scored by how much they move the model's *own* final-answer
distribution, then the scores become mass-preserving token weights (Bi-Level reshaping):

    OAR-P: a_m = KL(P_orig ‖ P_m), P_m with reasoning token m replaced by the pad token (one forward each)
    OAR-G: a_t = |Σ_d ∇_E J[t,d]·E[t,d]|, J = KL(P_clean ‖ P_noisy), noise on reasoning embeddings only
    Bi-Level: log compression, per-rollout min–max, quantile threshold, suppression floor, boost
              up to 1+β, renormalised to mean 1 over the reasoning tokens

The scoring input re-attaches the answer to the truncated reasoning with a fixed conclusion:
x = prompt + reasoning + conclude_template + answer, read out at the answer (docs/algorithms.md#oar-scoring-input-and-read-outs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rlvr_lightning.rewards.extraction import find_last_boxed
from rlvr_lightning.rollout.types import left_padded, position_ids

Readout = Literal["last", "answer_mean", "answer_joint"]
SaliencyBaseline = Literal["zero", "pad"]
DEFAULT_CONCLUDE = "\n\nThe final answer is $\\boxed{"


@dataclass
class ScoringInput:
    """One rollout laid out for scoring: x = prompt | reasoning [r0, r1) | conclusion | answer [a0, end)."""

    ids: list[int]
    r0: int
    r1: int
    a0: int

    @property
    def answer_len(self) -> int:
        return len(self.ids) - self.a0


def segment_boxed(
    prompt_ids: list[int],
    response_ids: list[int],
    tokenizer,
    conclude_template: str = DEFAULT_CONCLUDE,
    sampled_mask: list[bool] | None = None,
) -> ScoringInput | None:
    """The scoring input of one rollout (docs/algorithms.md#oar-scoring-input-and-read-outs), or None when it has no parsable `\\boxed{}` answer
    (none, unbalanced or empty; `\\fbox{}` counts too, as for the verifier). `sampled_mask` (`Completion.sampled_mask`): in an
    environment, the box is the last one the model wrote itself, as the verifier reads its own words; the reasoning
    before it keeps the inserted tokens (they are context), which `OARAttribution` leaves unweighted."""

    own = [True] * len(response_ids) if sampled_mask is None else sampled_mask  # None: a response outside an environment

    def own_text(k: int) -> str:  # the model's own words in the first k response tokens
        ids = [t for t, s in zip(response_ids[:k], own[:k]) if s]
        return tokenizer.decode(ids, skip_special_tokens=True)

    # The box the verifier scores (same extraction), so OAR reshapes the reasoning behind that answer.
    found = find_last_boxed(own_text(len(response_ids)))
    if found is None:
        return None
    offset, content = found
    # R = the longest token prefix whose own text ends at or before `\boxed{` (a straddling token is not
    # reasoning). Decoded length grows with the prefix, so binary search.
    lo, hi = 0, len(response_ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(own_text(mid)) <= offset:
            lo = mid
        else:
            hi = mid - 1
    answer_ids = tokenizer(content, add_special_tokens=False).input_ids
    conclude_ids = tokenizer(conclude_template, add_special_tokens=False).input_ids
    ids = list(prompt_ids) + list(response_ids[:lo]) + conclude_ids + answer_ids
    return ScoringInput(ids, len(prompt_ids), len(prompt_ids) + lo, len(ids) - len(answer_ids))


def readout(z: torch.Tensor, mode: Readout, answer_ids: torch.Tensor) -> torch.Tensor:
    """Final-answer read-out from the fp32 logits z [|ans|, V] at positions a0−1 … a0−2+|ans|:
    log P [V] (`last`, `answer_mean`) or the scalar φ (`answer_joint`)."""
    if mode == "last":
        return z[0].log_softmax(-1)
    if mode == "answer_mean":
        return z.mean(0).log_softmax(-1)
    if mode == "answer_joint":
        return z.log_softmax(-1).gather(-1, answer_ids[:, None]).mean()
    raise ValueError(f"unknown OAR read-out {mode!r}")


def divergence(ref: torch.Tensor, other: torch.Tensor, mode: Readout) -> torch.Tensor:
    """KL(P_ref ‖ P_other) from log-probabilities, or φ_ref − φ_other for `answer_joint`."""
    if mode == "answer_joint":
        return ref - other
    return (ref.exp() * (ref - other)).sum(-1)


@dataclass
class _Layout:
    """Sequences left-padded to one width, so every answer ends at the last column."""

    ids: torch.Tensor  # [n, W]
    attention: torch.Tensor  # [n, W]
    positions: torch.Tensor  # [n, W]
    offsets: list[int]  # column of each sequence's first token

    @staticmethod
    def of(batch: list[list[int]], pad_id: int, device: torch.device) -> _Layout:
        ids, attention = left_padded(batch, pad_id, device)
        width = ids.shape[1]
        return _Layout(ids, attention, position_ids(attention), [width - len(seq) for seq in batch])


def _answer_logits(
    model,
    ids: torch.Tensor,
    attention: torch.Tensor,
    positions: torch.Tensor,
    max_answer: int,
    start: int = 0,
    prefix=None,
    inputs_embeds: torch.Tensor | None = None,
    keep_cache: bool = False,
):
    """Logits [n, ≤ max_answer, V] (fp32) at the positions that predict the last `max_answer` tokens,
    feeding columns `start:` only, on top of `prefix` (the KV cache of columns `:start`) when given;
    and this forward's KV cache if `keep_cache`."""
    kwargs = {"inputs_embeds": inputs_embeds} if inputs_embeds is not None else {"input_ids": ids[:, start:]}
    if prefix is not None:
        kwargs["past_key_values"] = prefix
    out = model(
        attention_mask=attention,
        position_ids=positions[:, start:],
        logits_to_keep=max_answer + 1,
        use_cache=keep_cache or prefix is not None,
        **kwargs,
    )
    return out.logits[:, :-1].float(), (out.past_key_values if keep_cache else None)


def _reusable_cache(model) -> bool:
    # HF causal LMs return a KV cache; a plain module (or a custom model) is scored with full forwards.
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def _prefix_of(cache, rows: torch.Tensor | None, length: int, config):
    """A fresh cache holding the first `length` columns of `cache` (rows `rows`), or None when this cache
    cannot be cut that way (sliding-window or other non-plain layers: then full forwards are used).

    Why hand-made: HF's `DynamicCache.crop` / `batch_select_indices` edit a cache in place, and the
    clean cache serves many perturbed batches."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if cache is None or length <= 0 or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    data = []
    for layer in cache.layers:
        keys, values = (layer.keys, layer.values) if rows is None else (layer.keys[rows], layer.values[rows])
        data.append((keys[:, :, :length], values[:, :, :length]))
    return DynamicCache(ddp_cache_data=data, config=config)


def _answer_slice(z: torch.Tensor, answer_len: int) -> torch.Tensor:
    """Of the last-columns logits of one sequence, those that predict its answer tokens."""
    return z[z.shape[0] - answer_len :]


@torch.no_grad()
def oar_p_scores(
    model,
    inputs: list[ScoringInput],
    pad_id: int,
    mode: Readout = "last",
    chunk_size: int = 32,
    reuse_prefix: bool | None = None,
) -> list[torch.Tensor]:
    """OAR-P (docs/algorithms.md#oar-p): per rollout, the read-out change when each reasoning token alone is replaced by
    `pad_id` (substitution, attention kept). Rollouts are taken `chunk_size` at a time: one clean
    forward, then all their perturbed copies in batches of `chunk_size` sequences, so memory is bounded
    by the chunk, not by R.

    `reuse_prefix` (default: for HF models): a copy perturbed at column c equals the clean sequence
    before c, so each batch of copies (ordered by c) runs only from its first c on, on top of the clean
    forward's KV cache — the same scores (tested) for about half the compute."""
    reuse = _reusable_cache(model) if reuse_prefix is None else reuse_prefix
    device = next(model.parameters()).device
    max_answer = max(x.answer_len for x in inputs)
    scores = [torch.empty(x.r1 - x.r0) for x in inputs]
    for start in range(0, len(inputs), chunk_size):
        part = inputs[start : start + chunk_size]
        lay = _Layout.of([x.ids for x in part], pad_id, device)
        z, cache = _answer_logits(model, lay.ids, lay.attention, lay.positions, max_answer, keep_cache=reuse)
        answers = [torch.tensor(x.ids[x.a0 :], device=z.device) for x in part]
        refs = [readout(_answer_slice(z[i], x.answer_len), mode, answers[i]) for i, x in enumerate(part)]
        jobs = sorted((lay.offsets[i] + m, i, m) for i, x in enumerate(part) for m in range(x.r0, x.r1))
        for b in range(0, len(jobs), chunk_size):
            batch = jobs[b : b + chunk_size]
            rows = torch.tensor([i for _, i, _ in batch], device=device)
            ids = lay.ids[rows]
            ids[torch.arange(len(batch), device=device), torch.tensor([c for c, _, _ in batch], device=device)] = pad_id
            split = batch[0][0]  # the first perturbed column of the batch: everything before it is clean
            prefix = _prefix_of(cache, rows, split, model.config) if reuse else None
            split = split if prefix is not None else 0
            zp, _ = _answer_logits(model, ids, lay.attention[rows], lay.positions[rows], max_answer, split, prefix)
            for j, (_, i, m) in enumerate(batch):
                out = readout(_answer_slice(zp[j], part[i].answer_len), mode, answers[i])
                scores[start + i][m - part[i].r0] = divergence(refs[i], out, mode).cpu()
    return scores


def oar_g_saliency(
    model,
    inputs: list[ScoringInput],
    pad_id: int,
    mode: Readout = "answer_mean",
    sigma: float = 1e-3,
    generators: list[torch.Generator] | None = None,
    chunk_size: int = 32,
    baseline: SaliencyBaseline = "zero",
    reuse_prefix: bool | None = None,
) -> list[torch.Tensor]:
    """OAR-G (docs/algorithms.md#oar-g): |∇_E J · (E − E_base)| on the reasoning tokens, J = KL(P_clean ‖ P_noisy) (or φ0 − φ),
    noise N(0, σ²) on the reasoning embeddings only. Gradients are taken with `torch.autograd.grad`
    with respect to the input embeddings alone; parameters are frozen meanwhile, so no parameter
    `.grad` is created, changed or erased. Rollouts in a batch are independent (J is a sum), so
    batching is exact.

    `baseline`: `zero` is the authors' gradient × input; `pad` uses the pad token's embedding as the
    baseline, so the saliency is the first-order estimate of OAR-P's substitution (an option of
    ours; on the embedded model it ranks tokens more like OAR-P does, see tests/attribution/test_oar.py).

    `reuse_prefix` (default: for HF models): the columns before the chunk's first reasoning token carry
    no noise and need no gradient, so the noisy pass starts there, on the clean pass's KV cache."""
    reuse = _reusable_cache(model) if reuse_prefix is None else reuse_prefix
    device = next(model.parameters()).device
    max_answer = max(x.answer_len for x in inputs)
    embed = model.get_input_embeddings()
    # The pad token's input embedding as the module computes it, not a row of its weight: Gemma 3's
    # embedding module scales its lookup by √d, and the baseline must live where `embed(ids)` does.
    pad_embed = embed(torch.tensor([pad_id], device=device)).detach()[0] if baseline == "pad" else 0.0
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    saliency: list[torch.Tensor] = []
    try:
        for start in range(0, len(inputs), chunk_size):
            part = inputs[start : start + chunk_size]
            lay = _Layout.of([x.ids for x in part], pad_id, device)
            with torch.no_grad():
                z_clean, cache = _answer_logits(model, lay.ids, lay.attention, lay.positions, max_answer, keep_cache=reuse)
            split = min(off + x.r0 for off, x in zip(lay.offsets, part))
            prefix = _prefix_of(cache, None, split, model.config) if reuse else None
            split = split if prefix is not None else 0
            clean_embeds = embed(lay.ids).detach()
            noise = torch.zeros_like(clean_embeds)
            for i, x in enumerate(part):
                off = lay.offsets[i]
                gen = generators[start + i] if generators is not None else None
                shape = (x.r1 - x.r0, clean_embeds.shape[-1])
                noise[i, off + x.r0 : off + x.r1] = sigma * torch.randn(shape, generator=gen).to(noise)
            leaf = clean_embeds[:, split:].clone().requires_grad_(True)
            with torch.enable_grad():
                z_noisy, _ = _answer_logits(
                    model, lay.ids, lay.attention, lay.positions, max_answer, split, prefix, leaf + noise[:, split:]
                )
                total = z_noisy.new_zeros(())
                for i, x in enumerate(part):
                    answer = torch.tensor(x.ids[x.a0 :], device=z_noisy.device)
                    ref = readout(_answer_slice(z_clean[i], x.answer_len), mode, answer)
                    out = readout(_answer_slice(z_noisy[i], x.answer_len), mode, answer)
                    total = total + divergence(ref, out, mode)
                (grad,) = torch.autograd.grad(total, leaf)
            for i, x in enumerate(part):
                cols = slice(lay.offsets[i] + x.r0, lay.offsets[i] + x.r1)
                delta = clean_embeds[i, cols] - pad_embed
                saliency.append((grad[i, cols.start - split : cols.stop - split] * delta).sum(-1).abs().cpu())
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)
    return saliency


def bilevel_weights(
    scores: torch.Tensor, q: float = 0.25, beta: float = 1.0, floor: float = 0.1, sum_to_len: bool = True, eps: float = 1e-8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bi-Level reshaping (docs/algorithms.md#bi-level-reshaping) of one rollout's reasoning scores: (weights [R] > 0, level [R]
    with −1 suppressed, +1 boosted, 0 at the threshold)."""
    u = torch.log1p(scores.double().clamp(min=0))
    spread = u.max() - u.min()
    n = (u - u.min()) / (spread if spread > 0 else 1.0)
    th = torch.quantile(n, q)  # one rollout's reasoning tokens (≤ max response length), far below its 2^24 limit
    w = torch.where(n < th, (n / (th + eps)).clamp(min=floor), 1 + beta * (n - th) / (1 - th + eps))
    if sum_to_len:
        w = w * len(w) / (w.sum() + eps)
    level = torch.sign(n - th).to(torch.int8)
    return w.float(), level
