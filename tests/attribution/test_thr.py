"""THR (docs/algorithms.md#thr): scores against the definition, dominance and weights on
hand-made values, and the callback inside the real module (p = 0 is the base algorithm, bit for bit)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from rlvr_lightning.algos import GRPO, GSPO, REAL
from rlvr_lightning.attribution.thr import dominant_tokens, group_thr_scores, thr_token_weights
from rlvr_lightning.callbacks.attribution import THRAttribution
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.models.forward import policy_forward
from rlvr_lightning.training.settings import ComputeSettings
from rlvr_lightning.training.shaping import HiddenWeigher
from tests.support.settings import checked
from tests.support.update_harness import attach, gradient, prepared, sample_rollout


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


def test_callback_rejects_bad_arguments():
    with pytest.raises(ConfigError, match="p=1.5"):
        THRAttribution(p=1.5)
    with pytest.raises(ConfigError, match="thr_abs"):
        THRAttribution(p=0.1, threshold="absolute")
    with pytest.raises(ConfigError, match="threshold"):
        THRAttribution(p=0.1, threshold="median")


def with_thr(cls, tiny_policy_dir, thr: THRAttribution | None, **kwargs):
    module = attach(cls, tiny_policy_dir, **kwargs)
    if thr is not None:
        module.trainer.callbacks.append(thr)
    return module


def test_p_zero_is_the_base_algorithm_bit_for_bit(tiny_policy_dir):
    base = with_thr(GRPO, tiny_policy_dir, None)
    thr = with_thr(GRPO, tiny_policy_dir, THRAttribution(p=0.0))
    inputs_base, inputs_thr = prepared(base, sample_rollout(base)), prepared(thr, sample_rollout(thr))
    assert torch.equal(inputs_base.advantages, inputs_thr.advantages)
    loss_b, grad_b = gradient(base, inputs_base, 3)
    loss_t, grad_t = gradient(thr, inputs_thr, 3)
    assert torch.equal(loss_b, loss_t) and torch.equal(grad_b, grad_t)


def test_module_captures_the_hidden_states_that_produce_old_logprobs(tiny_policy_dir):
    """The forward grabs the LM-head inputs at the positions predicting each response token, and the
    scorer keeps those of the rows it needs, across micro-batch boundaries."""
    module = with_thr(GRPO, tiny_policy_dir, None)
    rollout = sample_rollout(module)
    t = rollout.tensors(module.trainer.datamodule.tokenizer.pad_token_id)
    rows = torch.tensor([True, False, True, True, False, False, False, True])
    scorer = HiddenWeigher(module.step_context(), None, [], rows)
    hidden, old = {}, []
    for mb_rows in torch.arange(8).split(3):
        forward = policy_forward(module.policy, t.select(mb_rows), 0.8, capture_lm_head=True)
        old.append(forward.logp.detach())
        hidden.update(scorer.hidden_of(forward.lm_head_in, mb_rows, t.select(mb_rows).response_mask))
    old = torch.cat(old)
    assert sorted(hidden) == [0, 2, 3, 7]
    head = module.policy.get_output_embeddings()
    for n, h in hidden.items():
        L_n = len(rollout.completions[n].token_ids)
        logp = (head(h).float() / 0.8).log_softmax(-1)
        targets = torch.tensor(rollout.completions[n].token_ids)
        torch.testing.assert_close(logp.gather(-1, targets[:, None]).squeeze(1), old[n, :L_n], rtol=1e-5, atol=1e-5)


class THRRun(NamedTuple):
    module: object
    rollout: object
    advantages: torch.Tensor  # [N] sequence advantages
    weights: torch.Tensor  # THR's token weights
    metrics: dict  # THR's batch metrics
    seen: torch.Tensor  # the token advantages the micro-batch losses received
    loss: torch.Tensor
    grad: torch.Tensor
    read_in_update: bool


class RecordingObjective:
    """The update's objective, recording the token advantages each micro-batch loss receives."""

    def __init__(self, objective, seen: list) -> None:
        self.objective, self.seen = objective, seen

    def __getattr__(self, name):
        return getattr(self.objective, name)

    def micro_batch_loss(self, mb, logp, norms, *rest):
        self.seen.append(mb.advantages)
        return self.objective.micro_batch_loss(mb, logp, norms, *rest)


def thr_update(tiny_policy_dir, p, micro_batch_size, rollout_edit=None):
    """THR on GRPO through the module's preparation and one update's gradient; micro_batch_size 4 (= G)
    reads θ_old's LM-head inputs in the update's forward, 3 (splits groups) in the separate no-grad pass.
    What it returns: `THRRun`."""
    thr = THRAttribution(p=p, threshold="all")
    module = with_thr(GRPO, tiny_policy_dir, thr, compute=ComputeSettings(micro_batch_size=micro_batch_size))
    rollout = sample_rollout(module)
    if rollout_edit:
        rollout_edit(rollout)
    scored, inputs, _ = module.rlvr_step.prepare(module.step_context(), rollout)
    read_in_update = inputs.behaviour.reads_lm_head
    seen = []  # the token advantages each micro-batch loss received

    def record(update):
        update.objective = RecordingObjective(update.objective, seen)

    loss, grad = gradient(module, inputs, micro_batch_size, tweak=record)
    weights = inputs.token_weights()  # those read in the update's forwards too
    return THRRun(module, rollout, scored.advantages, weights, thr.batch_metrics(), torch.cat(seen), loss, grad, read_in_update)


def no_correct_in_group_1(rollout):
    rollout.correct[4:] = 0.0  # group 1 now has no correct rollout: Â ≡ 0 and no THR


@pytest.mark.parametrize("micro_batch_size", [4, 3])
@pytest.mark.parametrize("p", [0.3, -0.3])
def test_callback_reweights_mixed_groups_only(tiny_policy_dir, p, micro_batch_size):
    _, rollout, _, w, metrics, used, _, _, read_in_update = thr_update(tiny_policy_dir, p, micro_batch_size, no_correct_in_group_1)
    assert read_in_update == (micro_batch_size == 4)
    mask = rollout.tensors(0).response_mask
    # The unweighted token advantages, from the verdicts by docs/algorithms.md#group-relative-advantages (r = c).
    c = rollout.correct.view(-1, 4)
    unweighted = ((c - c.mean(1, keepdim=True)) / (c.std(1, keepdim=True) + 1e-6)).view(-1, 1) * mask
    assert (unweighted[:4][mask[:4].bool()] != 0).all() and (unweighted[4:] == 0).all()
    # No weight flipped a sign: every token advantage the loss received has the sign of the unweighted one.
    flipped = int((torch.sign(used) != torch.sign(unweighted)).sum())
    assert flipped == 0, f"{flipped} token advantages changed sign (or left/became 0)"
    torch.testing.assert_close(used, unweighted * w)  # the loss received Â' = Â·w token by token
    assert (w[4:] == 1).all()
    values = w[:4][mask[:4].bool()]
    near = [torch.isclose(values, torch.tensor(v)) for v in (1 + p, 1 - p, 1.0)]
    assert (near[0] | near[1] | near[2]).all() and (near[0] | near[1]).any()
    assert metrics["thr/dominant_frac"] == 1.0
    assert metrics["thr/positive_frac"] + metrics["thr/negative_frac"] == pytest.approx(1.0)


@pytest.mark.parametrize("micro_batch_size", [4, 3])
def test_in_an_environment_thr_weighs_the_sampled_tokens_and_leaves_the_inserted_ones_at_one(tiny_policy_dir, micro_batch_size):
    """Through the module's preparation and update (THR read in the update's forward, or in the θ_old pass): the
    tokens a tool inserted weigh exactly 1 and are not counted in THR's metrics; every sampled token of a mixed
    group is reweighted (threshold `all`)."""
    from tests.environments.test_episodes import SAMPLED, with_inserted_tokens

    thr = THRAttribution(p=0.3, threshold="all")
    module = with_thr(GRPO, tiny_policy_dir, thr, compute=ComputeSettings(micro_batch_size=micro_batch_size))
    rollout = with_inserted_tokens(sample_rollout(module))
    scored, inputs, _ = module.rlvr_step.prepare(module.step_context(), rollout)
    gradient(module, inputs, micro_batch_size)
    w, sampled = inputs.token_weights(), inputs.tensors.sampled_mask.bool()
    inserted = inputs.tensors.response_mask.bool() & ~sampled
    assert inserted.sum() == sum(m.count(0) for m in SAMPLED.values()) and (w[inserted] == 1.0).all()
    c = rollout.correct.view(-1, 4)
    mixed = ((c.sum(1) > 0) & (c.sum(1) < 4)).repeat_interleave(4)[:, None] & sampled
    assert mixed.any() and torch.isclose(w[mixed], torch.tensor(1.3)).logical_or(torch.isclose(w[mixed], torch.tensor(0.7))).all()
    assert thr.batch_metrics()["thr/tokens"] == mixed.sum().item()


def test_thr_read_in_the_update_equals_a_separate_theta_old_pass(tiny_policy_dir):
    """One update per rollout batch: THR scored from the update's own forward (no θ_old pass) gives the
    weights, metrics, loss and gradient of THR scored from a separate no-grad θ_old forward."""
    *_, w_in, m_in, in_in, loss_in, grad_in, read_in = thr_update(tiny_policy_dir, 0.3, 4)
    *_, w_sep, m_sep, in_sep, loss_sep, grad_sep, read_sep = thr_update(tiny_policy_dir, 0.3, 3)
    assert read_in and not read_sep
    assert torch.equal(w_in, w_sep)
    assert (w_in != 1).any()
    torch.testing.assert_close(in_in, in_sep)  # the token advantages the losses received
    for key in ("thr/tokens", "thr/positive_frac", "thr/abs_p50", "thr/abs_max"):
        assert m_in[key] == pytest.approx(m_sep[key], rel=1e-5)
    assert loss_in.item() == pytest.approx(loss_sep.item(), rel=1e-5)
    torch.testing.assert_close(grad_in, grad_sep, rtol=1e-4, atol=1e-7)


def test_thr_composes_with_gspo_token_and_is_refused_where_it_cannot(tiny_policy_dir):
    gspo_token = {"name": "gspo-token", "knobs": {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4}}  # GSPO's clip range
    module = with_thr(GSPO, tiny_policy_dir, THRAttribution(p=0.2), policy_loss=gspo_token, num_mini_batches=2)
    checked(module)
    with pytest.raises(ConfigError, match="policy_loss=gspo does not honour them"):
        checked(with_thr(GSPO, tiny_policy_dir, THRAttribution(p=0.2), num_mini_batches=2))
    with pytest.raises(ConfigError, match="policy_loss=real-anchor does not honour them"):
        checked(with_thr(REAL, tiny_policy_dir, THRAttribution(p=0.2), compute=ComputeSettings(micro_batch_size=4), num_mini_batches=1))
    with pytest.raises(ConfigError, match="policy_loss=gmpo does not honour them"):  # one term per sequence
        checked(with_thr(GRPO, tiny_policy_dir, THRAttribution(p=0.2), policy_loss="gmpo"))
    for loss in ("cispo", "sapo"):  # per-token losses take the reshaped token advantages
        checked(with_thr(GRPO, tiny_policy_dir, THRAttribution(p=0.2), policy_loss=loss))
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
