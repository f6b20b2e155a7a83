"""RewardVerifier: binary correctness reward from math-verify, in a persistent pool of worker processes."""

from __future__ import annotations

import lightning as L
import torch

from rlvr_lightning.algos.base import RLVRModule, RolloutCallback
from rlvr_lightning.rewards.math import MathVerifier
from rlvr_lightning.rollout.types import Rollout


class RewardVerifier(RolloutCallback):
    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        truncated_is_incorrect: bool = True,
    ) -> None:
        """
        Args:
            num_workers: verifier processes (each completion has a hard wall-clock limit).
            timeout_s: a completion whose verification takes longer gets reward 0; its worker is replaced.
            truncated_is_incorrect: a completion cut at max_response_length (no EOS) scores 0, as in
                the Dr. GRPO authors' code and ALGORITHMS.md §0.2.
        """
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.truncated_is_incorrect = truncated_is_incorrect
        self.verifier: MathVerifier | None = None
        self.total_timeouts = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.verifier is None:
            self.verifier = MathVerifier(num_workers=self.num_workers, timeout_s=self.timeout_s)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.verifier is not None:
            self.verifier.close()
            self.verifier = None

    def score(self, golds: list[str], texts: list[str], truncated: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Correctness c ∈ {0,1} per completion, and verifier metrics."""
        if self.verifier is None:
            self.verifier = MathVerifier(num_workers=self.num_workers, timeout_s=self.timeout_s)
        result = self.verifier.verify(golds, texts)
        correct = torch.tensor(result.rewards, dtype=torch.float32)
        if self.truncated_is_incorrect:
            correct = correct * (~truncated).float()
        self.total_timeouts += result.num_timeouts
        n = max(1, len(texts))
        metrics = {
            "verifier_timeouts": float(result.num_timeouts),
            "verifier_timeouts_total": float(self.total_timeouts),
            "no_answer_frac": result.num_no_answer / n,
            "verifier_completions_per_s": len(texts) / max(result.seconds, 1e-9),
        }
        return correct, metrics

    def on_rollout_generated(self, trainer: L.Trainer, module: RLVRModule, rollout: Rollout) -> None:
        correct, metrics = self.score(rollout.answers_per_sequence, rollout.texts, rollout.truncated)
        rollout.correct = correct
        rollout.rewards = correct.clone()  # r = c; algorithms that shape rewards do so in compute_advantages
        rollout.metrics.update(metrics)
