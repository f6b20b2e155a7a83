"""The token view (`callbacks.token_view`): a page that needs nothing from the network, every token with its values
and marks; on a real GRPO step with THR, each token's weight is the step's own THR weight and its advantage Â·w."""

from __future__ import annotations

import re

import pytest
import torch

from rlvr_lightning.algos import GRPO
from rlvr_lightning.callbacks.token_view import TokenAnswer, token_answers, token_view_html
from tests.support.plain_step import plain_step
from tests.support.rewards import PARITY


def test_the_page_is_self_contained_and_marks_inserted_and_masked_tokens():
    answer = TokenAnswer(
        "answer 0", ["<a>", " b", " c"],
        {"advantage": [0.5, None, -0.25], "weight": [1.2, 1.0, 0.8], "mismatch": [0.0, None, 1e-3], "correction": [1.0, 1.0, 1.0],
         "entropy": [0.7, None, 0.1]},
        inserted=[False, True, False], masked=[False, False, True],
    )  # fmt: skip
    page = token_view_html([answer], "Rollout batch 3")
    assert "http" not in page and "src=" not in page  # no network, no script or style from elsewhere
    spans = re.findall(r'<span class="t ([^"]*)" title="([^"]*)"[^>]*>([^<]*)</span>', page)
    assert [s[2] for s in spans] == ["&lt;a&gt;", " b", " c"]  # escaped
    assert [s[0].strip() for s in spans] == ["", "inserted", "masked"]
    assert "shaper weight w (THR, OAR) = 1.2" in spans[0][1] and "inserted by the environment" in spans[1][1]
    assert 'data-advantage=""' in page  # an inserted token has no advantage


@pytest.mark.e2e
def test_on_a_grpo_step_with_thr_each_tokens_weight_and_advantage_are_the_steps(quick_warm_start):
    run = plain_step(GRPO, quick_warm_start[1], shapers={"thr": {"p": 0.5, "threshold": "all"}}, rewards={"correctness": PARITY})
    run.entropy_groups = 2  # of the 4 groups: the first 8 answers' entropy kept
    try:
        result = run.train_on_next_batch()
        weights = result.token_weights
        assert weights is not None and (weights != 1).any()  # THR weighted some tokens
        rows = range(result.batch.rollout.num_sequences)
        answers = token_answers(result, rows, run.tokenizer.decode)
        for n, answer in zip(rows, answers):
            L = len(result.batch.rollout.completions[n].token_ids)
            w = torch.ones(L)
            w[: min(L, weights.shape[1])] = weights[n, :L]
            assert answer.values["weight"] == pytest.approx(w.tolist())
            assert answer.values["advantage"] == pytest.approx((float(result.batch.advantages[n]) * w).tolist())
            assert all(abs(v) < 1e-3 for v in answer.values["mismatch"])  # HF engine: the trainer's own weights
            kept = result.token_entropy[n, :L].tolist() if n < 8 else [None] * L
            assert answer.values["entropy"] == pytest.approx(kept)
        page = token_view_html(answers, "step 0")
        assert page.count('class="answer"') == len(rows)
        assert result.token_entropy.shape[0] == 8 and "policy entropy (nats) = " in page
    finally:
        run.close()


@pytest.mark.e2e
def test_the_kept_entropy_is_the_updates_own_per_token_entropy(quick_warm_start):
    """Kept for every group, the rows' per-token entropy averages over the loss's tokens to the update's logged
    `entropy` (one update of the whole batch: each row's one forward) and lies in [0, log V]; a step that keeps none
    has none."""
    import math

    run = plain_step(GRPO, quick_warm_start[1])
    try:
        assert run.train_on_next_batch().token_entropy is None
        run.entropy_groups = 4  # every group of the batch
        result = run.train_on_next_batch()
        entropy, mask = result.token_entropy, result.inputs.loss_mask.bool().cpu()
        width = min(entropy.shape[1], mask.shape[1])
        assert entropy.shape[0] == result.batch.rollout.num_sequences
        assert not mask[:, width:].any() and not torch.isnan(entropy[:, :width][mask[:, :width]]).any()
        assert float(entropy[:, :width][mask[:, :width]].mean()) == pytest.approx(result.metrics["entropy"], rel=1e-4)
        real = entropy[:, :width][mask[:, :width]]
        assert (real >= -1e-6).all() and (real <= math.log(run.policy.config.vocab_size) + 1e-4).all()
    finally:
        run.close()
