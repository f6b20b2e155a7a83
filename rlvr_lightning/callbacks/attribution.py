"""Attribution callbacks: per-token reshaping of the advantages before the policy update.

`THRAttribution` (arXiv 2510.03669, ALGORITHMS.md §2.6): once per rollout batch, under θ_old and
without grad, score every response token of each mixed group by its Token Hidden Reward and
write `rollout.token_weights` so that Â' = Â·(1 + p·sign(THR)) on dominant tokens. p > 0 favours
exploitation (greedy accuracy), p < 0 exploration (pass@k). The hidden states come from the θ_old
forward the module runs anyway (no extra transformer pass).
"""

from __future__ import annotations

import lightning as L
import torch
from torchmetrics.functional import spearman_corrcoef

from rlvr_lightning.advantages import mixed_groups
from rlvr_lightning.algos.base import RLVRModule, RolloutCallback
from rlvr_lightning.attribution.thr import ReweightMode, ThresholdMode, dominant_tokens, rollout_thr, thr_token_weights
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rollout.types import Rollout


class THRAttribution(RolloutCallback):
    def __init__(
        self,
        p: float = 0.0,
        threshold: ThresholdMode = "anchor",
        beta_anchor: float = 1.0,
        quantile: float = 0.8,
        thr_abs: float | None = None,
        mode: ReweightMode = "reweight",
        chunk_size: int = 1024,
    ) -> None:
        """
        Args:
            p: reweighting strength in [−1, 1]; > 0 amplifies THR > 0 tokens (exploitation), < 0
                amplifies THR < 0 tokens (exploration); 0 with mode=reweight is the base algorithm, exactly.
            threshold: which tokens are dominant: `anchor` (|s| > β·min over correct rollouts of their
                mean score), `quantile` (|THR| ≥ its `quantile` within the group), `absolute` (|THR| >
                `thr_abs`) or `all`.
            beta_anchor: β of the anchor threshold.
            quantile: quantile of the `quantile` threshold.
            thr_abs: threshold of the `absolute` mode.
            mode: `reweight` keeps non-dominant tokens at Â; `only` zeroes them ("THR-only").
            chunk_size: tokens per LM-head call when rebuilding π_old (bounds memory).
        """
        if not -1.0 <= p <= 1.0:
            raise ConfigError(f"THRAttribution.p={p} must lie in [-1, 1], or advantage signs would flip")
        if threshold not in ("anchor", "quantile", "absolute", "all"):
            raise ConfigError(f"THRAttribution.threshold={threshold!r}; valid: anchor, quantile, absolute, all")
        if threshold == "absolute" and thr_abs is None:
            raise ConfigError("THRAttribution.threshold=absolute needs THRAttribution.thr_abs")
        if not 0.0 < quantile < 1.0:
            raise ConfigError(f"THRAttribution.quantile={quantile} must lie in (0, 1)")
        if mode not in ("reweight", "only"):
            raise ConfigError(f"THRAttribution.mode={mode!r}; valid: reweight, only")
        if chunk_size < 1:
            raise ConfigError("THRAttribution.chunk_size must be ≥ 1")
        self.p, self.threshold, self.beta_anchor = p, threshold, beta_anchor
        self.quantile, self.thr_abs, self.mode, self.chunk_size = quantile, thr_abs, mode, chunk_size

    @property
    def is_identity(self) -> bool:
        return self.p == 0.0 and self.mode == "reweight"

    def hidden_states_needed(self, rollout: Rollout) -> torch.Tensor | None:
        if self.is_identity:  # the base algorithm, bit for bit: no scores, no extra work
            return None
        return mixed_groups(rollout.correct.float(), rollout.group_size).repeat_interleave(rollout.group_size)

    @torch.no_grad()
    def on_advantages_computed(self, trainer: L.Trainer, module: RLVRModule, rollout: Rollout) -> None:
        if self.is_identity:
            return
        G, N = rollout.group_size, rollout.num_sequences
        T = max(1, int(rollout.response_lengths.max()))
        weights = torch.ones(N, T)
        parts: dict[str, list[torch.Tensor]] = {"thr": [], "dominant": [], "entropy": []}
        lm_head = module.policy.get_output_embeddings()
        for gs in rollout_thr(rollout, rollout.hidden_states, lm_head, self.chunk_size):
            dominant = dominant_tokens(
                gs.scores, gs.thr, gs.seq, gs.correct, self.threshold, self.beta_anchor, self.quantile, self.thr_abs
            )
            w = thr_token_weights(gs.thr, dominant, self.p, self.mode).cpu()
            for j, w_j in enumerate(gs.per_rollout(w)):
                weights[gs.group * G + j, : gs.lengths[j]] = w_j
            parts["thr"].append(gs.thr.cpu())
            parts["dominant"].append(dominant.cpu())
            parts["entropy"].append(gs.entropy.cpu())
        rollout.token_weights = weights
        rollout.metrics.update(thr_metrics(**{k: torch.cat(v) if v else torch.empty(0) for k, v in parts.items()}))


def thr_metrics(thr: torch.Tensor, dominant: torch.Tensor, entropy: torch.Tensor) -> dict[str, float]:
    """Logged per rollout batch over the tokens of mixed groups (§2.6, issue 5)."""
    if thr.numel() == 0:  # no mixed group in this batch: same keys, so dashboards keep one series
        keys = ("dominant_frac", "positive_frac", "negative_frac", "abs_p50", "abs_p90", "abs_p99", "abs_max")
        return {"thr/tokens": 0.0, **{f"thr/{k}": 0.0 for k in keys}, "thr/abs_entropy_spearman": 0.0}
    mag = thr.abs()
    q = torch.quantile(mag, torch.tensor([0.5, 0.9, 0.99]))
    return {
        "thr/tokens": float(thr.numel()),
        "thr/dominant_frac": dominant.float().mean().item(),
        "thr/positive_frac": (thr > 0).float().mean().item(),
        "thr/negative_frac": (thr < 0).float().mean().item(),
        "thr/abs_p50": q[0].item(),
        "thr/abs_p90": q[1].item(),
        "thr/abs_p99": q[2].item(),
        "thr/abs_max": mag.max().item(),
        "thr/abs_entropy_spearman": spearman_corrcoef(mag, entropy.float()).item() if mag.numel() > 1 else 0.0,
    }
