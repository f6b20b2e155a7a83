"""RewardVerifier: binary correctness reward from math-verify, in a persistent pool of worker processes.

At setup it also drops the training and held-out problems whose gold answer math-verify cannot parse,
reported once with their ids: such a problem can never be answered correctly, so scoring it would only
add zero-reward groups to training and wrong zeros to accuracy.
"""

from __future__ import annotations

import logging
from typing import Literal

import lightning as L
import torch

from rlvr_lightning.callbacks.rollout import RolloutCallback
from rlvr_lightning.context import StepContext
from rlvr_lightning.data.sources import ProblemRecord
from rlvr_lightning.errors import ConfigError, check_choice
from rlvr_lightning.rewards.pool import MathVerifier
from rlvr_lightning.rollout.types import Rollout, Verdict

log = logging.getLogger(__name__)


class RewardVerifier(RolloutCallback):
    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        timeout_retry_factor: float = 4.0,
        truncated_is_incorrect: bool = True,
        multiple_boxed: Literal["wrong", "last"] = "wrong",
        strict: bool = True,
    ) -> None:
        """
        Args:
            num_workers: verifier processes (each completion has a hard wall-clock limit).
            timeout_s: a completion whose verification takes longer is killed (its worker is replaced) and
                retried once with `timeout_retry_factor` times the limit; running out of time again, it scores 0.
            timeout_retry_factor: how much longer that retry may take (a loaded machine is slow, and a slow
                verification is not a wrong answer); 0 scores a completion 0 on its first timeout.
            truncated_is_incorrect: a completion cut at max_response_length (no EOS) scores 0, as in
                the Dr. GRPO authors' code (docs/algorithms.md#rollout-and-rewards).
            multiple_boxed: `wrong` requires every boxed answer of a completion to equal the gold (boxing
                several candidates is a cheap way to game a last-box reward); `last` grades the last box only.
            strict: an answer counts only if math-verify reads the whole of it as LaTeX; `false` also accepts
                what its fallbacks pick out of text it cannot parse (`\\boxed{(lambda: 42)()}` reads as 42).
        """
        check_choice("RewardVerifier.multiple_boxed", multiple_boxed, ("wrong", "last"))
        if timeout_retry_factor != 0 and not timeout_retry_factor >= 1:
            raise ConfigError(f"RewardVerifier.timeout_retry_factor={timeout_retry_factor!r}; valid: 0 (no retry) or at least 1")
        self.timeout_retry_factor = timeout_retry_factor
        self.multiple_boxed = multiple_boxed
        self.strict = strict
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.truncated_is_incorrect = truncated_is_incorrect
        self.verifier: MathVerifier | None = None
        self.total_timeouts = 0
        self._reported: set[str] = set()  # sources whose unparseable golds were already reported

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._ensure_verifier()
        dm = trainer.datamodule
        if dm is not None and hasattr(dm, "train_records"):
            dm.train_records = self.drop_unparseable_golds(dm.train_records, "data.train_data")
            dm.val_records = self.drop_unparseable_golds(dm.val_records, "data.val_data")
            if len(dm.train_records) < dm.hparams.batch_size:
                raise ConfigError(
                    f"data.train_data has {len(dm.train_records)} problems with a gold answer the verifier can "
                    f"parse, fewer than data.batch_size={dm.hparams.batch_size}"
                )

    def _ensure_verifier(self) -> MathVerifier:
        if self.verifier is None:
            self.verifier = MathVerifier(
                num_workers=self.num_workers,
                timeout_s=self.timeout_s,
                timeout_retry_factor=self.timeout_retry_factor,
                multiple_boxed=self.multiple_boxed,
                strict=self.strict,
            )
        return self.verifier

    def drop_unparseable_golds(self, records: list[ProblemRecord], where: str) -> list[ProblemRecord]:
        """`records` without those whose gold answer cannot be parsed, reported once (count and ids)."""
        if not records:
            return records
        ok = self._ensure_verifier().parseable_golds([r.answer for r in records])
        bad = [r for r, good in zip(records, ok) if not good]
        # Once per source: the held-out set passes here from this callback and from Evaluation, in
        # whichever order the callbacks were configured.
        if bad and where not in self._reported:
            self._reported.add(where)
            log.warning(
                "%s: skipped %d of %d problems whose gold answer the verifier cannot parse, e.g. %s",
                where,
                len(bad),
                len(records),
                ", ".join(f"{r.id}: {r.answer[:40]!r}" for r in bad[:5]),
            )
        return [r for r, good in zip(records, ok) if good]

    def describe(self) -> str:
        """The verifier's pool and its timeouts so far, for the watchdog's report."""
        pool = self.verifier.describe() if self.verifier is not None else "math-verify pool not started"
        return f"{pool}; {self.total_timeouts} answers timed out so far"

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker pool (a later score starts a new one)."""
        if self.verifier is not None:
            self.verifier.close()
            self.verifier = None

    def score(self, golds: list[str], texts: list[str], truncated: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Correctness c ∈ {0,1} per completion, and verifier metrics."""
        result = self._ensure_verifier().verify(golds, texts)
        correct = torch.tensor(result.rewards, dtype=torch.float32)
        if self.truncated_is_incorrect:
            correct = correct * (~truncated).float()
        self.total_timeouts += result.num_timeouts
        n = max(1, len(texts))
        metrics = {
            "verifier_timeouts": float(result.num_timeouts),
            "verifier_timeouts_total": float(self.total_timeouts),
            # Failures of the verifier's worker pool that a retry got past; one it cannot get past raises.
            "verifier_errors": float(result.num_errors),
            "no_answer_frac": result.num_no_answer / n,
            "multiple_boxed_frac": result.num_multiple_boxed / n,
            "verifier_completions_per_s": len(texts) / max(result.seconds, 1e-9),
        }
        return correct, metrics

    def on_rollout_generated(self, step: StepContext, rollout: Rollout) -> Verdict:
        correct, metrics = self.score(rollout.answers_per_sequence, list(rollout.answer_texts), rollout.truncated)
        return Verdict(correct, metrics)
