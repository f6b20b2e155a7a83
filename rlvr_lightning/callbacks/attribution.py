"""Attribution callbacks: per-token reshaping of the advantages before the policy update.

`OARAttribution` (arXiv 2601.07408, docs/algorithms.md#oar): reasoning tokens of every rollout with a
non-zero advantage and a parsable `\\boxed{}` answer get Bi-Level weights from OAR-P or OAR-G scores.

`THRAttribution` (arXiv 2510.03669, docs/algorithms.md#thr): under θ_old and without grad, score every
response token of each mixed group by its Token Hidden Reward and weight its advantage so that
Â' = Â·(1 + p·sign(THR)) on dominant tokens. p > 0 favours exploitation (greedy accuracy), p < 0
exploration (pass@k). The LM-head inputs come from a forward the module runs anyway: the θ_old pass,
or, with one update per rollout batch, the update's own forward (no extra transformer pass).
"""

from __future__ import annotations

from typing import Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torchmetrics.functional import spearman_corrcoef

from rlvr_lightning.attribution.oar import (
    DEFAULT_CONCLUDE,
    Readout,
    SaliencyBaseline,
    bilevel_weights,
    oar_g_saliency,
    oar_p_scores,
    segment_boxed,
)
from rlvr_lightning.attribution.thr import ReweightMode, ThresholdMode, dominant_tokens, rollout_thr, thr_token_weights
from rlvr_lightning.context import AdvantageShaper, ScoredBatch, StepContext
from rlvr_lightning.errors import ConfigError, check_choice
from rlvr_lightning.metrics import RunningStats, StreamSample
from rlvr_lightning.models.lm_head import PolicyHead
from rlvr_lightning.pieces.advantages import mixed_groups
from rlvr_lightning.seeding import OAR_NOISE_STREAM, derived_seed


class THRAttribution(AdvantageShaper, Callback):
    weighs_sampled_tokens_only = True  # `attribution.thr.rollout_thr` scores the sampled tokens; inserted ones weigh 1

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
        check_choice("THRAttribution.threshold", threshold, ThresholdMode)
        if threshold == "absolute" and thr_abs is None:
            raise ConfigError("THRAttribution.threshold=absolute needs THRAttribution.thr_abs")
        if not 0.0 < quantile < 1.0:
            raise ConfigError(f"THRAttribution.quantile={quantile} must lie in (0, 1)")
        check_choice("THRAttribution.mode", mode, ReweightMode)
        if chunk_size < 1:
            raise ConfigError("THRAttribution.chunk_size must be ≥ 1")
        self.p, self.threshold, self.beta_anchor = p, threshold, beta_anchor
        self.quantile, self.thr_abs, self.mode, self.chunk_size = quantile, thr_abs, mode, chunk_size

    @property
    def is_identity(self) -> bool:
        return self.p == 0.0 and self.mode == "reweight"

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
        G = batch.group_size
        weights: dict[int, torch.Tensor] = {}
        lm_head = PolicyHead(step.policy)  # the logits the policy's forward returns, its family's transform included
        unscored_before = len(self._unscored)
        for gs in rollout_thr(batch.rollout, batch.advantages, hidden, lm_head, self.chunk_size):
            dominant = dominant_tokens(
                gs.scores, gs.thr, gs.seq, gs.correct, self.threshold, self.beta_anchor, self.quantile, self.thr_abs
            )
            w = thr_token_weights(gs.thr, dominant, self.p, self.mode).cpu()
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


class OARAttribution(AdvantageShaper, Callback):
    """OAR (arXiv 2601.07408, docs/algorithms.md#oar): reasoning tokens' advantages reshaped by how much
    each token moves the model's own final-answer distribution; OAR-P perturbs tokens one at a time,
    OAR-G uses an input-gradient proxy. Scored once per rollout batch under θ_old."""

    weighs_sampled_tokens_only = True  # an environment's inserted tokens are context to score with, and weigh 1

    def __init__(
        self,
        method: Literal["perturbation", "gradient"] = "gradient",
        readout: Readout | None = None,
        q: float = 0.25,
        beta: float = 1.0,
        floor: float = 0.1,
        sum_to_len: bool = True,
        sigma: float = 1e-3,
        chunk_size: int = 32,
        conclude_template: str = DEFAULT_CONCLUDE,
        saliency_baseline: SaliencyBaseline = "zero",
    ) -> None:
        """
        Args:
            method: `perturbation` (OAR-P: one forward per reasoning token, from that token on, the quality ceiling) or
                `gradient` (OAR-G: one clean forward and one noisy forward/backward to the embeddings).
            readout: `last`, `answer_mean` or `answer_joint`; null = `last` for P, `answer_mean` for G.
            q: quantile threshold between suppression and boost.
            beta: maximum boost (weights up to 1 + beta before renormalisation).
            floor: minimum weight of suppressed tokens before renormalisation (> 0: every weight stays positive).
            sum_to_len: renormalise so the mean weight over reasoning tokens is 1.
            sigma: OAR-G embedding noise (the KL's gradient is 0 without it).
            chunk_size: sequences per scoring forward (perturbed copies for P, rollouts for G).
            conclude_template: text joining the truncated reasoning to the answer.
            saliency_baseline: OAR-G's gradient × (input − baseline): `zero` (authors) or `pad` (the
                pad token's embedding: a first-order estimate of OAR-P's substitution).
        """
        check_choice("OARAttribution.saliency_baseline", saliency_baseline, SaliencyBaseline)
        self.saliency_baseline = saliency_baseline
        check_choice("OARAttribution.method", method, ("perturbation", "gradient"))
        readout = readout or ("last" if method == "perturbation" else "answer_mean")
        check_choice("OARAttribution.readout", readout, Readout)
        # floor > 0: with floor = 0 the least important reasoning token gets weight exactly 0, and the
        # reshaping must keep every weight positive (it rescales advantages, never removes a token).
        if not 0.0 < q < 1.0 or beta < 0 or not 0.0 < floor <= 1.0 or sigma <= 0 or chunk_size < 1:
            raise ConfigError("OARAttribution needs 0 < q < 1, beta ≥ 0, 0 < floor ≤ 1, sigma > 0, chunk_size ≥ 1")
        self.method, self.readout, self.q, self.beta, self.floor = method, readout, q, beta, floor
        self.sum_to_len, self.sigma, self.chunk_size, self.conclude_template = sum_to_len, sigma, chunk_size, conclude_template

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # OAR runs a number of scoring forwards that depends on each rank's own rollouts; with a sharded
        # policy every forward gathers weights on all ranks, so unequal counts would deadlock.
        if trainer.world_size > 1 and isinstance(trainer.strategy, L.pytorch.strategies.ModelParallelStrategy):
            raise ConfigError("OARAttribution does not support a sharded policy (FSDP) on several ranks yet; use one rank or DDP")

    def token_weights(self, step: StepContext, batch: ScoredBatch) -> torch.Tensor:
        rollout, tok = batch.rollout, step.tokenizer
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        G, N = rollout.group_size, rollout.num_sequences
        T = max(1, int(rollout.response_lengths.max()))
        weights = torch.ones(N, T)
        candidates = [n for n in range(N) if batch.advantages[n] != 0]  # Â = 0: reshaping changes nothing
        inputs, rows = [], []
        owns = []  # per scored rollout, the reasoning positions the policy sampled (in an environment, not all)
        for n in candidates:
            c = rollout.completions[n]
            seg = segment_boxed(rollout.prompt_ids[n // G], c.token_ids, tok, self.conclude_template, c.sampled_mask)
            own = [i for i in range(seg.r1 - seg.r0) if c.sampled_mask[i]] if seg is not None else []
            if own:
                inputs.append(seg)
                rows.append(n)
                owns.append(own)
        scores = self._scores(step, inputs, rows, pad_id) if inputs else []
        stats, sample = RunningStats(), StreamSample(seed=step.rollout_batch)  # sample: the weights
        for n, own, a in zip(rows, owns, scores):
            # Reshaped over the sampled tokens alone (an inserted token is scored as context, weighs 1, and is out
            # of the mean-1 normalisation and the metrics).
            w, level = bilevel_weights(a[own], self.q, self.beta, self.floor, self.sum_to_len)
            weights[n, own] = w
            stats.add(weight=w, suppressed=level < 0, boosted=level > 0)
            sample.add(w)
        self._metrics = oar_metrics(stats, sample, scored=len(rows), candidates=len(candidates))
        return weights

    def batch_metrics(self) -> dict[str, float]:
        return getattr(self, "_metrics", {})

    def _scores(self, step: StepContext, inputs, rows: list[int], pad_id: int) -> list[torch.Tensor]:
        policy = step.policy
        if self.method == "perturbation":
            return oar_p_scores(policy, inputs, pad_id, self.readout, self.chunk_size)
        gens = oar_noise_generators(step.seed, step.rollout_batch, step.collectives.rank, rows)
        return oar_g_saliency(policy, inputs, pad_id, self.readout, self.sigma, gens, self.chunk_size, self.saliency_baseline)


def oar_noise_generators(data_seed: int, step: int, rank: int, rows: list[int]) -> list[torch.Generator]:
    """OAR-G's noise generator for each scored rollout (its row in the rollout batch): seeded by the run's
    seed, the step, the rank and the row itself, so a rollout's noise does not depend on which other
    rollouts were scored, repeats across runs and resumes, and differs between ranks."""
    seed = derived_seed(data_seed, step, OAR_NOISE_STREAM, rank)
    per_row = torch.randint(2**62, (max(rows, default=-1) + 1,), generator=torch.Generator().manual_seed(seed))
    return [torch.Generator().manual_seed(int(per_row[n])) for n in rows]


def oar_metrics(stats: RunningStats, sample: StreamSample, scored: int, candidates: int) -> dict[str, float]:
    """Logged per rollout batch over the weighted reasoning tokens: the extremes and fractions exact from
    `stats` (streams weight, suppressed, boosted), the quantiles from `sample` (the weights; every token
    while the batch has at most `sample.capacity` of them)."""
    out = {
        "oar/scored": float(scored),
        "oar/no_answer_span_frac": 1.0 - scored / candidates if candidates else 0.0,
    }
    if stats.count == 0:
        return (
            out
            | {f"oar/weight_{k}": 1.0 for k in ("p10", "p50", "p90", "min", "max")}
            | {"oar/suppressed_frac": 0.0, "oar/boosted_frac": 0.0}
        )
    q = sample.quantiles([0.1, 0.5, 0.9])
    return out | {
        "oar/weight_p10": q[0].item(), "oar/weight_p50": q[1].item(), "oar/weight_p90": q[2].item(),
        "oar/weight_min": stats.min("weight"), "oar/weight_max": stats.max("weight"),
        "oar/suppressed_frac": stats.mean("suppressed"), "oar/boosted_frac": stats.mean("boosted"),
    }  # fmt: skip
