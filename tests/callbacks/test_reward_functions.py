"""A user's reward functions (`RewardFunctions`), the documented example (`docs/examples/my_rewards.py`) first:
their terms join the reward, each is logged on its own, and a broken one is a one-line error."""

from __future__ import annotations

import sys

import pytest
import torch

from rlvr_lightning.callbacks.reward_functions import RewardFunction, RewardFunctions
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig, Verdict
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
    r = Rollout(batch=PromptBatch(["p"], ["3 + 4 = ?"], ["7"]), group_size=len(texts), prompt_ids=[[1]],
                completions=completions, sampling=SamplingConfig(group_size=len(texts)), policy_version=0, texts=texts)  # fmt: skip
    return r.scored(Verdict(torch.tensor([1.0, 0.0, 0.0])))  # the verifier's verdict, as a run has it first


def test_the_documented_functions_add_weighted_terms_and_log_each_one(examples_on_path):
    texts = ["3+4=7 so \\boxed{7}", "\\boxed{8}", "x" * 32]
    callback = RewardFunctions([RewardFunction("my_rewards.brevity", weight=0.1), {"function": "my_rewards.shows_work"}])
    r = rollout(texts, finish=["stop", "stop", "length"])
    scored = r.scored(callback.on_rollout_generated(None, r))
    brevity = torch.tensor([1 / (1 + 18 / 16), 1 / (1 + 9 / 16), 0.0])  # hand-computed: 18 and 9 tokens, one cut
    torch.testing.assert_close(scored.reward_terms["brevity"], 0.1 * brevity)
    torch.testing.assert_close(scored.reward_terms["shows_work"], torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(scored.correct, torch.tensor([1.0, 0.0, 0.0]))  # correctness stays the verifier's
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
    r = rollout(texts)
    r = r.scored(RewardFunctions([RewardFunction("my_rewards.shows_work", weight=0.5)]).on_rollout_generated(None, r))
    grpo, _ = StepAlgorithm().rewards(r)
    assert torch.equal(grpo, torch.tensor([1.5, 0.0, 0.0]))
    dapo, _ = DAPOStep(None, True, 16, 1.0, 32).rewards(r)
    assert torch.equal(dapo, torch.tensor([1.5, -1.0, -2.0]))  # ±1, + 0.5·[1, 0, 0], − 1·[0, 0, 1] (at the limit)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("my_rewards.nowhere", r"^RewardFunctions: cannot import 'my_rewards.nowhere' \(AttributeError"),
        ("not_a_module.f", r"^RewardFunctions: cannot import 'not_a_module.f' .*put its directory on PYTHONPATH$"),
        ("brevity", r"^RewardFunctions: 'brevity' is not a dotted path"),
    ],
)
def test_a_function_that_cannot_be_loaded_is_one_line_at_setup(examples_on_path, spec, match):
    with pytest.raises(ConfigError, match=match):
        RewardFunctions([RewardFunction(spec)]).loaded()


def test_a_function_that_fails_or_returns_no_number_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text(
        "def raises(c, g, m):\n    return {}['missing']\n\ndef text(c, g, m):\n    return 'high'\n\ndef nan(c, g, m):\n    return float('nan')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        for name, match in [("raises", r"failed on a completion \(KeyError: 'missing'\)$"), ("text", r"returned 'high'"),
                            ("nan", r"returned nan: a reward must be a finite number")]:  # fmt: skip
            callback = RewardFunctions([RewardFunction(f"broken_rewards.{name}")])
            with pytest.raises(ConfigError, match=rf"^reward function broken_rewards.{name} .*{match}") as e:
                callback.on_rollout_generated(None, rollout(["a", "b", "c"]))
            assert "\n" not in str(e.value)
    finally:
        sys.modules.pop("broken_rewards", None)
