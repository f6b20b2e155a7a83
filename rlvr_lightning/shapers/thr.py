"""THR (arXiv 2510.03669, docs/algorithms.md#thr) as an advantage shaper: under θ_old and without grad, score every
response token of each mixed group by its Token Hidden Reward and weight its advantage so that
Â' = Â·(1 + p·sign(THR)) on dominant tokens. p > 0 favours exploitation (greedy accuracy), p < 0
exploration (pass@k). The LM-head inputs come from a forward the step runs anyway: the θ_old pass,
or, with one update per rollout batch, the update's own forward (no extra transformer pass).
Configured by `model.shapers.thr` (`shapers.settings.THRSettings`).
"""

from __future__ import annotations

import torch
from torchmetrics.functional import spearman_corrcoef

from rlvr_lightning.attribution.thr import dominant_tokens, rollout_thr, thr_token_weights
from rlvr_lightning.context import AdvantageShaper, ScoredBatch, StepContext
from rlvr_lightning.metrics import RunningStats, StreamSample
from rlvr_lightning.models.lm_head import PolicyHead
from rlvr_lightning.pieces.advantages import mixed_groups
from rlvr_lightning.shapers.settings import THRSettings


class THRShaper(AdvantageShaper):
    weighs_sampled_tokens_only = True  # `attribution.thr.rollout_thr` scores the sampled tokens; inserted ones weigh 1

    def __init__(self, settings: THRSettings) -> None:
        settings.check()
        self.settings = settings

    @property
    def is_identity(self) -> bool:
        return self.settings.p == 0.0 and self.settings.mode == "reweight"

    def hidden_rows(self, batch: ScoredBatch) -> torch.Tensor | None:
        rollout = batch.rollout
        if self.is_identity:  # the base algorithm, bit for bit: no scores, no extra work
            return None
        return mixed_groups(rollout.correct.float(), rollout.group_size).repeat_interleave(rollout.group_size)

    def token_weights(self, step: StepContext, batch: ScoredBatch) -> None:
        """A new rollout batch: its THR statistics start empty. THR's weights come from θ_old's LM-head
        inputs (`weights_from_hidden`, a few groups per call); the batch's `thr/*` metrics are computed
        once, when its last mixed group has been scored, or here when no group is mixed (same keys)."""
        self._metrics = {}
        if self.is_identity:
            return None
        rollout = batch.rollout
        self._stats, self._sample = RunningStats(), StreamSample(seed=step.rollout_batch)  # |THR|, entropy
        self._unscored = set(mixed_groups(rollout.correct.float(), rollout.group_size).nonzero().squeeze(1).tolist())
        if not self._unscored:
            self._metrics = thr_metrics(self._stats, self._sample)
        return None

    def batch_metrics(self) -> dict[str, float]:
        return getattr(self, "_metrics", {})

    @torch.no_grad()
    def weights_from_hidden(
        self, step: StepContext, batch: ScoredBatch, hidden: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """Weights of the mixed groups in `hidden` (a few whole groups per call)."""
        G, s = batch.group_size, self.settings
        weights: dict[int, torch.Tensor] = {}
        lm_head = PolicyHead(step.policy)  # the logits the policy's forward returns, its family's transform included
        unscored_before = len(self._unscored)
        for gs in rollout_thr(batch.rollout, batch.advantages, hidden, lm_head, s.chunk_size):
            dominant = dominant_tokens(
                gs.scores, gs.thr, gs.seq, gs.correct, s.threshold, s.beta_anchor, s.quantile, s.thr_abs
            )
            w = thr_token_weights(gs.thr, dominant, s.p, s.mode).cpu()
            lengths = [len(batch.rollout.completions[gs.group * G + j].token_ids) for j in range(G)]
            weights.update({gs.group * G + j: w_j for j, w_j in enumerate(gs.per_response(w, lengths, fill=1.0))})
            thr = gs.thr.cpu()
            self._stats.add(dominant=dominant.cpu(), positive=thr > 0, negative=thr < 0, abs=thr.abs())
            self._sample.add(thr.abs(), gs.entropy.float().cpu())  # jointly: the Spearman needs the pairs
            self._unscored.discard(gs.group)
        if unscored_before and not self._unscored:  # the batch's last mixed group (each arrives once)
            self._metrics = thr_metrics(self._stats, self._sample)
        return weights


def thr_metrics(stats: RunningStats, sample: StreamSample) -> dict[str, float]:
    """Logged per rollout batch over the tokens of mixed groups (docs/algorithms.md#thr-in-the-training-step):
    counts, fractions and the maximum exact from `stats` (streams dominant, positive, negative, abs);
    quantiles of |THR| and its Spearman correlation with the entropy from `sample` (columns |THR|,
    entropy), which is every token while the batch has at most `sample.capacity` of them."""
    if stats.count == 0:  # no mixed group in this batch: same keys, so dashboards keep one series
        keys = ("dominant_frac", "positive_frac", "negative_frac", "abs_p50", "abs_p90", "abs_p99", "abs_max")
        return {"thr/tokens": 0.0, **{f"thr/{k}": 0.0 for k in keys}, "thr/abs_entropy_spearman": 0.0}
    mag, entropy = sample.columns()
    q = sample.quantiles([0.5, 0.9, 0.99])
    return {
        "thr/tokens": float(stats.count),
        "thr/dominant_frac": stats.mean("dominant"),
        "thr/positive_frac": stats.mean("positive"),
        "thr/negative_frac": stats.mean("negative"),
        "thr/abs_p50": q[0].item(),
        "thr/abs_p90": q[1].item(),
        "thr/abs_p99": q[2].item(),
        "thr/abs_max": stats.max("abs"),
        "thr/abs_entropy_spearman": spearman_corrcoef(mag, entropy).item() if mag.numel() > 1 else 0.0,
    }
