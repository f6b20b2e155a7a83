"""Data passed along one training step: the prompt batch, the sampling settings, and the rollout."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType

import torch


@dataclass
class PromptBatch:
    """What the dataloader yields: B prompts (already templated text), their gold answers and ids."""

    ids: list[str]
    prompts: list[str]
    answers: list[str]

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, idx: list[int]) -> PromptBatch:
        return PromptBatch([self.ids[i] for i in idx], [self.prompts[i] for i in idx], [self.answers[i] for i in idx])

    @staticmethod
    def concat(batches: list[PromptBatch]) -> PromptBatch:
        return PromptBatch(
            [x for b in batches for x in b.ids],
            [x for b in batches for x in b.prompts],
            [x for b in batches for x in b.answers],
        )


@dataclass(frozen=True)
class SamplingConfig:
    group_size: int = 8  # completions per prompt (vLLM's `n`)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_tokens: int = 32
    seed: int | None = None
    stop: tuple[str, ...] = ()  # text that ends a completion where the engine honours it (a tool call's marker)


@dataclass
class Completion:
    token_ids: list[int]  # generated tokens, EOS included when the model stopped on it
    logprobs: list[float]  # engine log-prob of each generated token, log_softmax(logits / T)
    finish_reason: str  # "stop" (EOS) or "length" (truncated)
    # The policy version that sampled each token, where a sequence was continued across weight syncs
    # (partial rollouts); empty: every token by its rollout's `policy_version`.
    versions: list[int] = field(default_factory=list)
    # True on each token the policy sampled, False on one an environment inserted (a tool's output, tokenized by
    # the library; its log-prob entry is 0), one per token of `token_ids`. Left out, every token is one the engine
    # sampled. Inserted tokens are context for the tokens after them and nothing else: no loss, no KL, no entropy,
    # no attribution weight, no normaliser count (`RolloutTensors.sampled_mask` carries it to the loss).
    sampled_mask: list[bool] = None  # type: ignore[assignment]  # filled in by __post_init__
    # Why a stability guard leaves this completion out of the loss (a tool run's `drop_*`); "": it trains.
    excluded: str = ""
    # What happened in an answer given in turns, in order (`environments.episodes.Episode.events`): each model turn
    # {"kind": "turn", "tokens": [start, end), "ns": [t0, t1], "stopped_at"} and each environment reply {"kind":
    # "reply", "tokens", "ns", "stop", "reward", "calls": [its calls, as dicts once saved]}; empty for an answer in
    # one piece. What its trace in MLflow shows (`callbacks.episode_traces`); wall-clock times, so not compared.
    events: list[dict] = field(default_factory=list, compare=False)

    def __post_init__(self) -> None:
        if self.sampled_mask is None:
            self.sampled_mask = [True] * len(self.token_ids)
        elif len(self.sampled_mask) != len(self.token_ids):
            raise ValueError(f"a completion's sampled_mask has {len(self.sampled_mask)} entries for its "
                             f"{len(self.token_ids)} tokens")  # fmt: skip

    @staticmethod
    def from_state(state: Mapping) -> Completion:
        """A completion saved as a dict of its fields (a stream's checkpoint). One saved before `sampled_mask`
        holds `sampled` instead: 1/0 per token, or empty where every token was sampled."""
        state = dict(state)
        if "sampled" in state:
            legacy = state.pop("sampled")
            state["sampled_mask"] = [bool(s) for s in legacy] if legacy else None
        return Completion(**state)

    def versions_or(self, version: int) -> list[int]:
        return self.versions or [version] * len(self.token_ids)

    @property
    def num_sampled(self) -> int:
        return sum(self.sampled_mask)

    @property
    def has_inserted(self) -> bool:
        """Whether an environment inserted any of its tokens."""
        return not all(self.sampled_mask)


@dataclass(frozen=True)
class Verdict:
    """What a scorer (the reward verifier) returns for a rollout batch: correctness c ∈ {0, 1} per sequence
    and its metrics. The algorithm turns it into its reward (r = c, or DAPO's shaping: `ScoredBatch`)."""

    correct: torch.Tensor | None  # [N]; None: this scorer leaves correctness to another (the verifier)
    metrics: Mapping[str, float] = field(default_factory=dict)
    # Named [N] reward terms, weighted, that the algorithm adds to its reward (a user's reward functions).
    reward_terms: Mapping[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Rollout:
    """B·G completions of one rollout batch, stored group-contiguously (sequence n = b·G + j).

    Ragged token lists come from the engine; `tensors()` lays them out as the trainer needs them:
    prompts left-padded, responses right-padded, explicit position ids (the positions the engine
    used), so trainer log-probs line up with the engine's token for token.

    A value: nothing writes into it once made (its fields cannot be assigned, its sequences are tuples and
    its metrics a read-only mapping). Scoring and the stream's bookkeeping make new ones (`scored`,
    `with_metrics`).
    """

    batch: PromptBatch
    group_size: int
    prompt_ids: tuple[list[int], ...]  # per prompt (B)
    completions: tuple[Completion, ...]  # per sequence (B·G)
    sampling: SamplingConfig
    policy_version: int
    texts: tuple[str, ...] = ()  # decoded completions (B·G)
    # The model's own words where a tool inserted text into a completion (its sampled tokens only, decoded):
    # what the reward reads, so that a tool's output cannot answer for the model; empty: `texts`.
    own_texts: tuple[str, ...] = ()
    correct: torch.Tensor | None = None  # [N] the verifier's verdict c ∈ {0,1}; None until scored
    metrics: Mapping[str, float] = field(default_factory=dict)  # generation's and the verifier's
    reward_terms: Mapping[str, torch.Tensor] = field(default_factory=dict)  # [N] each, added to the reward
    correctness_weight: float = 1.0  # w_c: how much correctness counts in the reward (`model.rewards`)

    def __post_init__(self) -> None:
        for name in ("prompt_ids", "completions", "texts", "own_texts"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("metrics", "reward_terms"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    def __getstate__(self) -> dict:  # a read-only mapping does not pickle: its dict does
        return {**self.__dict__, "metrics": dict(self.metrics), "reward_terms": dict(self.reward_terms)}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        for name in ("metrics", "reward_terms"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name, {}))))

    def scored(self, verdict: Verdict) -> Rollout:
        """The rollout with a scorer's verdict (its correctness, if it gives one; its reward terms) and metrics."""
        correct = self.correct if verdict.correct is None else verdict.correct
        terms = {**self.reward_terms, **verdict.reward_terms}
        return replace(self, correct=correct, metrics={**self.metrics, **verdict.metrics}, reward_terms=terms)

    def reward_with_terms(self, reward: torch.Tensor) -> torch.Tensor:
        """The reward from correctness, `reward` [N] (c, or DAPO's ±1), weighted by w_c, plus every reward term:
        r = w_c · reward + Σᵢ wᵢ · fᵢ (`reward` itself where w_c = 1 and there is no term)."""
        if self.correctness_weight != 1.0:
            reward = self.correctness_weight * reward
        for term in self.reward_terms.values():
            reward = reward + term.to(reward.dtype)
        return reward

    def with_metrics(self, metrics: Mapping[str, float]) -> Rollout:
        """The rollout with more metrics (dynamic sampling's, the stream's)."""
        return replace(self, metrics={**self.metrics, **metrics})

    @property
    def num_sequences(self) -> int:
        return len(self.completions)

    def group_of(self, n: int) -> int:
        return n // self.group_size

    @property
    def answer_texts(self) -> tuple[str, ...]:
        """What the reward reads of each completion: the model's own words (`own_texts`, else `texts`)."""
        return self.own_texts or self.texts

    @property
    def answers_per_sequence(self) -> list[str]:
        return [self.batch.answers[self.group_of(n)] for n in range(self.num_sequences)]

    @property
    def truncated(self) -> torch.Tensor:
        return torch.tensor([c.finish_reason == "length" for c in self.completions])

    @property
    def excluded(self) -> torch.Tensor:
        """[N] the completions a stability guard leaves out of the loss (`Completion.excluded`)."""
        return torch.tensor([bool(c.excluded) for c in self.completions])

    def with_token_versions(self) -> Rollout:
        """The same rollout with every completion's per-token versions written out."""
        completions = [replace(c, versions=c.versions_or(self.policy_version)) for c in self.completions]
        return replace(self, completions=completions)

    def token_versions(self, width: int) -> torch.Tensor:
        """[N, width] the policy version that sampled each response token (padding: the rollout's)."""
        out = torch.full((self.num_sequences, width), self.policy_version, dtype=torch.long)
        for n, c in enumerate(self.completions):
            if c.versions:
                out[n, : len(c.versions)] = torch.tensor(c.versions[:width])
        return out

    def staleness(self, trainer_version: int) -> dict[str, float]:
        """How many versions older than the trainer's the sampler of each response token was: mean, max."""
        ages = [trainer_version - v for c in self.completions for v in c.versions_or(self.policy_version)]
        return {"staleness_mean": sum(ages) / max(1, len(ages)), "staleness_max": float(max(ages, default=0))}

    @property
    def response_lengths(self) -> torch.Tensor:
        return torch.tensor([len(c.token_ids) for c in self.completions], dtype=torch.float32)

    def select_groups(self, groups: list[int]) -> Rollout:
        """The rollout restricted to whole groups, e.g. DAPO's kept groups."""
        G = self.group_size
        seqs = [g * G + j for g in groups for j in range(G)]
        pick = torch.tensor(seqs, dtype=torch.long)
        return Rollout(
            batch=self.batch.select(groups),
            group_size=G,
            prompt_ids=[self.prompt_ids[g] for g in groups],
            completions=[self.completions[n] for n in seqs],
            sampling=self.sampling,
            policy_version=self.policy_version,
            texts=[self.texts[n] for n in seqs] if self.texts else (),
            own_texts=[self.own_texts[n] for n in seqs] if self.own_texts else (),
            correct=None if self.correct is None else self.correct[pick],
            metrics=self.metrics,
            reward_terms={k: v[pick] for k, v in self.reward_terms.items()},
        )

    @staticmethod
    def concat(rollouts: list[Rollout]) -> Rollout:
        """Several scored rollouts as one (DAPO's generation rounds). Parts sampled by different policy versions
        (a round generated ahead, the rounds refilling it now) keep each token's version; the whole's
        `policy_version` is the oldest.

        Metrics become sequence-weighted means over the parts, except running totals (`*_total`),
        which keep their latest value.
        """
        first = rollouts[0]
        if any(r.group_size != first.group_size for r in rollouts):
            raise ValueError("can only concatenate rollouts with the same group size")
        if len({r.policy_version for r in rollouts}) > 1:
            rollouts = [r.with_token_versions() for r in rollouts]
        metrics: dict[str, float] = {}
        weights = [r.num_sequences for r in rollouts]
        for key in {k for r in rollouts for k in r.metrics}:
            present = [(r.metrics[key], w) for r, w in zip(rollouts, weights) if key in r.metrics]
            if key.endswith("_total"):
                metrics[key] = present[-1][0]
            else:
                metrics[key] = sum(v * w for v, w in present) / max(1, sum(w for _, w in present))

        def cat(name: str) -> torch.Tensor | None:
            parts = [getattr(r, name) for r in rollouts]
            return None if any(p is None for p in parts) else torch.cat(parts)

        return Rollout(
            batch=PromptBatch.concat([r.batch for r in rollouts]),
            group_size=first.group_size,
            prompt_ids=[p for r in rollouts for p in r.prompt_ids],
            completions=[c for r in rollouts for c in r.completions],
            sampling=first.sampling,
            policy_version=min(r.policy_version for r in rollouts),
            texts=[t for r in rollouts for t in r.texts],
            own_texts=[t for r in rollouts for t in r.answer_texts] if any(r.own_texts for r in rollouts) else (),
            correct=cat("correct"),
            metrics=metrics,
            reward_terms={k: torch.cat([r.reward_terms[k] for r in rollouts]) for k in first.reward_terms},
        )

    def tensors(self, pad_id: int) -> RolloutTensors:
        G = self.group_size
        T = max(1, max(len(c.token_ids) for c in self.completions))
        prompts = [self.prompt_ids[n // G] for n in range(self.num_sequences)]
        prompt_ids, prompt_attention = left_padded(prompts, pad_id)
        N, P = prompt_ids.shape
        response_ids = torch.full((N, T), pad_id, dtype=torch.long)
        response_mask = torch.zeros((N, T), dtype=torch.float32)
        rollout_logp = torch.zeros((N, T), dtype=torch.float32)
        sampled_mask = torch.zeros((N, T), dtype=torch.float32)
        for n, comp in enumerate(self.completions):
            L = len(comp.token_ids)
            if L:
                response_ids[n, :L] = torch.tensor(comp.token_ids)
                response_mask[n, :L] = 1.0
                rollout_logp[n, :L] = torch.tensor(comp.logprobs, dtype=torch.float32)
                sampled_mask[n, :L] = torch.tensor(comp.sampled_mask, dtype=torch.float32)
        input_ids = torch.cat([prompt_ids, response_ids], 1)
        attention_mask = torch.cat([prompt_attention, response_mask.long()], 1)
        return RolloutTensors(
            input_ids, attention_mask, position_ids(attention_mask), response_mask, rollout_logp, P, sampled_mask
        )


def left_padded(
    sequences: list[list[int]], pad_id: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [n, W] with every sequence right-aligned to the longest (W), and the attention mask.

    Decoder-only models generate and score at the right end, so prompts (and OAR's scoring inputs)
    are padded on the left; `position_ids` then restarts the positions at each first real token."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, seq in enumerate(sequences):
        if seq:
            ids[i, width - len(seq) :] = torch.tensor(seq)
            attention[i, width - len(seq) :] = 1
    return ids.to(device), attention.to(device)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """The positions the engine used: 0 at each sequence's first real token, padding clamped to 0."""
    return (attention_mask.cumsum(1) - 1).clamp(min=0)


@dataclass
class RolloutTensors:
    input_ids: torch.Tensor  # [N, P+T]
    attention_mask: torch.Tensor  # [N, P+T]
    position_ids: torch.Tensor  # [N, P+T]
    response_mask: torch.Tensor  # [N, T]  1 on response tokens (EOS included)
    rollout_logp: torch.Tensor  # [N, T]  engine log-probs, 0 on padding
    prompt_width: int  # P: responses start at this column of input_ids
    # [N, T] 1 on the response tokens the policy sampled (`Completion.sampled_mask`), 0 on those an environment
    # inserted (context, in `response_mask`) and on padding. The loss's mask starts from it (`UpdateInputs.loss_mask`
    # also leaves out what the run masks: truncated or excluded completions).
    sampled_mask: torch.Tensor

    def _map(self, fn) -> RolloutTensors:
        mapped = {f.name: getattr(self, f.name) for f in fields(self)}
        return RolloutTensors(**{k: v if k == "prompt_width" else fn(v) for k, v in mapped.items()})

    def select(self, idx: torch.Tensor) -> RolloutTensors:
        return self._map(lambda t: t[idx])

    def to(self, device: torch.device) -> RolloutTensors:
        return self._map(lambda t: t.to(device))

    def trimmed(self) -> RolloutTensors:
        """The same sequences without the columns that are padding in every row: the prompt columns
        left of the longest prompt and the response columns right of the longest response (at least
        one). Positions and masks of the real tokens are unchanged, so are their log-probs."""
        P = self.prompt_width
        lead = P - int(self.attention_mask[:, :P].sum(1).max())
        width = max(1, int(self.response_mask.sum(1).max()))
        cols = slice(lead, P + width)
        return RolloutTensors(
            self.input_ids[:, cols],
            self.attention_mask[:, cols],
            self.position_ids[:, cols],
            self.response_mask[:, :width],
            self.rollout_logp[:, :width],
            P - lead,
            self.sampled_mask[:, :width],
        )

    @property
    def lengths(self) -> torch.Tensor:
        """[N] real tokens (prompt + response) of each sequence, on the host."""
        return self.attention_mask.sum(1).cpu()

    @property
    def token_counts(self) -> torch.Tensor:
        """[N, 2] real prompt and response tokens of each sequence, on the host: a trimmed selection of
        rows spans its longest prompt plus its longest response (what token budgets must count)."""
        prompt = self.attention_mask[:, : self.prompt_width].sum(1)
        return torch.stack([prompt, self.response_mask.sum(1).to(prompt.dtype)], 1).cpu()
