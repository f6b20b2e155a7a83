"""What one training step gives (`StepResult`) and logs, the accumulator of per-token statistics over micro-batches, and the
timer of the step's stages."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import NamedTuple

import torch

from rlvr_lightning.context import ScoredBatch
from rlvr_lightning.pieces.advantages import group_reward_stats
from rlvr_lightning.pieces.kinds import CorrectionInputs, rollout_corrections
from rlvr_lightning.rollout.types import Rollout, RolloutTensors
from rlvr_lightning.tensor_math import LOG_RATIO_CLAMP, masked_mean
from rlvr_lightning.training.batch import UpdateInputs


class StepResult(NamedTuple):
    """One trained rollout batch: what the step logs, and what tests and benchmarks inspect."""

    batch: ScoredBatch  # the scored rollout with its rewards and sequence advantages
    inputs: UpdateInputs
    token_weights: torch.Tensor | None  # [N, T] the advantage shapers' weights, composed (None: no shaper)
    metrics: dict[str, float]  # the update's, the rollout correction's, the reward's and the shapers' (no `train/` prefix)
    times: dict[str, float]  # seconds per stage
    # [rows, T] the policy's per-token entropy in the update's first forward of each of the first rows (the batch's
    # first `StepContext.entropy_groups` groups); read it within each row's response length (past it: padding or
    # NaN). None when none was asked for.
    token_entropy: torch.Tensor | None = None

    @property
    def rollout(self) -> Rollout:
        return self.batch.rollout


class StageTimer:
    """Seconds per stage of one step (`time/<stage>`); a stage entered twice adds up."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[stage] = self.times.get(stage, 0.0) + time.perf_counter() - start

    def finish(self) -> dict[str, float]:
        """The stage times and `step`, the whole step since the timer was made."""
        return {**self.times, "step": time.perf_counter() - self._start}


class MetricAccumulator:
    """Token-weighted means of per-token statistics and plain means of scalars over micro-batches.

    Everything stays a tensor on the step's device until `result`, once per update: reading a value back to the host
    (`float(t)`) waits for every kernel queued before it, the last backward's included, so a read per micro-batch kept
    the host from queueing the next micro-batch while the GPU ran this one (9 of the GRPO preset's 13 reads per
    micro-batch were these: bench/host_reads.py). The sums are in float64, with the same operations in the same order as Python's floats: the same values
    (but for a NaN, which a min or max now keeps where Python's `max` could drop it)."""

    def __init__(self, kept_entropy_rows: int = 0) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor | float] = {}
        self.extremes: dict[str, torch.Tensor | float] = {}
        self.kept_entropy_rows = kept_entropy_rows  # sequences [0, k) whose per-token entropy is kept, on the CPU
        self.kept_entropy: dict[int, torch.Tensor] = {}

    def add(self, key: str, value: torch.Tensor, weight: torch.Tensor | float = 1.0) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value.detach().double() * weight
        self.counts[key] = self.counts.get(key, 0.0) + weight

    def add_tokens(
        self, stats: dict[str, torch.Tensor], entropy: torch.Tensor | None, mask: torch.Tensor, rows: torch.Tensor | None = None
    ) -> None:
        """A micro-batch's per-token statistics over `mask`; with its sequences' indices `rows`, the entropy of those
        among the first `kept_entropy_rows` seen for the first time is kept."""
        if entropy is not None and rows is not None and self.kept_entropy_rows:
            self.keep_entropy(entropy, rows)
        n_tok = mask.sum().double()
        per_token = dict(stats)
        if entropy is not None:
            per_token["entropy"] = entropy
        for key, value in per_token.items():
            if value.dim() == 1:  # a set of per-sequence samples: mean, or min/max by its name
                self.add_samples(key, value)
            else:
                self.add(key, masked_mean(value.float(), mask), weight=n_tok)
        if "ratio" in stats:
            self._extreme("ratio_max", (stats["ratio"] * mask).max(), torch.maximum, 0.0)

    def keep_entropy(self, entropy: torch.Tensor, rows: torch.Tensor) -> None:
        if len(self.kept_entropy) == self.kept_entropy_rows:  # all kept: no read back for the later micro-batches
            return
        indices = rows.tolist()  # a read back, on the batches a token view logs only, until their rows are kept
        wanted = [k for k, n in enumerate(indices) if n < self.kept_entropy_rows and n not in self.kept_entropy]
        if wanted:
            picked = entropy[wanted].detach().float().cpu()
            for k, values in zip(wanted, picked):
                self.kept_entropy[indices[k]] = values

    def token_entropy(self) -> torch.Tensor | None:
        """[kept_entropy_rows, T] the kept rows' entropy: each row as wide as the micro-batch it was forwarded in (its
        padding's values are not the policy's at a token of it), NaN past that width or for a row not seen."""
        if not self.kept_entropy_rows:
            return None
        width = max((len(v) for v in self.kept_entropy.values()), default=0)
        out = torch.full((self.kept_entropy_rows, width), float("nan"))
        for n, values in self.kept_entropy.items():
            out[n, : len(values)] = values
        return out

    def add_padding(self, attention_mask: torch.Tensor, packed: bool = False) -> None:
        """A forward's [rows × width] inputs: `padding_frac` is the share of all slots that are padding
        (none when the forward ran packed: its slots are the real tokens)."""
        real = attention_mask.sum().double()
        slots = real if packed else float(attention_mask.numel())
        self.add("padding_frac", (1.0 - real / slots).float(), weight=slots)  # the share in fp32, as it was logged

    def add_samples(self, key: str, values: torch.Tensor) -> None:
        if values.numel() == 0:
            return
        if key.endswith("_max"):
            self._extreme(key, values.max(), torch.maximum, -math.inf)
        elif key.endswith("_min"):
            self._extreme(key, values.min(), torch.minimum, math.inf)
        else:
            self.add(key, values.float().mean(), weight=float(values.numel()))

    def _extreme(self, key: str, value: torch.Tensor, pick, start: float) -> None:
        value = value.detach().double()
        self.extremes[key] = pick(torch.as_tensor(self.extremes.get(key, start), dtype=value.dtype, device=value.device), value)

    def result(self) -> dict[str, float]:
        sums, counts = {k: float(v) for k, v in self.sums.items()}, {k: float(v) for k, v in self.counts.items()}
        out = {k: sums[k] / counts[k] for k in sums if counts[k] > 0}
        for old, new in (
            ("clipped_low", "clip_frac_low"),
            ("clipped_high", "clip_frac_high"),
            ("clipped_dual", "clip_frac_dual"),
            ("ratio", "ratio_mean"),
        ):
            if old in out:
                out[new] = out.pop(old)
        if "clip_frac_low" in out:
            out["clip_frac"] = out["clip_frac_low"] + out["clip_frac_high"]
        return {**out, **{k: float(v) for k, v in self.extremes.items()}}


def mismatch_metrics(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the engine that sampled is from the trainer's θ_old, logged whether or not a correction is on: a
    k3 estimate of KL(π_rollout ‖ π_old) per token (r − 1 − log r, r = π_old/π_rollout, from the engine's own
    samples; ≥ 0), and the shares a masked correction would drop at its default band: tokens (`icepop`, [0.5, 5])
    and sequences (`mis-sequence`, [0.5, 2] on the sequence's ratio)."""
    x = CorrectionInputs(old_logp, rollout_logp, mask)
    log_r = torch.where(mask.bool(), old_logp - rollout_logp, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    _, tokens = rollout_corrections.get("icepop").fn(x)
    sequence_weights, _ = rollout_corrections.get("mis-sequence").fn(x)
    has_tokens = mask.sum(1) > 0
    dropped = has_tokens & (sequence_weights.sum(1) == 0)
    return {
        "train/mismatch_kl": masked_mean(log_r.exp() - 1 - log_r, mask).item(),
        "train/mismatch_drop_token_frac": tokens["is_masked_frac"],
        "train/mismatch_drop_seq_frac": (dropped.sum() / has_tokens.sum().clamp(min=1)).item(),
    }


def step_metrics(
    batch: ScoredBatch,
    t: RolloutTensors,
    old_logp: torch.Tensor,
    update_metrics: dict[str, float],
    times: dict[str, float],
    policy_version: int,
    sync_probe_diff: float,
) -> dict[str, float]:
    """The `train/`, `time/` and `throughput/` metrics of one step (names as in verl/TRL where they exist)."""
    rollout = batch.rollout
    mask = t.sampled_mask  # an inserted token has no engine log-prob
    lengths = rollout.response_lengths
    log_ratio = (old_logp - t.rollout_logp) * mask  # log π_old/π_rollout per token
    mismatch = log_ratio.abs()
    valid = mask.bool()
    seq_log_ratio = log_ratio.sum(1)
    metrics = {f"train/{k}": v for k, v in group_reward_stats(batch.rewards, rollout.group_size).items()}
    metrics.update({f"train/{k}": v for k, v in update_metrics.items()})
    metrics.update({f"train/{k}": v for k, v in rollout.metrics.items()})
    metrics.update(
        {
            "train/accuracy": rollout.correct.float().mean().item(),
            "train/response_length_mean": lengths.mean().item(),
            "train/response_length_max": lengths.max().item(),
            "train/response_clip_ratio": rollout.truncated.float().mean().item(),
            "train/logprob_mismatch_mean": masked_mean(mismatch, mask).item(),
            "train/logprob_mismatch_max": mismatch.max().item(),
            "train/rollout_is_ratio_min": log_ratio[valid].min().exp().item() if valid.any() else 1.0,
            "train/rollout_is_ratio_max": log_ratio[valid].max().exp().item() if valid.any() else 1.0,
            "train/rollout_is_seq_ratio_min": seq_log_ratio.min().clamp(-20, 20).exp().item(),
            "train/rollout_is_seq_ratio_max": seq_log_ratio.max().clamp(-20, 20).exp().item(),
            **mismatch_metrics(old_logp, t.rollout_logp, mask),
            "train/policy_version": float(policy_version),
            "train/sync_probe_max_abs_diff": sync_probe_diff,
            "throughput/rollout_tokens_per_s": lengths.sum().item() / max(times["rollout"], 1e-9),
        }
    )
    metrics.update({f"time/{k}": v for k, v in times.items()})
    return metrics
