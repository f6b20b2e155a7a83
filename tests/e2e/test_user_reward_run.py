"""The documented examples of a user's reward functions (docs/pieces.md#your-own-reward-function) and of a user's
environment (docs/environments.md) run as a user runs them: the CLI with docs/examples on PYTHONPATH, 2 rollout
batches, both in one fit (each is also checked on its own: tests/callbacks/test_reward_functions.py,
tests/environments/test_episodes.py); and a broken one of each as one line."""

from __future__ import annotations

import pytest

from tests.e2e.test_presets import finished_run, preset_args
from tests.support.cli import REPO, run_cli, run_in_process

EXAMPLE = ["--model.init_args.rewards.functions=[{function: my_rewards.brevity, weight: 0.1}, {function: my_rewards.shows_work}]"]
ENVIRONMENT = ["--data.environment", "my_environment.SecondChance"]


@pytest.mark.e2e
def test_the_documented_reward_functions_and_environment_train_and_log_each_term(tmp_path, quick_warm_start):
    _, model_dir = quick_warm_start
    # Room for a first answer, the hint (29 characters: tokens here) and a second. The HF engine: an environment on
    # vLLM is tests/e2e/test_tool_run.py's, and the HF engine starts in a fraction of vLLM's time.
    args = [*preset_args(tmp_path, "grpo", model_dir, max_response_length=96), "--rollout_batches", "2",
            "--data.val_data", "null", "--rollout.engine", "hf", "--trainer.logger.init_args.run_name", "null"]  # fmt: skip
    proc = run_cli([*args, *EXAMPLE, *ENVIRONMENT], tmp_path, pythonpath=(REPO / "docs" / "examples",))
    assert proc.returncode == 0, proc.stderr[-4000:]
    # The run is named and tagged after what it adds to the preset, and its closing summary lists it.
    name = "grpo+reward=brevity+reward=shows_work+env=SecondChance"
    run, history = finished_run(tmp_path, name)
    assert run.data.tags["parts"] == "reward=brevity+reward=shows_work+env=SecondChance"
    assert f"rlvr_lightning: {name} (GRPO), 2 rollout batches" in proc.stdout
    assert "  parts: reward=brevity, reward=shows_work, env=SecondChance" in proc.stdout
    assert run.data.params["data.environment.class_path"] == "my_environment.SecondChance"
    # The first rollout batch's completions table: two whole groups, each answer with every reward term.
    import json

    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    table = json.loads(open(client.download_artifacts(run.info.run_id, "samples/train_step_000000.json", str(tmp_path))).read())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert len(rows) == 2 * 4 and [r["group"] for r in rows] == [0] * 4 + [1] * 4  # rollout.group_size 4
    for r in rows:
        assert {"prompt", "gold", "completion", "turns", "correct", "reward", "advantage", "reward/brevity",
                "reward/shows_work"} <= set(r) and r["turns"] in (1, 2)  # fmt: skip
    page = open(client.download_artifacts(run.info.run_id, "samples/tokens_step_000000.html", str(tmp_path))).read()
    assert page.count('class="answer"') == 8 and ("inserted" in page) == any(r["turns"] == 2 for r in rows)
    last = {k: v[-1].value for k, v in history.items()}
    assert 0 < last["train/reward_brevity_mean"] <= 1 and "train/reward_shows_work_steps" in last
    assert 1 < max(p.value for p in history["train/turns_mean"]) <= 2  # wrong first answers had a second try
    assert 0 < max(p.value for p in history["train/inserted_token_frac"]) < 1
    for step in range(2):  # the reward's mean is the verdict's plus each weighted term's and the environment's
        at = {k: v[step].value for k, v in history.items() if len(v) == 2}
        expected = at["train/accuracy"] + 0.1 * at["train/reward_brevity_mean"] + at["train/reward_shows_work_mean"]
        expected += at.get("train/reward_environment_mean", 0.0)
        assert at["train/reward_mean"] == pytest.approx(expected, abs=1e-5)


def test_a_reward_function_that_cannot_be_imported_is_one_line(tmp_path, monkeypatch, capsys, tiny_policy_dir):
    args = [*preset_args(tmp_path, "grpo", tiny_policy_dir), "--rollout_batches", "1",
            "--model.init_args.rewards.functions=[{function: my_missing_rewards.score}]"]  # fmt: skip
    code, _, err = run_in_process(args, tmp_path, monkeypatch, capsys)
    lines = [line for line in err.strip().splitlines() if "my_missing_rewards" in line]
    assert code != 0 and len(lines) == 1, err[-2000:]
    assert "model.rewards.functions: cannot import 'my_missing_rewards.score'" in lines[0] and "PYTHONPATH" in lines[0]


def test_an_environment_that_cannot_be_imported_is_one_line(tmp_path, monkeypatch, capsys, tiny_policy_dir):
    args = [*preset_args(tmp_path, "grpo", tiny_policy_dir), "--rollout_batches", "1",
            "--data.environment", "my_missing_envs.Countdown"]  # fmt: skip
    code, _, err = run_in_process(args, tmp_path, monkeypatch, capsys)
    lines = [line for line in err.strip().splitlines() if "my_missing_envs" in line]
    assert code != 0 and len(lines) == 1, err[-2000:]
    assert "data.environment" in lines[0], lines[0]
