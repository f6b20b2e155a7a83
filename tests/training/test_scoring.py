"""The scoring stage (`training.scoring`) on real answers: math-verify's correctness with its options, a user's
correctness (partial credit) and reward terms, the environment's verdict as correctness, and the reward they make
(r = w_c · c + Σ wᵢ · fᵢ)."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rewards.settings import RewardFunction, RewardSettings, VerifierSettings
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.training.scoring import Scoring, answer_metadata

ANSWERS = ["so \\boxed{4}", "\\boxed{5}", "\\boxed{3} or \\boxed{4}", "I think 4"]
ONE_WORKER = VerifierSettings(num_workers=1)


def rollout(texts=ANSWERS, environment=None) -> Rollout:
    completions = [Completion([5] * (n + 1), [-1.0] * (n + 1), "stop") for n in range(len(texts))]
    terms = {} if environment is None else {"environment": torch.tensor(environment)}
    return Rollout(PromptBatch(["p"], ["2+2?"], ["4"]), len(texts), [[1]], completions,
                   SamplingConfig(group_size=len(texts)), 0, texts=texts, reward_terms=terms)  # fmt: skip


def scored(settings: RewardSettings, r: Rollout | None = None) -> Rollout:
    scoring = Scoring(settings)
    try:
        return scoring.score(r or rollout())
    finally:
        scoring.close()


def test_math_verify_gives_correctness_and_its_options_are_the_sections():
    default = scored(RewardSettings(verifier=ONE_WORKER))
    assert default.correct.tolist() == [1.0, 0.0, 0.0, 0.0]  # two boxes, one wrong: `wrong`; no box: no answer
    assert default.reward_with_terms(default.correct.clone()).tolist() == [1.0, 0.0, 0.0, 0.0]
    last = scored(RewardSettings(verifier=VerifierSettings(num_workers=1, multiple_boxed="last")))
    assert last.correct.tolist() == [1.0, 0.0, 1.0, 0.0]  # the last box is graded
    assert default.metrics["multiple_boxed_frac"] == 0.25 and default.metrics["no_answer_frac"] == 0.25


def test_math_verify_alone_builds_no_metadata_and_a_users_function_gets_the_steps(monkeypatch):
    """The metadata a user's function is told is built only where one runs: math-verify's correctness with no reward
    function reads none of it (a rollout batch of thousands of answers would build it for nothing)."""
    from rlvr_lightning.training import scoring as stage

    built = []

    def counted(rollout, rollout_batch=0, rank=0):
        built.append((rollout_batch, rank))
        return answer_metadata(rollout, rollout_batch, rank)

    monkeypatch.setattr(stage, "answer_metadata", counted)
    scoring = Scoring(RewardSettings(verifier=ONE_WORKER))
    try:
        assert scoring.score(rollout(), rollout_batch=3, rank=1).correct.tolist() == [1.0, 0.0, 0.0, 0.0]
    finally:
        scoring.close()
    assert built == []
    seen = []
    monkeypatch.setattr(stage, "load_function", lambda path, who: lambda text, gold, metadata: seen.append(metadata) or 1.0)
    Scoring(RewardSettings(correctness="my.correctness")).score(rollout(), rollout_batch=3, rank=1)
    assert built == [(3, 1)]  # once per rollout batch, with the step's counters
    assert [(m["rollout_batch"], m["rank"], m["index"], m["id"]) for m in seen] == [(3, 1, n, "p") for n in range(4)]


def test_a_users_correctness_gives_partial_credit_and_reward_terms_add_weighted():
    settings = RewardSettings(
        correctness="tests.support.rewards.half_credit_for_an_answer",
        functions=[RewardFunction("tests.support.rewards.brevity", weight=0.01)],
    )
    r = scored(settings)
    assert r.correct.tolist() == [1.0, 0.5, 1.0, 1.0]  # the gold "4" appears in three answers
    lengths = torch.tensor([float(len(t)) for t in ANSWERS])
    torch.testing.assert_close(r.reward_terms["brevity"], -0.01 * lengths)
    torch.testing.assert_close(r.reward_with_terms(r.correct.clone()), r.correct - 0.01 * lengths)
    assert r.metrics["reward_brevity_mean"] == pytest.approx(-lengths.mean().item())
    assert r.metrics["reward_brevity_tokens"] == pytest.approx(2.5)  # the function's own metric, averaged


def test_a_reward_that_replaces_correctness_leaves_correctness_the_accuracy():
    settings = RewardSettings(verifier=ONE_WORKER, correctness_weight=0.0,
                              functions=[RewardFunction("tests.support.rewards.half_credit_for_an_answer", name="credit")])
    r = scored(settings)
    assert r.correct.tolist() == [1.0, 0.0, 0.0, 0.0]  # math-verify's, still the accuracy
    assert r.reward_with_terms(r.correct.clone()).tolist() == [1.0, 0.5, 1.0, 1.0]  # the reward is the function's


def test_the_environment_owns_the_verdict_where_asked_and_adds_a_term_otherwise():
    verdicts = [1.0, 0.0, 1.0, 0.0]
    owned = scored(RewardSettings(correctness="environment"), rollout(environment=verdicts))
    assert owned.correct.tolist() == verdicts and "environment" not in owned.reward_terms
    with pytest.raises(ConfigError, match="the environment gave no verdict"):
        scored(RewardSettings(correctness="environment"))
    with pytest.raises(ConfigError, match=r"correctness is in \[0, 1\]"):
        scored(RewardSettings(correctness="environment"), rollout(environment=[2.0, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"correctness": "exact"}, r"^model.rewards.correctness='exact'; valid: math-verify, environment"),
     ({"correctness_weight": 0.0}, r"^model.rewards.correctness_weight=0 with no model.rewards.functions"),
     ({"verifier": {"multiple_boxed": "first"}}, r"model.rewards.verifier.multiple_boxed"),
     ({"functions": [{"function": "a.f"}, {"function": "b.f"}]}, r"give each a distinct name"),
     ({"weight": 1.0}, r"^model.rewards: unknown option 'weight'")],
)  # fmt: skip
def test_a_bad_section_is_one_error_line(settings, message):
    with pytest.raises(ConfigError, match=message):
        Scoring(RewardSettings.of(settings))


def test_a_function_that_cannot_be_imported_is_one_line():
    with pytest.raises(ConfigError, match=r"^model.rewards.correctness: cannot import"):
        Scoring(RewardSettings(correctness="tests.support.rewards.no_such_function"))


def test_a_run_whose_reward_replaces_correctness_trains(quick_warm_start):
    """Through a real step (the HF engine on the embedded model): with w_c = 0 the reward is the partial-credit
    function's alone, correctness stays math-verify's, and the update moves the weights."""
    from rlvr_lightning.algos import GRPO
    from tests.support.plain_step import plain_step

    rewards = {"correctness_weight": 0.0, "verifier": {"num_workers": 1},
               "functions": [{"function": "tests.support.rewards.half_credit_for_an_answer", "name": "credit"}]}  # fmt: skip
    run = plain_step(GRPO, quick_warm_start[1], rewards=rewards)
    try:
        before = {k: v.clone() for k, v in run.policy.state_dict().items()}
        for _ in range(2):
            result = run.train_on_next_batch()
            rollout = result.batch.rollout
            torch.testing.assert_close(result.batch.rewards, rollout.reward_terms["credit"])  # r = Σ wᵢ·fᵢ alone
            assert set(rollout.correct.tolist()) <= {0.0, 1.0}  # c: math-verify's verdict
        assert max((run.policy.state_dict()[k] - v).abs().max().item() for k, v in before.items()) > 0
    finally:
        run.close()
