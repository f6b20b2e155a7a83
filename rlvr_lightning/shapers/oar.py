"""OAR (arXiv 2601.07408, docs/algorithms.md#oar) as an advantage shaper: reasoning tokens of every rollout with a
non-zero advantage and a parsable `\\boxed{}` answer get Bi-Level weights from how much each token moves the model's
own final-answer distribution; OAR-P perturbs tokens one at a time, OAR-G uses an input-gradient proxy. Scored once
per rollout batch under θ_old. Configured by `model.shapers.oar` (`shapers.settings.OARSettings`).
"""

from __future__ import annotations

import torch

from rlvr_lightning.attribution.oar import bilevel_weights, oar_g_saliency, oar_p_scores, segment_boxed
from rlvr_lightning.context import AdvantageShaper, ScoredBatch, StepContext
from rlvr_lightning.metrics import RunningStats, StreamSample
from rlvr_lightning.seeding import OAR_NOISE_STREAM, derived_seed
from rlvr_lightning.shapers.settings import OARSettings


class OARShaper(AdvantageShaper):
    weighs_sampled_tokens_only = True  # an environment's inserted tokens are context to score with, and weigh 1
    # OAR runs a number of scoring forwards that depends on each rank's own rollouts; with a sharded policy every
    # forward gathers weights on all ranks, so unequal counts would deadlock.
    runs_on_sharded_ranks = False

    def __init__(self, settings: OARSettings) -> None:
        settings.check()
        self.settings = settings

    def token_weights(self, step: StepContext, batch: ScoredBatch) -> torch.Tensor:
        rollout, tok, s = batch.rollout, step.tokenizer, self.settings
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        G, N = rollout.group_size, rollout.num_sequences
        T = max(1, int(rollout.response_lengths.max()))
        weights = torch.ones(N, T)
        candidates = [n for n in range(N) if batch.advantages[n] != 0]  # Â = 0: reshaping changes nothing
        inputs, rows = [], []
        owns = []  # per scored rollout, the reasoning positions the policy sampled (in an environment, not all)
        for n in candidates:
            c = rollout.completions[n]
            seg = segment_boxed(rollout.prompt_ids[n // G], c.token_ids, tok, s.conclude_template, c.sampled_mask)
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
            w, level = bilevel_weights(a[own], s.q, s.beta, s.floor, s.sum_to_len)
            weights[n, own] = w
            stats.add(weight=w, suppressed=level < 0, boosted=level > 0)
            sample.add(w)
        self._metrics = oar_metrics(stats, sample, scored=len(rows), candidates=len(candidates))
        return weights

    def batch_metrics(self) -> dict[str, float]:
        return getattr(self, "_metrics", {})

    def _scores(self, step: StepContext, inputs, rows: list[int], pad_id: int) -> list[torch.Tensor]:
        policy, s = step.policy, self.settings
        if s.method == "perturbation":
            return oar_p_scores(policy, inputs, pad_id, s.readout_used, s.chunk_size)
        gens = oar_noise_generators(step.seed, step.rollout_batch, step.collectives.rank, rows)
        return oar_g_saliency(policy, inputs, pad_id, s.readout_used, s.sigma, gens, s.chunk_size, s.saliency_baseline)


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
