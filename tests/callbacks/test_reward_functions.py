"""A user's reward functions (`model.rewards.functions`, scored by `training.scoring`), the documented example
(`docs/examples/my_rewards.py`) first: their terms join the reward, each is logged on its own, and a broken one is a
one-line error."""

from __future__ import annotations

import sys

import pytest
import torch

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rewards.settings import RewardFunction, RewardSettings, VerifierSettings
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.training.scoring import Scoring
from tests.support.cli import REPO

EXAMPLES = REPO / "docs" / "examples"


@pytest.fixture
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield
    for name in ("my_rewards", "broken_rewards"):
        sys.modules.pop(name, None)


def rollout(texts, finish=None) -> Rollout:
    """One prompt (gold 7), one completion per text; each completion's length is its text's."""
    finish = finish or ["stop"] * len(texts)
    completions = [Completion(list(range(len(t))), [0.0] * len(t), f) for t, f in zip(texts, finish)]
    return Rollout(batch=PromptBatch(["p"], ["3 + 4 = ?"], ["7"]), group_size=len(texts), prompt_ids=[[1]],
                   completions=completions, sampling=SamplingConfig(group_size=len(texts)), policy_version=0, texts=texts)  # fmt: skip


def scored_with(functions, r: Rollout) -> Rollout:
    """`r` scored by math-verify and `functions`, as a run's scoring stage scores it."""
    scoring = Scoring(RewardSettings(functions=functions, verifier=VerifierSettings(num_workers=1)))
    try:
        return scoring.score(r)
    finally:
        scoring.close()


def test_the_documented_functions_add_weighted_terms_and_log_each_one(examples_on_path):
    texts = ["3+4=7 so \\boxed{7}", "\\boxed{8}", "x" * 32]
    functions = [RewardFunction("my_rewards.brevity", weight=0.1), RewardFunction("my_rewards.shows_work")]
    scored = scored_with(functions, rollout(texts, finish=["stop", "stop", "length"]))
    brevity = torch.tensor([1 / (1 + 18 / 16), 1 / (1 + 9 / 16), 0.0])  # hand-computed: 18 and 9 tokens, one cut
    torch.testing.assert_close(scored.reward_terms["brevity"], 0.1 * brevity)
    torch.testing.assert_close(scored.reward_terms["shows_work"], torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(scored.correct, torch.tensor([1.0, 0.0, 0.0]))  # correctness stays math-verify's
    assert scored.metrics["reward_brevity_mean"] == pytest.approx(brevity.mean().item())
    assert scored.metrics["reward_shows_work_steps"] == pytest.approx(1 / 3)  # the function's own metric: 1, 0, 0 steps
    reward = scored.reward_with_terms(scored.correct.clone())
    torch.testing.assert_close(reward, torch.tensor([1.0, 0.0, 0.0]) + 0.1 * brevity + torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(rollout(texts).reward_with_terms(torch.ones(3)), torch.ones(3))  # no terms: unchanged


def test_the_algorithms_reward_takes_the_terms(examples_on_path):
    """GRPO's r = c + 0.5·f; DAPO's: its ±1 reward plus the term, then its overlong penalty (the third is 32 tokens
    long, at a 32-token limit with a 16-token buffer: −1 at factor 1)."""
    from rlvr_lightning.algos.dapo import DAPOStep
    from rlvr_lightning.training.step import StepAlgorithm

    texts = ["a=b \\boxed{7}", "\\boxed{8}", "x" * 32]
    r = scored_with([RewardFunction("my_rewards.shows_work", weight=0.5)], rollout(texts, finish=["stop", "stop", "length"]))
    grpo, _ = StepAlgorithm().rewards(r)
    assert torch.equal(grpo, torch.tensor([1.5, 0.0, 0.0]))
    dapo, _ = DAPOStep(None, True, 16, 1.0, 32).rewards(r)
    assert torch.equal(dapo, torch.tensor([1.5, -1.0, -2.0]))  # ±1, + 0.5·[1, 0, 0], − 1·[0, 0, 1] (at the limit)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("my_rewards.nowhere", r"^model.rewards.functions: cannot import 'my_rewards.nowhere' \(AttributeError"),
        ("not_a_module.f", r"^model.rewards.functions: cannot import 'not_a_module.f' .*put its directory on PYTHONPATH$"),
        ("brevity", r"^model.rewards.functions: 'brevity' is not a dotted path"),
    ],
)
def test_a_function_that_cannot_be_loaded_is_one_line_at_setup(examples_on_path, spec, match):
    with pytest.raises(ConfigError, match=match):
        Scoring(RewardSettings(functions=[RewardFunction(spec)]))


def test_a_function_that_fails_or_returns_no_number_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text(
        "def raises(c, g, m):\n    return {}['missing']\n\ndef text(c, g, m):\n    return 'high'\n\ndef nan(c, g, m):\n    return float('nan')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        for name, match in [("raises", r"failed on a completion \(KeyError: 'missing'\)$"), ("text", r"returned 'high'"),
                            ("nan", r"returned nan: a reward must be a finite number")]:  # fmt: skip
            with pytest.raises(ConfigError, match=rf"^reward function broken_rewards.{name} .*{match}") as e:
                scored_with([RewardFunction(f"broken_rewards.{name}")], rollout(["a", "b", "c"]))
            assert "\n" not in str(e.value)
    finally:
        sys.modules.pop("broken_rewards", None)
