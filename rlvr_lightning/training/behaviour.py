"""The behaviour policy θ_old: where the log-probs of the policy that sampled the rollout come from.

- `trainer`: a separate no-grad forward of the trainer before the update (`separate_pass`), the default
  when a rollout batch gets several optimizer steps (θ_old must stay fixed while θ moves).
- `rollout`: the rollout engine's own log-probs (`model.behaviour.logprobs=rollout`), no extra forward.
- `update`: with exactly one optimizer step per rollout batch the update runs at θ_old, so each
  micro-batch's forward gives θ_old's log-probs (detached) for free (`FromUpdateForward`); the ratio is
  exactly 1 and its gradient that of log π_θ. THR's LM-head inputs are then read there too.
- `proximal`: decoupled PPO with a proximal-policy piece that needs no pass (`model.proximal_policy
  loglinear`): each micro-batch's θ_old comes from its own forward and the engine's log-probs, and the rollout
  correction's weights from that θ_old (`ApproximateProximal`).
The same no-grad pass also gives the reference log-probs of the KL term.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import Literal

import torch

from rlvr_lightning.models.forward import PolicyForward, policy_forward
from rlvr_lightning.pieces.kinds import CorrectionInputs, ProximalInputs
from rlvr_lightning.rollout.types import RolloutTensors
from rlvr_lightning.training.batch import LossBatch, UpdateInputs, select_loss_batch
from rlvr_lightning.training.shaping import HiddenWeigher

BehaviourSource = Literal["trainer", "rollout", "update", "proximal"]


def behaviour_source(
    behaviour_logprobs: str,
    optimizer_steps_per_batch: int,
    corrected: bool,
    reads_step_first: bool,
    stale: bool = False,
    approximates_proximal: bool = False,
) -> BehaviourSource:
    """`update` wherever it is exact: one optimizer step per rollout batch, no rollout correction (its
    weights are needed before the update) and no loss that reads the whole step before any forward
    with grad (`reads_step_first`: the two-pass method, a token selection such as Clip-Cov's).
    `stale` (`rollout.stream.max_staleness` > 0: sampled by older policy versions, token by token): the trainer's
    weights are not the behaviour policy, so θ_old is the engine's log-probs (each token's from the version
    that sampled it), unless a rollout correction (`corrected`) weighs the trainer's θ_old (the proximal
    policy of decoupled PPO) against them; `approximates_proximal`: a proximal-policy piece that needs no pass
    gives that θ_old in the update (`proximal`)."""
    if behaviour_logprobs == "rollout" or (stale and not corrected):
        return "rollout"
    if approximates_proximal and corrected:
        return "proximal"
    if stale:
        return "trainer"
    if optimizer_steps_per_batch == 1 and not corrected and not reads_step_first:
        return "update"
    return "trainer"


class Precomputed:
    """θ_old's log-probs known before the update (the trainer's separate pass, or the engine's)."""

    reads_lm_head = False

    def __init__(self, old_logp: torch.Tensor, source: BehaviourSource) -> None:
        self.old_logp, self.source = old_logp, source

    def loss_batch(self, inputs: UpdateInputs, rows: torch.Tensor, forward: PolicyForward, updates: int = 0) -> LossBatch:
        return select_loss_batch(inputs, rows, forward.tensors, self.old_logp[rows])

    def old_logp_all(self) -> torch.Tensor:
        return self.old_logp

    def token_weights(self) -> torch.Tensor | None:
        return None


class FromUpdateForward:
    """θ_old's log-probs from the update's own forward, which runs at θ_old; valid for that one optimizer
    step. With a `weigher`, the shapers' weights come from the same forward's LM-head inputs and reshape
    each micro-batch's advantages just before its loss (micro-batches must then hold whole groups)."""

    source: BehaviourSource = "update"

    def __init__(self, shape: torch.Size, device: torch.device, weigher: HiddenWeigher | None = None) -> None:
        self.weigher = weigher
        self.reads_lm_head = weigher is not None
        self._old_logp = torch.zeros(shape, device=device)  # filled micro-batch by micro-batch, for logging
        self._weights = torch.ones(shape) if weigher is not None else None

    def loss_batch(self, inputs: UpdateInputs, rows: torch.Tensor, forward: PolicyForward, updates: int = 0) -> LossBatch:
        old_logp = forward.logp.detach()
        width = old_logp.shape[1]
        self._old_logp[rows, :width] = old_logp
        advantages = None
        if self.weigher is not None:
            response_mask = forward.tensors.response_mask
            hidden = self.weigher.hidden_of(forward.lm_head_in, rows, response_mask)
            weights = self.weigher.weights(hidden, rows.tolist(), width)
            self._weights[rows.cpu(), :width] = weights
            advantages = inputs.advantages[rows, :width] * weights.to(inputs.advantages)
        return select_loss_batch(inputs, rows, forward.tensors, old_logp, advantages)

    def old_logp_all(self) -> torch.Tensor:
        return self._old_logp

    def token_weights(self) -> torch.Tensor | None:
        return self._weights


class ApproximateProximal:
    """θ_old, the proximal policy of decoupled PPO, from each micro-batch's own forward by a proximal-policy
    piece (`pieces/proximal.py`), and the rollout correction's weights of that θ_old against the engine's
    log-probs, both in the update: no pass before it. `versions` [N, T]: the version that sampled each token;
    `version`: the trainer's when the update began."""

    source: BehaviourSource = "proximal"
    reads_lm_head = False

    def __init__(self, approximate: Callable, correct: Callable, versions: torch.Tensor, version: int) -> None:
        self.approximate, self.correct, self.versions, self.version = approximate, correct, versions, version
        self._old_logp = torch.zeros(versions.shape, device=versions.device)  # the last pass's, for logging
        self._stats: dict[str, float] = defaultdict(float)
        self._tokens = 0.0

    def loss_batch(self, inputs: UpdateInputs, rows: torch.Tensor, forward: PolicyForward, updates: int = 0) -> LossBatch:
        width = forward.logp.shape[1]
        behaviour, mask = inputs.tensors.rollout_logp[rows, :width], inputs.loss_mask[rows, :width]
        old_logp = self.approximate(
            ProximalInputs(
                behaviour,
                forward.logp.detach(),
                self.versions[rows, :width],
                self.version,
                self.version + updates,
                mask,
            )
        )
        weight, stats = self.correct(CorrectionInputs(old_logp, behaviour, mask, inputs.advantages[rows, :width]))
        tokens = float(mask.sum())
        for k, v in stats.items():  # token-weighted over the micro-batches of every step
            self._stats[k] += v * tokens
        self._tokens += tokens
        self._old_logp[rows, :width] = old_logp
        return replace(select_loss_batch(inputs, rows, forward.tensors, old_logp), is_weight=weight)

    def old_logp_all(self) -> torch.Tensor:
        return self._old_logp

    def token_weights(self) -> torch.Tensor | None:
        return None

    def metrics(self) -> dict[str, float]:
        """The rollout correction's statistics over the update's micro-batches."""
        return {k: v / max(self._tokens, 1.0) for k, v in self._stats.items()}


@torch.no_grad()
def separate_pass(
    policy: torch.nn.Module,
    ref_policy: torch.nn.Module | None,
    t: RolloutTensors,
    temperature: float,
    micro_batches: Callable[[torch.Tensor, bool], list[torch.Tensor]],
    chunk_tokens: int,
    with_old: bool,
    weigher: HiddenWeigher | None = None,
    lockstep: bool = False,
    packed: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """One no-grad pass over the rollout batch, micro-batch by micro-batch (`micro_batches(rows,
    whole_groups)`, each trimmed to its longest prompt and response): θ_old's log-probs [N, T] (if
    `with_old`), the reference's (if there is a reference policy), and the `weigher`'s token weights [N, T]
    from θ_old's LM-head inputs. With a weigher, micro-batches hold whole groups where the layout sorts rows by length
    (token budgets), and each group is scored as soon as all its rows have been read, so LM-head inputs
    of at most one micro-batch and one partial group wait (in host memory). `lockstep`: several ranks
    shard the policy, so every rank runs the same forwards even where only another rank's rows need one.
    `packed`: each forward runs over the micro-batch's real tokens (`models.packing`)."""
    N, T = t.response_mask.shape
    old = torch.zeros(N, T, device=t.input_ids.device) if with_old else None
    ref = torch.zeros(N, T, device=t.input_ids.device) if ref_policy is not None else None
    weights = torch.ones(N, T) if weigher is not None else None
    waiting: dict[int, torch.Tensor] = {}
    for rows in micro_batches(torch.arange(N, device=t.input_ids.device), weigher is not None):
        mb = t.select(rows).trimmed()
        width = mb.response_mask.shape[1]
        capture = weigher is not None and weigher.needs_any(rows)
        if with_old or capture or (lockstep and weigher is not None):
            forward = policy_forward(
                policy, mb, temperature, capture_lm_head=capture, chunk_tokens=chunk_tokens, packed=packed
            )
            if with_old:
                old[rows, :width] = forward.logp
            if capture:
                found = weigher.hidden_of(forward.lm_head_in, rows, mb.response_mask)
                waiting.update({n: h.to("cpu", copy=True) for n, h in found.items()})
                _weigh_whole_groups(weigher, waiting, weights)
        if ref_policy is not None:
            ref[rows, :width] = policy_forward(
                ref_policy, mb, temperature, chunk_tokens=chunk_tokens, packed=packed
            ).logp
    return old, ref, weights


def _weigh_whole_groups(weigher: HiddenWeigher, waiting: dict[int, torch.Tensor], weights: torch.Tensor) -> None:
    """Score the groups whose every row is in `waiting`, write their weights, and forget them."""
    G = weigher.batch.group_size
    groups = sorted({n // G for n in waiting})
    ready = [n for g in groups if all(g * G + j in waiting for j in range(G)) for n in range(g * G, (g + 1) * G)]
    if not ready:
        return
    hidden = {n: waiting.pop(n) for n in ready}
    weights[ready] = weigher.weights(hidden, ready, weights.shape[1])
