"""THR's scores (`attribution.thr`, docs/algorithms.md#thr): against the definition, dominance and weights on
hand-made values, and THR's sign on a real policy. The shaper inside the step: tests/shapers/test_thr.py."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.algos import GRPO
from rlvr_lightning.attribution.thr import dominant_tokens, group_thr_scores, thr_token_weights
from tests.support.update_harness import attach, sample_rollout


def random_group(seed=0, G=4, d=6, V=11, lengths=(3, 5, 2, 4)):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(d, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, d, generator=g))
    n = sum(lengths)
    hidden = torch.randn(n, d, generator=g)
    tokens = torch.randint(0, V, (n,), generator=g)
    seq = torch.repeat_interleave(torch.arange(G), torch.tensor(lengths))
    return head, hidden, tokens, seq


def scores_by_definition(head, hidden, tokens, seq, correct, temperature):
    """s_{j,k} = Σ_{i∈O+} Σ_k' ⟨g_{i,k'}, g_{j,k}⟩⟨h_{i,k'}, h_{j,k}⟩ with g restricted to V*: explicit loops."""
    vocab = sorted(set(tokens.tolist()))
    probs = torch.softmax(head(hidden).double() / temperature, -1)
    h = hidden.double()

    def g(t):
        return torch.tensor([(1.0 if v == tokens[t] else 0.0) - probs[t, v].item() for v in vocab], dtype=torch.float64)

    out = []
    for t in range(len(tokens)):
        total = 0.0
        for t2 in range(len(tokens)):
            if correct[seq[t2]]:
                total += float(g(t2) @ g(t)) * float(h[t2] @ h[t])
        out.append(total)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_scores_equal_the_explicit_double_sum(temperature):
    head, hidden, tokens, seq = random_group()
    correct = torch.tensor([True, False, True, False])
    s, entropy = group_thr_scores(hidden, tokens, seq, correct, head, temperature)
    torch.testing.assert_close(s.double(), scores_by_definition(head, hidden, tokens, seq, correct, temperature),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    logp = (head(hidden) / temperature).log_softmax(-1)
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(-1))


def test_chunked_equals_unchunked():
    head, hidden, tokens, seq = random_group(seed=3, lengths=(7, 1, 9, 4))
    correct = torch.tensor([False, True, True, False])
    whole, _ = group_thr_scores(hidden, tokens, seq, correct, head, chunk_size=10_000)
    for chunk in (1, 3, 5):
        torch.testing.assert_close(group_thr_scores(hidden, tokens, seq, correct, head, chunk_size=chunk)[0], whole)


def test_matches_the_reference_listing_of_the_spec():
    """The reweighting rule of docs/algorithms.md#thr-dominant-tokens-and-reweighting, transcribed, on random groups and all thresholds."""
    head, hidden, tokens, seq = random_group(seed=5)
    correct = torch.tensor([True, False, False, True])
    A = torch.tensor([1.0, -1.0, -1.0, 1.0])
    vocab = torch.unique(tokens)
    P = torch.softmax(head(hidden), -1)[:, vocab]
    col = torch.searchsorted(vocab, tokens)
    per = [(seq == j).nonzero().squeeze(1) for j in range(4)]
    g = [torch.zeros_like(P[r]).scatter_(1, col[r][:, None], 1.0) - P[r] for r in per]
    Mp = sum(g[j].T @ hidden[per[j]] for j in range(4) if correct[j])
    s_ref = torch.cat([((g[j] @ Mp) * hidden[per[j]]).sum(-1) for j in range(4)])
    s, _ = group_thr_scores(hidden, tokens, seq, correct, head)
    torch.testing.assert_close(s, s_ref)
    thr = A[seq] * s
    tau = min(s_ref[per[j]].mean() for j in range(4) if correct[j])
    torch.testing.assert_close(dominant_tokens(s, thr, seq, correct, "anchor"), s_ref.abs() > tau)
    cut = torch.quantile(thr.abs(), 0.8)
    torch.testing.assert_close(dominant_tokens(s, thr, seq, correct, "quantile", quantile=0.8), thr.abs() >= cut)


def test_an_environments_inserted_tokens_get_no_thr_and_change_none_of_the_sampled_tokens():
    """THR reads the tokens the policy sampled: a group whose responses hold inserted tokens (a tool's output) scores
    its sampled tokens exactly as the same group without them (their θ_old LM-head inputs given), and its weights
    are 1 at the inserted positions."""
    from rlvr_lightning.attribution.thr import rollout_thr
    from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig

    head, hidden, tokens, seq = random_group(seed=7, lengths=(5, 6, 4, 5))
    sampled = [[1, 1, 0, 0, 1], [1, 0, 1, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 0, 1]]  # 0: inserted

    def rollout_of(keep_inserted: bool):
        completions, states = [], {}
        for j, mask in enumerate(sampled):
            keep = [i for i, s in enumerate(mask) if s or keep_inserted]
            rows = (seq == j).nonzero().squeeze(1)[keep]
            states[j] = hidden[rows]
            completions.append(Completion(tokens[rows].tolist(), [0.0] * len(keep), "stop",
                                          sampled_mask=[bool(mask[i]) for i in keep]))  # fmt: skip
        rollout = Rollout(batch=PromptBatch(["p"], ["q"], ["1"]), group_size=4, prompt_ids=[[1]],
                          completions=completions, sampling=SamplingConfig(group_size=4), policy_version=0,
                          correct=torch.tensor([1.0, 0.0, 1.0, 0.0]))  # fmt: skip
        (gs,) = rollout_thr(rollout, torch.tensor([1.0, -1.0, 1.0, -1.0]), states, head)
        return rollout, gs

    with_tool, gs = rollout_of(True)
    _, plain = rollout_of(False)
    torch.testing.assert_close(gs.thr, plain.thr)
    assert gs.lengths == plain.lengths == [sum(m) for m in sampled]
    weights = gs.per_response(torch.full_like(gs.thr, 2.0), [len(c.token_ids) for c in with_tool.completions], fill=1.0)
    assert [w.tolist() for w in weights] == [[2.0 if s else 1.0 for s in m] for m in sampled]


def test_dominance_on_hand_values():
    s = torch.tensor([3.0, 1.0, -0.5, 2.0, -4.0, 0.1])
    seq = torch.tensor([0, 0, 1, 1, 2, 2])
    correct = torch.tensor([True, True, False])
    thr = torch.tensor([1.0, -1, 1, 1, -1, 1]) * s
    # anchor: means of correct rollouts 2.0 and 0.75 → τ = 0.75; β = 2 → τ = 1.5
    assert dominant_tokens(s, thr, seq, correct, "anchor").tolist() == [True, True, False, True, True, False]
    assert dominant_tokens(s, thr, seq, correct, "anchor", beta_anchor=2.0).tolist() == [True, False, False, True, True, False]
    assert dominant_tokens(s, thr, seq, correct, "absolute", thr_abs=1.5).tolist() == [True, False, False, True, True, False]
    assert dominant_tokens(s, thr, seq, correct, "all").all()
    # a negative anchor makes every token dominant
    assert dominant_tokens(-s.abs(), thr, seq, correct, "anchor").all()


@pytest.mark.parametrize("p", [0.5, -0.5, 0.2])
def test_weights_scale_dominant_tokens_by_one_plus_p_sign(p):
    thr = torch.tensor([2.0, -3.0, 0.5, -0.1, 0.0])
    dominant = torch.tensor([True, True, False, False, True])
    w = thr_token_weights(thr, dominant, p)
    assert w.tolist() == pytest.approx([1 + p, 1 - p, 1, 1, 1])
    only = thr_token_weights(thr, dominant, p, mode="only")
    assert only.tolist() == pytest.approx([1 + p, 1 - p, 0, 0, 1])
    assert (w > 0).all()  # |p| < 1: Â' keeps the sign of Â


def untied_copy(policy):
    """The policy with its own LM-head matrix, so that a head-only step leaves the input embeddings alone."""
    import copy

    untied = copy.deepcopy(policy)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    untied.config.tie_word_embeddings = False
    return untied


def test_thr_sign_predicts_the_change_of_the_correct_likelihood(tiny_policy_dir):
    """a small step on the THR > 0 tokens raises Σ log π(correct tokens), one on
    the THR < 0 tokens lowers it — exactly to first order for the LM head, approximately for all weights."""
    from rlvr_lightning.attribution.thr_check import thr_sign_check

    module = attach(GRPO, tiny_policy_dir)
    pad = module.trainer.datamodule.tokenizer.pad_token_id
    head_only = untied_copy(module.policy)
    before = [p.detach().clone() for p in module.policy.parameters()]
    holds = {"head": 0, "all": 0}
    trials = 6
    for seed in range(trials):
        rollout = sample_rollout(module, seed)
        scored = module.rlvr_step.prepare(module.step_context(), rollout)[0]
        for params, policy in (("head", head_only), ("all", module.policy)):
            out = thr_sign_check(policy, rollout, scored.advantages, pad, lr=1e-3, params=params)
            assert out["positive_tokens"] > 0 and out["negative_tokens"] > 0
            holds[params] += (out["positive"] > 0) + (out["negative"] < 0)
    assert holds["head"] == 2 * trials
    assert holds["all"] >= 1.5 * trials  # "clearly more often than not"; measured 100% on these seeds
    assert all(torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))  # weights restored
