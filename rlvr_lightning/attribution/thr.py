"""THR — Token Hidden Reward (arXiv 2510.03669; docs/algorithms.md#thr), as tensor functions over
θ_old's LM-head inputs and the LM head.

For a group with correct rollouts O+, the score of response token (j,k) is

    s_{j,k} = g_{j,k}ᵀ M+ h_{j,k},   M+ = Σ_{i∈O+} Σ_k' g_{i,k'} h_{i,k'}ᵀ,   g = e_y − π  (on V*)

h: the last-layer hidden state feeding the LM head, π = softmax(lm_head(h)/T_roll) of θ_old,
V*: the distinct token ids of the group's responses (vectors restricted, not renormalised).
One LM-head gradient step on token (j,k) with advantage Â_j changes Σ_{correct tokens} log π by
η·Â_j·s_{j,k} to first order, so THR_{j,k} = Â_j·s_{j,k} says whether the token's update helps
(> 0, exploitation) or hurts (< 0, exploration) the group's correct answers.

Chunked (docs/algorithms.md#thr-in-the-training-step): logits are rebuilt from the stored h in token chunks, so no [tokens × |V|]
matrix exists for more than `chunk_size` tokens at a time; M+ is |V*| × d.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from rlvr_lightning.pieces.advantages import mixed_groups
from rlvr_lightning.rollout.types import Rollout
from rlvr_lightning.tensor_math import entropy_from_logprobs, log_softmax_at

ThresholdMode = Literal["anchor", "quantile", "absolute", "all"]
ReweightMode = Literal["reweight", "only"]


@torch.no_grad()
def group_thr_scores(
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    seq: torch.Tensor,
    correct: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores s [n] and the entropy of π_old [n] for the n response tokens of one group.

    Args:
        hidden: [n, d] LM-head inputs at the positions predicting each response token (model dtype).
        tokens: [n] the sampled token ids.
        seq: [n] index (0..G−1) of the rollout each token belongs to.
        correct: [G] bool, the verifier's verdicts.
        lm_head: [c, d] → [c, |V|] logits (the policy's output embedding and its family's transform:
            `models.lm_head.PolicyHead`).
        temperature: the rollout temperature T_roll.
        chunk_size: tokens per LM-head call.
    """
    h32 = hidden.float()
    vocab, cols = torch.unique(tokens, return_inverse=True)
    positive = correct.bool()[seq]

    def errors(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = log_softmax_at(lm_head(hidden[rows]), temperature)
        g = -logp[:, vocab].exp()
        g[torch.arange(len(rows), device=g.device), cols[rows]] += 1.0
        return g, entropy_from_logprobs(logp)

    m_pos = h32.new_zeros(len(vocab), h32.shape[1])
    for rows in positive.nonzero().squeeze(1).split(chunk_size):
        g, _ = errors(rows)
        m_pos += g.T @ h32[rows]
    scores = h32.new_empty(len(tokens))
    entropy = h32.new_empty(len(tokens))
    for rows in torch.arange(len(tokens), device=hidden.device).split(chunk_size):
        g, ent = errors(rows)
        scores[rows] = ((g @ m_pos) * h32[rows]).sum(-1)
        entropy[rows] = ent
    return scores, entropy


def dominant_tokens(
    scores: torch.Tensor,
    thr: torch.Tensor,
    seq: torch.Tensor,
    correct: torch.Tensor,
    threshold: ThresholdMode = "anchor",
    beta_anchor: float = 1.0,
    quantile: float = 0.8,
    thr_abs: float | None = None,
) -> torch.Tensor:
    """Which of one group's tokens are dominant (docs/algorithms.md#thr-dominant-tokens-and-reweighting); bool [n]."""
    if threshold == "anchor":
        # NTHR's anchor: the smallest mean score of a correct rollout. τ ≤ 0 makes every token dominant.
        G = len(correct)
        sums = scores.new_zeros(G).index_add_(0, seq, scores)
        counts = scores.new_zeros(G).index_add_(0, seq, torch.ones_like(scores))
        means = sums / counts.clamp(min=1)
        anchors = means[correct.bool() & (counts > 0)]
        if len(anchors) == 0:  # every correct rollout is empty: M+ = 0, all scores 0, nothing to weigh
            return torch.zeros_like(scores, dtype=torch.bool)
        tau = beta_anchor * anchors.min()
        return scores.abs() > tau
    if threshold == "quantile":  # one group: ≤ G × max response length tokens, far below torch.quantile's 2^24
        return thr.abs() >= torch.quantile(thr.abs(), quantile)
    if threshold == "absolute":
        return thr.abs() > thr_abs
    if threshold == "all":
        return torch.ones_like(thr, dtype=torch.bool)
    raise ValueError(f"unknown THR threshold {threshold!r}")


def thr_token_weights(
    thr: torch.Tensor, dominant: torch.Tensor, p: float, mode: ReweightMode = "reweight"
) -> torch.Tensor:
    """w with Â' = Â·w: 1 + p·sign(THR) on dominant tokens, 1 (reweight) or 0 (THR-only) elsewhere."""
    off = 0.0 if mode == "only" else 1.0
    return torch.where(dominant, 1.0 + p * torch.sign(thr), torch.full_like(thr, off))


@dataclass
class GroupScores:
    """THR of one mixed group, over the tokens its policy sampled (an environment's inserted tokens have no loss,
    so no THR: they are context only), concatenated rollout after rollout."""

    group: int
    lengths: list[int]  # sampled tokens of each of the G rollouts
    seq: torch.Tensor  # [n] rollout index within the group
    correct: torch.Tensor  # [G] bool
    scores: torch.Tensor  # [n] s
    thr: torch.Tensor  # [n] Â·s
    entropy: torch.Tensor  # [n] entropy of π_old
    positions: list[torch.Tensor] | None = None  # each rollout's sampled positions in its response; None: all

    def per_rollout(self, values: torch.Tensor) -> list[torch.Tensor]:
        """`values` [n] split by rollout: its sampled tokens' values."""
        return list(values.split(self.lengths))

    def per_response(self, values: torch.Tensor, response_lengths: list[int], fill: float) -> list[torch.Tensor]:
        """`values` [n] as each rollout's whole response [L_j], `fill` at the positions an environment inserted."""
        parts = self.per_rollout(values)
        if self.positions is None:
            return parts
        out = []
        for part, where, length in zip(parts, self.positions, response_lengths):
            full = torch.full((length,), fill, dtype=part.dtype, device=part.device)
            full[where.to(part.device)] = part
            out.append(full)
        return out


def sampled_positions(sampled_mask: list[bool]) -> torch.Tensor:
    """The positions of a response's tokens that its policy sampled (`Completion.sampled_mask`)."""
    if all(sampled_mask):
        return torch.arange(len(sampled_mask))
    return torch.tensor([i for i, s in enumerate(sampled_mask) if s], dtype=torch.long)


def rollout_thr(
    rollout: Rollout,
    advantages: torch.Tensor,
    hidden_states: dict[int, torch.Tensor],
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    chunk_size: int = 1024,
) -> Iterator[GroupScores]:
    """THR of every mixed group of a scored rollout, given its sequence `advantages` [N], whose θ_old
    LM-head inputs are in `hidden_states` (all of a group's sequences, or none)."""
    G = rollout.group_size
    for group in mixed_groups(rollout.correct.float(), G).nonzero().squeeze(1).tolist():
        seqs = range(group * G, (group + 1) * G)
        if group * G not in hidden_states:
            continue
        completions = [rollout.completions[n] for n in seqs]
        inserted = any(c.has_inserted for c in completions)
        where = [sampled_positions(c.sampled_mask) for c in completions]
        hidden = torch.cat([hidden_states[n][w.to(hidden_states[n].device)] for n, w in zip(seqs, where)])
        if isinstance(lm_head, torch.nn.Module):  # captured hidden states wait in host memory
            hidden = hidden.to(next(lm_head.parameters()).device)
        device = hidden.device
        tokens = torch.cat([torch.tensor(c.token_ids, dtype=torch.long)[w] for c, w in zip(completions, where)])
        lengths = [len(w) for w in where]
        seq = torch.repeat_interleave(torch.arange(G), torch.tensor(lengths)).to(device)
        correct = rollout.correct[group * G : (group + 1) * G].bool().to(device)
        scores, entropy = group_thr_scores(
            hidden, tokens.to(device), seq, correct, lm_head, rollout.sampling.temperature, chunk_size
        )
        thr = advantages[group * G : (group + 1) * G].to(device)[seq] * scores
        yield GroupScores(group, lengths, seq, correct, scores, thr, entropy, where if inserted else None)
