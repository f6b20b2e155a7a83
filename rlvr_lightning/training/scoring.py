"""The scoring stage: correctness c of each answer from its source (math-verify by default, the environment, or a
user's function), the user's reward terms, their metrics, and how much correctness counts in the reward
(`rewards.settings.RewardSettings`). A plain object the module owns, as it owns its engine session: the step and
evaluation score with it, and it keeps math-verify's worker pool between rollout batches."""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from rlvr_lightning.data.sources import ProblemRecord
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rewards.loading import load_function
from rlvr_lightning.rewards.pool import MathVerifier
from rlvr_lightning.rewards.settings import ENVIRONMENT, MATH_VERIFY, RewardSettings
from rlvr_lightning.rollout.types import Rollout, Verdict

log = logging.getLogger(__name__)


class Scoring:
    def __init__(self, settings: RewardSettings | None = None) -> None:
        self.settings = settings or RewardSettings()
        self.settings.check()
        self._verifier: MathVerifier | None = None
        self._loaded: tuple[Callable | None, list[Callable]] | None = None
        self.total_timeouts = 0
        self._reported: set[str] = set()  # sources whose unparseable golds were already reported
        self.load()  # a function that cannot be imported is one error line when the run is configured

    # ---- what runs ---------------------------------------------------------------------------------------------
    def load(self) -> tuple[Callable | None, list[Callable]]:
        """The user's correctness function (None: math-verify's or the environment's) and reward functions, imported
        once; one that cannot be imported is one error line (a run loads them before it starts)."""
        if self._loaded is None:
            own = self.settings.correctness not in (MATH_VERIFY, ENVIRONMENT)
            correctness = load_function(self.settings.correctness, "model.rewards.correctness") if own else None
            self._loaded = correctness, [load_function(f.function, "model.rewards.functions") for f in self.settings.functions]
        return self._loaded

    @property
    def verifier(self) -> MathVerifier:
        if self._verifier is None:
            v = self.settings.verifier
            self._verifier = MathVerifier(num_workers=v.num_workers, timeout_s=v.timeout_s,
                                          timeout_retry_factor=v.timeout_retry_factor, multiple_boxed=v.multiple_boxed,
                                          strict=v.strict)  # fmt: skip
        return self._verifier

    # ---- scoring -----------------------------------------------------------------------------------------------
    def score(self, rollout: Rollout, rollout_batch: int = 0, rank: int = 0) -> Rollout:
        """The rollout with its correctness, reward terms and metrics, and the weight of correctness in its reward."""
        correctness, functions = self.load()
        needed = correctness is not None or functions  # what a user's function is told; math-verify needs none of it
        metadata = answer_metadata(rollout, rollout_batch, rank) if needed else None
        correct, metrics = self.correctness(rollout, metadata)
        return self.with_terms(rollout, correct, metrics, metadata)

    def with_terms(
        self, rollout: Rollout, correct: torch.Tensor, metrics: dict[str, float] | None = None,
        metadata: list[dict] | None = None,
    ) -> Rollout:  # fmt: skip
        """The rollout with correctness `correct` [N] (given, not computed again: the held-out samples table's), each
        reward term on its answers, the metrics, and the weight of correctness in its reward."""
        if metadata is None and self.load()[1]:
            metadata = answer_metadata(rollout)
        terms, term_metrics = self.reward_terms(rollout, metadata)
        scored = rollout.scored(Verdict(correct, {**(metrics or {}), **term_metrics}, terms))
        if self.settings.correctness == ENVIRONMENT:  # its verdict is c, not a term beside it
            scored = replace(scored, reward_terms={k: v for k, v in scored.reward_terms.items() if k != ENVIRONMENT})
        return replace(scored, correctness_weight=self.settings.correctness_weight)

    def correctness(self, rollout: Rollout, metadata: list[dict] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """c [N] of the rollout's answers, and its metrics."""
        source = self.settings.correctness
        if source == MATH_VERIFY:
            return self.verify(rollout.answers_per_sequence, list(rollout.answer_texts), rollout.truncated)
        if source == ENVIRONMENT:
            given = rollout.reward_terms.get(ENVIRONMENT)
            if given is None:
                raise ConfigError("model.rewards.correctness=environment: the environment gave no verdict on the answers")
            return checked_correctness(given.float(), "the environment"), {}
        own, _ = self.load()
        metadata = metadata or answer_metadata(rollout)
        values = [call(own, source, rollout.answer_texts[n], rollout.answers_per_sequence[n], metadata[n])[0]
                  for n in range(rollout.num_sequences)]  # fmt: skip
        return checked_correctness(torch.tensor(values, dtype=torch.float32), source), {}

    def verify(self, golds: list[str], texts: list[str], truncated: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """math-verify's c ∈ {0, 1} per answer against its gold, and the verifier's metrics (evaluation's too)."""
        result = self.verifier.verify(golds, texts)
        correct = torch.tensor(result.rewards, dtype=torch.float32)
        if self.settings.verifier.truncated_is_incorrect:
            correct = correct * (~truncated).float()
        self.total_timeouts += result.num_timeouts
        n = max(1, len(texts))
        return correct, {
            "verifier_timeouts": float(result.num_timeouts),
            "verifier_timeouts_total": float(self.total_timeouts),
            "verifier_errors": float(result.num_errors),  # pool failures a retry got past
            "no_answer_frac": result.num_no_answer / n,
            "multiple_boxed_frac": result.num_multiple_boxed / n,
            "verifier_completions_per_s": len(texts) / max(result.seconds, 1e-9),
        }

    def reward_terms(self, rollout: Rollout, metadata: list[dict] | None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Each reward function's weighted term [N] and its metrics (its unweighted mean, and its own)."""
        _, functions = self.load()
        terms, metrics = {}, {}
        for spec, fn in zip(self.settings.functions, functions):
            values, extra = [], {}
            for n in range(rollout.num_sequences):
                value, own = call(fn, spec.function, rollout.answer_texts[n], rollout.answers_per_sequence[n], metadata[n])
                values.append(value)
                for key, v in own.items():
                    extra.setdefault(key, []).append(float(v))
            raw = torch.tensor(values)
            terms[spec.term] = spec.weight * raw
            metrics[f"reward_{spec.term}_mean"] = raw.mean().item()
            metrics.update({f"reward_{spec.term}_{key}": sum(v) / len(v) for key, v in extra.items()})
        return terms, metrics

    # ---- the run around it -------------------------------------------------------------------------------------
    def drop_unparseable_golds(self, records: list[ProblemRecord], where: str) -> list[ProblemRecord]:
        """`records` without those whose gold math-verify cannot parse, reported once per `where` (count and ids);
        all of them where another source gives correctness (it reads golds its own way)."""
        if not records or self.settings.correctness != MATH_VERIFY:
            return records
        ok = self.verifier.parseable_golds([r.answer for r in records])
        bad = [r for r, good in zip(records, ok) if not good]
        if bad and where not in self._reported:  # the held-out set passes here from the module and from Evaluation
            self._reported.add(where)
            log.warning("%s: skipped %d of %d problems whose gold answer the verifier cannot parse, e.g. %s", where,
                        len(bad), len(records), ", ".join(f"{r.id}: {r.answer[:40]!r}" for r in bad[:5]))  # fmt: skip
        return [r for r, good in zip(records, ok) if good]

    def describe(self) -> str:
        """The verifier's pool and its timeouts so far, for the watchdog's report."""
        pool = self._verifier.describe() if self._verifier is not None else "math-verify pool not started"
        return f"{pool}; {self.total_timeouts} answers timed out so far"

    def close(self) -> None:
        """Stop math-verify's worker pool (a later score starts a new one)."""
        if self._verifier is not None:
            self._verifier.close()
            self._verifier = None


def answer_metadata(rollout: Rollout, rollout_batch: int = 0, rank: int = 0) -> list[dict[str, Any]]:
    """What a user's function is told of each answer besides its text and gold (`index`: its place in the scored
    batch, the G answers to a prompt side by side)."""
    truncated = rollout.truncated.tolist()
    return [{"id": rollout.batch.ids[rollout.group_of(n)], "prompt": rollout.batch.prompts[rollout.group_of(n)],
             "truncated": truncated[n], "response_tokens": len(rollout.completions[n].token_ids),
             "rollout_batch": rollout_batch, "rank": rank, "index": n} for n in range(rollout.num_sequences)]  # fmt: skip


def call(fn: Callable, path: str, text: str, gold: str, metadata: dict) -> tuple[float, dict]:
    """A user's function on one answer: its value, and its own metrics; a failure or a value that is not a finite
    number is one error line naming it (at the first rollout batch: nothing is lost)."""
    try:
        out = fn(text, gold, metadata)
    except Exception as err:  # the user's function, not the library: said in one line, naming it
        raise ConfigError(f"reward function {path} failed on a completion ({type(err).__name__}: {err})") from None
    value, own = out if isinstance(out, tuple) else (out, {})
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(f"reward function {path} returned {value!r}: a reward must be a finite number")
    return float(value), own


def checked_correctness(c: torch.Tensor, source: str) -> torch.Tensor:
    if ((c < 0) | (c > 1)).any():
        raise ConfigError(f"model.rewards.correctness: {source} gave {c[(c < 0) | (c > 1)][0].item()}; correctness is in [0, 1]")
    return c
