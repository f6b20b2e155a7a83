"""OAR's scores (`attribution.oar`, docs/algorithms.md#oar): segmentation, Bi-Level weights on hand-made scores, OAR-P
against a one-token-at-a-time loop, OAR-G's hands off parameter gradients. The shaper inside the step:
tests/shapers/test_oar.py."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutput

from rlvr_lightning.attribution.oar import ScoringInput, bilevel_weights, oar_g_saliency, oar_p_scores, segment_boxed
from rlvr_lightning.models.policy import load_tokenizer

# ---- Bi-Level -------------------------------------------------------------------------------


def test_bilevel_matches_the_spec_vector():
    w, level = bilevel_weights(torch.tensor([0.0, 1, 3, 7, 15]), q=0.25, beta=1.0, floor=0.1)
    expected = torch.tensor([0.08197, 0.81967, 1.09290, 1.36612, 1.63934])
    torch.testing.assert_close(w, expected, atol=1e-5, rtol=0)
    assert level.tolist() == [-1, 0, 1, 1, 1]


@pytest.mark.parametrize("seed", range(5))
def test_bilevel_invariants_on_random_scores(seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(17, generator=g) ** 3 * 10
    raw, _ = bilevel_weights(a, q=0.3, beta=0.5, floor=0.2, sum_to_len=False)
    assert (raw >= 0.2 - 1e-6).all() and (raw <= 1.5 + 1e-6).all()  # floor and boost ≤ 1 + β before renormalising
    w, _ = bilevel_weights(a, q=0.3, beta=0.5, floor=0.2)
    assert w.mean().item() == pytest.approx(1.0, abs=1e-6)
    assert (w > 0).all()  # Â·w keeps the sign of Â
    for adv in (-1.3, 0.7):
        assert (torch.sign(adv * w) == torch.sign(torch.tensor(adv))).all()


def test_bilevel_degenerate_cases():
    assert torch.equal(bilevel_weights(torch.full((6,), 2.5))[0], torch.ones(6))  # constant scores
    assert torch.equal(bilevel_weights(torch.tensor([4.0]))[0], torch.ones(1))  # R = 1
    w, _ = bilevel_weights(torch.tensor([-3.0, -1.0, 0.0, 2.0]))  # negative φ-differences count as 0
    assert w[0] == w[1] == w[2]


# ---- segmentation ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tiny_policy_dir):
    return load_tokenizer(str(tiny_policy_dir))


def ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def test_segment_finds_reasoning_conclusion_and_answer(tok):
    prompt = ids(tok, "What is 3+4-2?\n")
    response = ids(tok, "3+4=7,7-2=5.\\boxed{5}") + [tok.eos_token_id]
    seg = segment_boxed(prompt, response, tok, conclude_template=" so \\boxed{")
    assert tok.decode(seg.ids[seg.r0 : seg.r1]) == "3+4=7,7-2=5."
    assert tok.decode(seg.ids[seg.a0 :]) == "5"
    assert tok.decode(seg.ids[seg.r1 : seg.a0]) == " so \\boxed{"
    assert seg.ids[: seg.r0] == prompt


@pytest.mark.parametrize(
    "text,answer",
    [("1+1=2.\\boxed{2}", "2"), ("\\boxed{1} then 2+2=4.\\boxed{4}", "4"), ("x=\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
     ("no box here", None), ("\\boxed{12", None), ("\\boxed{ }", None)],
)  # fmt: skip
def test_segment_edge_cases(tok, text, answer):
    seg = segment_boxed([], ids(tok, text), tok)
    assert (seg is None) == (answer is None)
    if seg is not None:
        assert tok.decode(seg.ids[seg.a0 :]) == answer
        assert text.rfind("\\boxed{") == len(tok.decode(seg.ids[: seg.r1]))


# ---- OAR-P / OAR-G on a real tiny model -------------------------------------------------------


@pytest.fixture(scope="module")
def policy(tiny_policy_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float32).eval()


def scoring_inputs(tok):
    out = []
    for prompt, response in [("What is 3+4-2?\n", "3+4=7,7-2=5.\\boxed{5}"), ("What is 10+1+5?\n", "10+1=11,11+5=16.\\boxed{16}")]:
        seg = segment_boxed(ids(tok, prompt), ids(tok, response), tok)
        out.append(seg)
    return out


def read_by_hand(policy, seq: list[int], x: ScoringInput, mode: str) -> torch.Tensor:
    """docs/algorithms.md#oar-scoring-input-and-read-outs from one unpadded forward, in float64:
    log P of the first answer token (`last`), log softmax of the logits averaged over the answer positions
    (`answer_mean`), or φ = the mean log-prob of the answer tokens (`answer_joint`)."""
    with torch.no_grad():
        z = policy(torch.tensor([seq])).logits[0].double()
    rows = [z[x.a0 - 1 + k] for k in range(x.answer_len)]  # position a0 − 1 + k predicts answer token k
    if mode == "last":
        return torch.nn.functional.log_softmax(rows[0], -1)
    if mode == "answer_mean":
        return torch.nn.functional.log_softmax(sum(rows) / len(rows), -1)
    logps = [row[x.ids[x.a0 + k]] - torch.logsumexp(row, -1) for k, row in enumerate(rows)]
    return sum(logps) / len(logps)


def divergence_by_hand(ref: torch.Tensor, other: torch.Tensor, mode: str) -> torch.Tensor:
    """KL(P_ref ‖ P_other) = Σ_v P_ref(v)·(log P_ref(v) − log P_other(v)) by torch's `kl_div` (which takes the
    second distribution's log-probs as input and the first's as target), or φ_ref − φ_other."""
    if mode == "answer_joint":
        return ref - other
    return torch.nn.functional.kl_div(other, ref, reduction="sum", log_target=True)


def test_the_hand_read_outs_and_kl_are_the_definitions():
    """The reference of the next test, on hand-made logits: the KL as an explicit sum, the read-outs by rule."""
    p, q = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64), torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)
    expected = 0.5 * math.log(2) + 0.25 * math.log(0.5)  # Σ p log(p/q)
    assert divergence_by_hand(p.log(), q.log(), "last").item() == pytest.approx(expected, rel=1e-12)
    assert divergence_by_hand(p.log(), p.log(), "last").item() == pytest.approx(0.0, abs=1e-15)


def oar_p_case(model: str, policy, tok):
    """(model, scoring inputs, pad id): the tiny HF Qwen2 (HF path: KV-cache reuse) with real text, where a
    substitution barely moves the untrained model's answer; or the constructed model below, where it moves
    it a lot (so that, e.g., KL(P‖P_m) and KL(P_m‖P) differ far beyond rounding)."""
    if model == "tiny-qwen2":
        return policy, scoring_inputs(tok), tok.pad_token_id
    inputs = [
        ScoringInput([1, 2, 3, 4, 5, 6, 7, 9, 4, 5], r0=1, r1=7, a0=8),
        ScoringInput([3, 1, 2, 8, 6, 9, 4, 5, 7], r0=2, r1=5, a0=6),
    ]
    return PositionWeightedLM(), inputs, 0


@pytest.mark.parametrize("model", ["tiny-qwen2", "constructed"])
@pytest.mark.parametrize("mode", ["last", "answer_mean", "answer_joint"])
def test_oar_p_equals_a_one_token_at_a_time_loop(policy, tok, mode, model):
    """OAR-P's batched (left-padded, cached) scores against the definition: one unpadded forward per
    substitution, read-out and KL written out in the test (not the module's `readout` / `divergence`)."""
    policy, inputs, pad = oar_p_case(model, policy, tok)
    assert max(x.answer_len for x in inputs) > 1  # `answer_mean` and `answer_joint` differ from `last`
    batched = oar_p_scores(policy, inputs, pad, mode=mode, chunk_size=5)
    for x, scores in zip(inputs, batched):
        ref = read_by_hand(policy, x.ids, x, mode)
        loop = []
        for m in range(x.r0, x.r1):
            perturbed = list(x.ids)
            perturbed[m] = pad
            loop.append(divergence_by_hand(ref, read_by_hand(policy, perturbed, x, mode), mode))
        loop = torch.stack(loop)
        torch.testing.assert_close(scores.double(), loop, atol=2e-6, rtol=1e-4)
        assert loop.abs().max() > 1e-5  # substitutions do move the read-out


def test_oar_p_scores_zero_when_the_substitute_is_the_original_token(policy, tok):
    pad = tok.pad_token_id
    seg = scoring_inputs(tok)[0]
    x = ScoringInput([pad if seg.r0 <= i < seg.r1 else t for i, t in enumerate(seg.ids)], seg.r0, seg.r1, seg.a0)
    (scores,) = oar_p_scores(policy, [x], pad)
    assert scores.abs().max() < 1e-5


def test_oar_g_leaves_parameter_gradients_untouched(policy, tok):
    params = list(policy.parameters())
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(i))  # as if earlier micro-batches had accumulated gradients
    flags = [p.requires_grad for p in params]
    saliency = oar_g_saliency(policy, scoring_inputs(tok), tok.pad_token_id, generators=None)
    assert all(torch.equal(p.grad, torch.full_like(p, float(i))) for i, p in enumerate(params))
    assert [p.requires_grad for p in params] == flags
    assert all(s.shape == (x.r1 - x.r0,) and (s >= 0).all() and s.sum() > 0 for s, x in zip(saliency, scoring_inputs(tok)))
    for p in params:
        p.grad = None


def test_oar_g_batching_is_exact(policy, tok):
    inputs = scoring_inputs(tok)
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(len(inputs))]  # noqa: E731
    together = oar_g_saliency(policy, inputs, tok.pad_token_id, generators=gens())
    alone = oar_g_saliency(policy, inputs, tok.pad_token_id, generators=gens(), chunk_size=1)
    for a, b in zip(together, alone):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-9)


def varied_scoring_inputs(tok):
    """Rollouts of different prompt, reasoning and answer lengths, so batches mix offsets and splits."""
    pairs = [("What is 3+4-2?\n", "3+4=7,7-2=5.\\boxed{5}"), ("What is 10+1+5?\n", "10+1=11,11+5=16.\\boxed{16}"),
             ("Compute 7*8.\n", "7*8=56.\\boxed{56}"), ("What is 100-1?\n", "100-1=99, so.\\boxed{99}"),
             ("1+1?\n", "2.\\boxed{2}")]  # fmt: skip
    return [segment_boxed(ids(tok, p), ids(tok, r), tok) for p, r in pairs]


@pytest.mark.parametrize("chunk_size", [2, 32])
@pytest.mark.parametrize("mode", ["last", "answer_mean", "answer_joint"])
def test_prefix_reuse_gives_the_scores_of_full_forwards(policy, tok, mode, chunk_size, monkeypatch):
    """OAR-P's perturbed copies and OAR-G's noisy pass start at their first changed column, on the clean
    forward's KV cache; the scores equal those of full forwards."""
    import rlvr_lightning.attribution.oar as oar

    prefixes = []
    cut = oar._prefix_of
    monkeypatch.setattr(oar, "_prefix_of", lambda *a: prefixes.append(cut(*a)) or prefixes[-1])
    inputs = varied_scoring_inputs(tok)
    pad = tok.pad_token_id
    cached = oar_p_scores(policy, inputs, pad, mode=mode, chunk_size=chunk_size)
    full = oar_p_scores(policy, inputs, pad, mode=mode, chunk_size=chunk_size, reuse_prefix=False)
    for a, b in zip(cached, full):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    assert prefixes and all(p is not None and p.get_seq_length() > 0 for p in prefixes)  # the cache was used
    used_by_p = len(prefixes)
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(len(inputs))]  # noqa: E731
    cached = oar_g_saliency(policy, inputs, pad, mode=mode, generators=gens(), chunk_size=chunk_size)
    full = oar_g_saliency(policy, inputs, pad, mode=mode, generators=gens(), chunk_size=chunk_size, reuse_prefix=False)
    for a, b in zip(cached, full):
        assert (a > 0).any()
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-9)
    assert len(prefixes) > used_by_p and all(p is not None for p in prefixes)


class PositionWeightedLM(torch.nn.Module):
    """A constructed causal LM: the state at t is Σ_{s ≤ t} c_{pos(s)}·e(x_s), logits = W·state.
    A token at a position with large c moves every later answer distribution more."""

    def __init__(self, vocab=12, d=8, weights=(0.05, 0.1, 3.0, 0.2, 1.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1)):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(vocab, d, generator=g))
            self.head.weight.copy_(torch.randn(vocab, d, generator=g))
        self.register_buffer("c", torch.tensor(weights))

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None, position_ids=None, logits_to_keep=0, use_cache=False):
        e = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            position_ids = torch.arange(e.shape[1])[None].expand(e.shape[0], -1)
        mask = attention_mask if attention_mask is not None else torch.ones(e.shape[:2])
        state = (e * (self.c[position_ids] * mask)[..., None]).cumsum(1)
        logits = self.head(state)
        return CausalLMOutput(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def test_the_more_a_token_moves_the_answer_the_higher_its_scores():
    model = PositionWeightedLM()
    # prompt [1], reasoning positions 1..6 (weights .1, 3, .2, 1, .1, .1), conclusion [9], answer [4, 5]
    x = ScoringInput([1, 2, 3, 4, 5, 6, 7, 9, 4, 5], r0=1, r1=7, a0=8)
    (p_scores,) = oar_p_scores(model, [x], pad_id=0)
    (g_scores,) = oar_g_saliency(model, [x], pad_id=0, generators=[torch.Generator().manual_seed(0)])
    assert p_scores.argmax().item() == 1 and g_scores.argmax().item() == 1  # position 2, weight 3.0
    assert p_scores[3] > p_scores[0] and p_scores[3] > p_scores[4]  # weight 1.0 beats 0.1


def test_oar_g_and_oar_p_rankings_agree_on_constructed_models():
    """OAR-G ranks tokens like OAR-P on models where a token's influence is known (its position weight).
    Measured on the HF tiny models by bench/oar_rank_agreement.py (weaker there: see bench/README.md)."""
    from torchmetrics.functional import spearman_corrcoef

    rhos = []
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        model = PositionWeightedLM(weights=tuple((torch.rand(12, generator=g) * 2).tolist()))
        x = ScoringInput(torch.randint(1, 12, (10,), generator=g).tolist(), r0=1, r1=7, a0=8)
        (p_scores,) = oar_p_scores(model, [x], pad_id=0, mode="answer_mean")
        (g_scores,) = oar_g_saliency(model, [x], pad_id=0, generators=[g], baseline="pad")
        rhos.append(spearman_corrcoef(p_scores, g_scores))
    rho = torch.stack(rhos)
    print(f"OAR-G vs OAR-P Spearman on constructed models: mean {rho.mean():.3f}, min {rho.min():.3f}")
    assert rho.mean() > 0.5
