"""Bounded-memory batch metrics (rlvr_lightning.metrics StreamSample / RunningStats) and their use by the
THR and OAR callbacks: the sample is the whole stream below capacity (quantiles exact), a uniform sample
of bounded size above it (even past torch.quantile's 2^24 limit), its columns stay paired, and THR's
metrics are computed once per rollout batch with the keys and values of the former all-token formulas."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torchmetrics.functional import spearman_corrcoef

from rlvr_lightning.attribution.thr import dominant_tokens, rollout_thr
from rlvr_lightning.context import ScoredBatch
from rlvr_lightning.metrics import RunningStats, StreamSample
from rlvr_lightning.pieces.advantages import group_advantage
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.shapers import thr as thr_shaper
from rlvr_lightning.shapers.oar import oar_metrics
from rlvr_lightning.shapers.settings import THRSettings
from rlvr_lightning.shapers.thr import THRShaper, thr_metrics

THR_KEYS = {
    "thr/tokens", "thr/dominant_frac", "thr/positive_frac", "thr/negative_frac", "thr/abs_p50", "thr/abs_p90",
    "thr/abs_p99", "thr/abs_max", "thr/abs_entropy_spearman",
}  # fmt: skip
OAR_KEYS = {
    "oar/scored", "oar/no_answer_span_frac", "oar/weight_p10", "oar/weight_p50", "oar/weight_p90", "oar/weight_min",
    "oar/weight_max", "oar/suppressed_frac", "oar/boosted_frac",
}  # fmt: skip


def chunks(values: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(values.split(sizes))


def ramp(n: int, generator: torch.Generator) -> torch.Tensor:
    """n values, uniform on [0, 1) overall but increasing along the stream: any bias of the sample
    towards early or late elements moves its quantiles."""
    return (torch.arange(n, dtype=torch.float64) + torch.rand(n, generator=generator, dtype=torch.float64)) / n


# ---- (a) below capacity: the sample is the stream ------------------------------------------------------


def test_below_capacity_the_sample_holds_the_stream_and_its_quantiles_are_exact():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(3000, generator=g)
    sample = StreamSample(capacity=3000, seed=1)
    for part in chunks(values, [1, 999, 0, 1500, 500]):
        sample.add(part)
    assert sample.seen == len(sample) == 3000
    assert torch.equal(sample.columns()[0], values)  # everything, in stream order
    q = [0.1, 0.5, 0.9, 0.99]
    assert torch.equal(sample.quantiles(q), torch.quantile(values, torch.tensor(q)))


# ---- (b) above capacity: a bounded uniform sample --------------------------------------------------------


def quantile_tolerance(p: float, k: int) -> float:
    """5 standard errors of the p-quantile of k uniform draws on [0, 1): sqrt(p(1−p)/k)."""
    return 5 * math.sqrt(p * (1 - p) / k)


def test_above_capacity_the_sample_is_bounded_and_its_quantiles_close():
    g = torch.Generator().manual_seed(0)
    values = ramp(200_000, g)
    sample = StreamSample(capacity=1000, seed=2)
    sizes = torch.randint(1, 2000, (60,), generator=g).tolist()
    sizes.append(200_000 - sum(sizes))
    for part in chunks(values, sizes):
        sample.add(part)
        assert len(sample) <= 1000 and all(c.numel() == len(sample) for c in sample.columns())
    assert sample.seen == 200_000 and len(sample) == 1000
    held = sample.columns()[0]
    assert len(set(held.tolist())) == 1000  # without replacement
    q = [0.1, 0.5, 0.9, 0.99]
    true = torch.quantile(values, torch.tensor(q, dtype=values.dtype))
    for p, got, want in zip(q, sample.quantiles(q), true):
        assert abs(got - want) <= quantile_tolerance(p, 1000), (p, got, want)


def test_a_stream_longer_than_torch_quantile_accepts():
    """17M values in chunks of 1M (> 2^24, which torch.quantile refuses as one tensor), default capacity."""
    n, chunk = 17 * 2**20, 2**20
    assert n > 2**24
    with pytest.raises(RuntimeError, match="too large"):
        torch.quantile(torch.zeros(2**24 + 1), 0.5)
    g = torch.Generator().manual_seed(0)
    sample, stats = StreamSample(seed=3), RunningStats()
    for start in range(0, n, chunk):  # the same ramp as above, uniform on [0, 1) overall, made chunk by chunk
        jitter = torch.rand(chunk, generator=g, dtype=torch.float64)
        part = (torch.arange(start, start + chunk, dtype=torch.float64) + jitter) / n
        sample.add(part.float())
        stats.add(value=part, low=part < 0.25)
    assert sample.seen == stats.count == n and len(sample) == sample.capacity == 65_536
    q = [0.5, 0.9, 0.99]
    for p, got in zip(q, sample.quantiles(q)):
        assert abs(got.item() - p) <= quantile_tolerance(p, sample.capacity) + 1 / n, (p, got)
    assert stats.mean("low") == pytest.approx(0.25, abs=1 / n)  # exact up to the ramp's jitter at the boundary
    assert 0 <= stats.min("value") < 1 / n and 1 - 1 / n < stats.max("value") < 1


def test_running_stats_are_exact_whatever_the_chunking():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(10_000, generator=g)
    stats = RunningStats()
    for part in chunks(values, [0, 3, 4000, 5997]):
        stats.add(x=part, positive=part > 0)
    assert stats.count == 10_000
    assert stats.mean("positive") == (values > 0).sum().item() / 10_000
    assert stats.max("x") == values.max().item() and stats.min("x") == values.min().item()


# ---- (d) joint sampling keeps pairs aligned --------------------------------------------------------------


def test_joint_sampling_keeps_every_pair_aligned():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50_000, generator=g)
    sample = StreamSample(capacity=500, seed=4)
    sizes = [7, 20_000, 1, 12_345, 17_647]
    for part in chunks(x, sizes):
        sample.add(part, 2 * part, part > 0)
    a, b, positive = sample.columns()
    assert len(a) == 500
    assert torch.equal(b, 2 * a) and torch.equal(positive, a > 0)


# ---- (c) THR: once per batch, same keys and values as the all-token formula --------------------------------


def reference_thr_metrics(thr: torch.Tensor, dominant: torch.Tensor, entropy: torch.Tensor) -> dict[str, float]:
    """The former formula, over every token at once."""
    mag = thr.abs()
    q = torch.quantile(mag, torch.tensor([0.5, 0.9, 0.99]))
    return {
        "thr/tokens": float(thr.numel()),
        "thr/dominant_frac": dominant.float().mean().item(),
        "thr/positive_frac": (thr > 0).float().mean().item(),
        "thr/negative_frac": (thr < 0).float().mean().item(),
        "thr/abs_p50": q[0].item(), "thr/abs_p90": q[1].item(), "thr/abs_p99": q[2].item(),
        "thr/abs_max": mag.max().item(),
        "thr/abs_entropy_spearman": spearman_corrcoef(mag, entropy.float()).item(),
    }  # fmt: skip


def assert_same_metrics(got: dict[str, float], want: dict[str, float], fractions: tuple[str, ...]) -> None:
    """Equal keys and values; fractions to float32 precision (the former formula averaged in float32,
    the running counts divide in float64)."""
    assert set(got) == set(want)
    for key, value in want.items():
        if key in fractions:
            assert got[key] == pytest.approx(value, rel=1e-6), key
        else:
            assert got[key] == value, key


def thr_batch(G=4, d=6, V=13, correct=(1, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 0), seed=0):
    """A scored batch of len(correct)/G groups with random tokens and LM-head inputs, and the step's
    context as THR reads it (the policy's head, the step index)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(d, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, d, generator=g))
    N = len(correct)
    lengths = torch.randint(1, 9, (N,), generator=g).tolist()
    completions = [Completion(torch.randint(0, V, (L,), generator=g).tolist(), [0.0] * L, "stop") for L in lengths]
    c = torch.tensor(correct, dtype=torch.float32)
    B = N // G
    rollout = Rollout(
        batch=PromptBatch([str(b) for b in range(B)], [""] * B, [""] * B), group_size=G, prompt_ids=[[1]] * B,
        completions=completions, sampling=SamplingConfig(group_size=G, temperature=0.8), policy_version=0,
        correct=c,
    )  # fmt: skip
    batch = ScoredBatch(rollout, c.clone(), group_advantage(c, G))
    hidden = {n: torch.randn(L, d, generator=g) for n, L in enumerate(lengths)}
    policy = SimpleNamespace(get_output_embeddings=lambda: head, config=SimpleNamespace(model_type="qwen2"))
    step = SimpleNamespace(policy=policy, rollout_batch=0)
    return batch, hidden, step, head


def test_thr_metrics_are_computed_once_per_batch_with_the_former_keys_and_values(monkeypatch):
    calls = []
    monkeypatch.setattr(thr_shaper, "thr_metrics", lambda *a: calls.append(a) or thr_metrics(*a))
    batch, hidden, step, head = thr_batch()  # groups 0, 1 and 3 mixed, group 2 all correct
    thr = THRShaper(THRSettings(p=0.2))
    G = batch.group_size
    thr.token_weights(step, batch)
    rows = thr.hidden_rows(batch)
    for group in (0, 1, 3):  # one whole group per call, as the θ_old pass hands them
        assert not calls and not thr.batch_metrics()
        group_hidden = {n: hidden[n] for n in range(group * G, (group + 1) * G) if rows[n]}
        thr.weights_from_hidden(step, batch, group_hidden)
    assert len(calls) == 1
    parts = [  # every scored token of the batch at once, for the former formula
        (gs.thr, dominant_tokens(gs.scores, gs.thr, gs.seq, gs.correct), gs.entropy)
        for gs in rollout_thr(batch.rollout, batch.advantages, {n: h for n, h in hidden.items() if rows[n]}, head)
    ]  # fmt: skip
    want = reference_thr_metrics(*(torch.cat(p) for p in zip(*parts)))
    fractions = ("thr/dominant_frac", "thr/positive_frac", "thr/negative_frac")
    assert_same_metrics(thr.batch_metrics(), want, fractions)
    assert set(thr.batch_metrics()) == THR_KEYS


def test_thr_without_a_mixed_group_logs_the_same_keys_at_once(monkeypatch):
    calls = []
    monkeypatch.setattr(thr_shaper, "thr_metrics", lambda *a: calls.append(a) or thr_metrics(*a))
    batch, _, step, _ = thr_batch(correct=(1, 1, 1, 1, 0, 0, 0, 0))
    thr = THRShaper(THRSettings(p=0.2))
    thr.token_weights(step, batch)
    assert len(calls) == 1 and thr.batch_metrics() == {k: 0.0 for k in THR_KEYS}


# ---- OAR: same keys and values as the all-token formula -----------------------------------------------------


def reference_oar_quantities(weights: list[torch.Tensor], levels: list[torch.Tensor]) -> dict[str, float]:
    """The former formula's weight and level metrics, over every token at once."""
    w, level = torch.cat(weights), torch.cat(levels)
    q = torch.quantile(w, torch.tensor([0.1, 0.5, 0.9]))
    return {
        "oar/weight_p10": q[0].item(), "oar/weight_p50": q[1].item(), "oar/weight_p90": q[2].item(),
        "oar/weight_min": w.min().item(), "oar/weight_max": w.max().item(),
        "oar/suppressed_frac": (level < 0).float().mean().item(), "oar/boosted_frac": (level > 0).float().mean().item(),
    }  # fmt: skip


def test_oar_metrics_keep_their_keys_and_the_former_values():
    from rlvr_lightning.attribution.oar import bilevel_weights

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (9,), generator=g).tolist()
    weights, levels = zip(*(bilevel_weights(torch.rand(L, generator=g)) for L in lengths))
    stats, sample = RunningStats(), StreamSample()
    for w, level in zip(weights, levels):
        stats.add(weight=w, suppressed=level < 0, boosted=level > 0)
        sample.add(w)
    got = oar_metrics(stats, sample, scored=9, candidates=12)
    want = {"oar/scored": 9.0, "oar/no_answer_span_frac": 1 - 9 / 12}
    want |= reference_oar_quantities(list(weights), list(levels))
    assert_same_metrics(got, want, ("oar/suppressed_frac", "oar/boosted_frac"))
    assert set(got) == set(oar_metrics(RunningStats(), StreamSample(), scored=0, candidates=0)) == OAR_KEYS
