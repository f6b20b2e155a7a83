"""OAR — Outcome-grounded Advantage Reshaping (arXiv 2601.07408), ALGORITHMS.md §2.7.

Each rollout's reasoning tokens are scored by how much they move the model's *own* final-answer
distribution, then the scores become mass-preserving token weights (Bi-Level reshaping):

    OAR-P: a_m = KL(P_orig ‖ P_m), P_m with reasoning token m replaced by the pad token (one forward each)
    OAR-G: a_t = |Σ_d ∇_E J[t,d]·E[t,d]|, J = KL(P_clean ‖ P_noisy), noise on reasoning embeddings only
    Bi-Level: log compression, per-rollout min–max, quantile threshold, suppression floor, boost
              up to 1+β, renormalised to mean 1 over the reasoning tokens

The scoring input re-attaches the answer to the truncated reasoning with a fixed conclusion:
x = prompt + reasoning + conclude_template + answer, read out at the answer (§2.7.1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rlvr_lightning.rewards.math import find_last_boxed

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
    prompt_ids: list[int], response_ids: list[int], tokenizer, conclude_template: str = DEFAULT_CONCLUDE
) -> ScoringInput | None:
    """The scoring input of one rollout (§2.7.1), or None when it has no parsable `\\boxed{}` answer
    (none, unbalanced or empty; `\\fbox{}` counts too, as for the verifier)."""
    # The box the verifier scores (same extraction), so OAR reshapes the reasoning behind that answer.
    found = find_last_boxed(tokenizer.decode(response_ids, skip_special_tokens=True))
    if found is None:
        return None
    offset, content = found
    # R = the longest token prefix whose text ends at or before `\boxed{` (a straddling token is not
    # reasoning). Decoded length grows with the prefix, so binary search.
    lo, hi = 0, len(response_ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer.decode(response_ids[:mid], skip_special_tokens=True)) <= offset:
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


def _answer_logits(model, batch: list[list[int]], pad_id: int, max_answer: int, inputs_embeds=None) -> torch.Tensor:
    """Logits [n, max_answer, V] (fp32) at the positions that predict the last `max_answer` tokens of
    each sequence. Left padding puts every sequence's answer at the same columns."""
    width = max(len(s) for s in batch)
    device = next(model.parameters()).device
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros_like(ids)
    for i, seq in enumerate(batch):
        ids[i, width - len(seq) :] = torch.tensor(seq, device=device)
        attention[i, width - len(seq) :] = 1
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    kwargs = {"inputs_embeds": inputs_embeds(ids)} if inputs_embeds is not None else {"input_ids": ids}
    out = model(attention_mask=attention, position_ids=positions, logits_to_keep=max_answer + 1, use_cache=False, **kwargs)
    return out.logits[:, :-1].float(), ids, width


def _answer_slice(z: torch.Tensor, answer_len: int) -> torch.Tensor:
    """Of the last-columns logits of one sequence, those that predict its answer tokens."""
    return z[z.shape[0] - answer_len :]


@torch.no_grad()
def oar_p_scores(
    model, inputs: list[ScoringInput], pad_id: int, mode: Readout = "last", chunk_size: int = 32
) -> list[torch.Tensor]:
    """OAR-P (§2.7.2): per rollout, the read-out change when each reasoning token alone is replaced by
    `pad_id` (substitution, attention kept). All perturbed copies of all rollouts run in left-padded
    batches of `chunk_size` sequences, so memory is bounded by the chunk, not by R."""
    max_answer = max(x.answer_len for x in inputs)
    answers = [torch.tensor(x.ids[x.a0 :]) for x in inputs]
    refs = []
    for start in range(0, len(inputs), chunk_size):
        part = inputs[start : start + chunk_size]
        z, _, _ = _answer_logits(model, [x.ids for x in part], pad_id, max_answer)
        refs += [readout(_answer_slice(z[i], x.answer_len), mode, answers[start + i].to(z.device)) for i, x in enumerate(part)]
    jobs = [(k, m) for k, x in enumerate(inputs) for m in range(x.r0, x.r1)]
    scores = [torch.empty(x.r1 - x.r0) for x in inputs]
    for start in range(0, len(jobs), chunk_size):
        part = jobs[start : start + chunk_size]
        batch = []
        for k, m in part:
            ids = list(inputs[k].ids)
            ids[m] = pad_id
            batch.append(ids)
        z, _, _ = _answer_logits(model, batch, pad_id, max_answer)
        for i, (k, m) in enumerate(part):
            out = readout(_answer_slice(z[i], inputs[k].answer_len), mode, answers[k].to(z.device))
            scores[k][m - inputs[k].r0] = divergence(refs[k], out, mode).cpu()
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
) -> list[torch.Tensor]:
    """OAR-G (§2.7.3): |∇_E J · (E − E_base)| on the reasoning tokens, J = KL(P_clean ‖ P_noisy) (or φ0 − φ),
    noise N(0, σ²) on the reasoning embeddings only. Gradients are taken with `torch.autograd.grad`
    with respect to the input embeddings alone; parameters are frozen meanwhile, so no parameter
    `.grad` is created, changed or erased. Rollouts in a batch are independent (J is a sum), so
    batching is exact.

    `baseline`: `zero` is the authors' gradient × input; `pad` uses the pad token's embedding as the
    baseline, so the saliency is the first-order estimate of OAR-P's substitution (an option of
    ours; on the embedded model it ranks tokens more like OAR-P does, see tests/test_oar.py)."""
    max_answer = max(x.answer_len for x in inputs)
    embed = model.get_input_embeddings()
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    saliency: list[torch.Tensor] = []
    try:
        for start in range(0, len(inputs), chunk_size):
            part = inputs[start : start + chunk_size]
            with torch.no_grad():
                z_clean, ids, width = _answer_logits(model, [x.ids for x in part], pad_id, max_answer)
            clean_embeds = embed(ids).detach()
            noise = torch.zeros_like(clean_embeds)
            for i, x in enumerate(part):
                off = width - len(x.ids)
                gen = generators[start + i] if generators is not None else None
                shape = (x.r1 - x.r0, clean_embeds.shape[-1])
                noise[i, off + x.r0 : off + x.r1] = sigma * torch.randn(shape, generator=gen).to(noise)
            leaf = clean_embeds.clone().requires_grad_(True)
            with torch.enable_grad():
                z_noisy, _, _ = _answer_logits(model, [x.ids for x in part], pad_id, max_answer, inputs_embeds=lambda _: leaf + noise)
                total = z_noisy.new_zeros(())
                for i, x in enumerate(part):
                    answer = torch.tensor(x.ids[x.a0 :], device=z_noisy.device)
                    ref = readout(_answer_slice(z_clean[i], x.answer_len), mode, answer)
                    out = readout(_answer_slice(z_noisy[i], x.answer_len), mode, answer)
                    total = total + divergence(ref, out, mode)
                (grad,) = torch.autograd.grad(total, leaf)
            for i, x in enumerate(part):
                off = width - len(x.ids)
                rows = slice(off + x.r0, off + x.r1)
                delta = clean_embeds[i, rows] - (embed.weight[pad_id].detach() if baseline == "pad" else 0.0)
                saliency.append((grad[i, rows] * delta).sum(-1).abs().cpu())
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)
    return saliency


def bilevel_weights(
    scores: torch.Tensor, q: float = 0.25, beta: float = 1.0, floor: float = 0.1, sum_to_len: bool = True, eps: float = 1e-8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bi-Level reshaping (§2.7.4) of one rollout's reasoning scores: (weights [R] > 0, level [R]
    with −1 suppressed, +1 boosted, 0 at the threshold)."""
    u = torch.log1p(scores.double().clamp(min=0))
    spread = u.max() - u.min()
    n = (u - u.min()) / (spread if spread > 0 else 1.0)
    th = torch.quantile(n, q)
    w = torch.where(n < th, (n / (th + eps)).clamp(min=floor), 1 + beta * (n - th) / (1 - th + eps))
    if sum_to_len:
        w = w * len(w) / (w.sum() + eps)
    level = torch.sign(n - th).to(torch.int8)
    return w.float(), level
