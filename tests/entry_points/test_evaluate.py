"""`make eval`: offline evaluation of a model directory on a benchmark, recorded in MLflow."""

from __future__ import annotations

import pytest

from rlvr_lightning.evaluate import main


def eval_run(tmp_path, model_dir, name):
    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    main(["--model", str(model_dir), "--bench", "embedded", "--limit", "24", "--n", "4", "--k", "1", "4",
          "--tracking-uri", uri, "--run-name", name])  # fmt: skip
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    (run,) = [r for r in client.search_runs([client.get_experiment_by_name("rlvr_lightning").experiment_id])
              if r.info.run_name == name]  # fmt: skip
    return run


@pytest.mark.e2e
def test_make_eval_prints_what_a_user_can_act_on_as_make_train_does(tmp_path, quick_warm_start):
    """vLLM's engine-start notes, torch's and transformers' are left out by default, as in training (the same
    command before this was fixed printed each of them)."""
    from tests.support.cli import run_cli

    args = ["--model", str(quick_warm_start[1]), "--bench", "embedded", "--limit", "4", "--n", "2", "--k", "1",
            "--no-greedy", "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"]  # fmt: skip
    noise = ["reduce_op", "Loading weights", "MLflow database tables", "MEMBIND", "LD_PRELOAD", "set_num_threads", "Triton"]
    proc = run_cli(args, tmp_path, module="rlvr_lightning.evaluate")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [n for n in noise if n in proc.stdout + proc.stderr] == []
    assert "eval/embedded/accuracy" in proc.stdout


@pytest.mark.e2e
def test_untrained_and_trained_models_get_different_sensible_scores(tmp_path, tiny_policy_dir, quick_warm_start):
    _, warm_dir = quick_warm_start
    untrained = eval_run(tmp_path, tiny_policy_dir, "untrained")
    trained = eval_run(tmp_path, warm_dir, "warm")
    for run in (untrained, trained):
        m = run.data.metrics
        assert run.info.status == "FINISHED"
        assert run.data.params["eval/embedded/n"] == "4" and run.data.params["eval/embedded/problems"] == "24"
        assert 0 <= m["eval/embedded/pass_at_1"] <= m["eval/embedded/pass_at_4"] <= 1
        assert m["eval/embedded/accuracy"] == m["eval/embedded/pass_at_1"]
        assert "eval/embedded/maj_at_4" in m and "eval/embedded/accuracy_greedy" in m
    # Random weights emit random characters: no boxed answer, nothing correct; the warm start boxes answers.
    assert untrained.data.metrics["eval/embedded/pass_at_4"] == 0
    assert untrained.data.metrics["eval/embedded/no_answer_frac"] > 0.9
    assert trained.data.metrics["eval/embedded/no_answer_frac"] < untrained.data.metrics["eval/embedded/no_answer_frac"]
    # The 60-step test warm start formats answers but rarely gets them right; the shipped 500-step warm
    # start scores pass@1 ≈ 0.17, greedy ≈ 0.45 on this split (`make eval`, see docs/mlflow.md).
    assert trained.data.metrics["eval/embedded/no_answer_frac"] < 0.8


def test_prompt_plus_response_longer_than_the_model_is_refused_early(tiny_policy_dir):
    from rlvr_lightning.data.datamodule import RolloutDataModule
    from rlvr_lightning.errors import ConfigError
    from rlvr_lightning.rollout.settings import RolloutSettings

    dm = RolloutDataModule(
        model_name_or_path=str(tiny_policy_dir), max_prompt_length=512, rollout=RolloutSettings(max_response_length=40)
    )
    with pytest.raises(ConfigError, match="exceeds the 256 positions"):
        dm.setup("fit")


def test_lightning_checkpoint_becomes_an_hf_directory_with_its_weights(tmp_path, tiny_policy_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from rlvr_lightning.algos import GRPO
    from rlvr_lightning.data.datamodule import RolloutDataModule
    from rlvr_lightning.errors import ConfigError
    from rlvr_lightning.models.checkpoint import policy_from_checkpoint
    from rlvr_lightning.rollout.settings import RolloutSettings
    from rlvr_lightning.standalone import standalone

    dm = RolloutDataModule(model_name_or_path=str(tiny_policy_dir), batch_size=4, val_data=None, rollout=RolloutSettings(engine="hf"))
    module = standalone(GRPO(), dm)
    with torch.no_grad():  # "trained" weights: anything but the base model's
        for p in module.policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    module.trainer.save_checkpoint(tmp_path / "last.ckpt")
    out = policy_from_checkpoint(tmp_path / "last.ckpt")
    assert out == tmp_path / "last-hf" and (out / "tokenizer.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for (name, a), b in zip(module.policy.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert loaded.config.use_cache  # exported for inference

    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="cannot be read"):
        policy_from_checkpoint(tmp_path / "junk.ckpt")
    with pytest.raises(ConfigError, match="not found"):
        policy_from_checkpoint(tmp_path / "missing.ckpt")
    torch.save({"state_dict": {}}, tmp_path / "other.ckpt")
    with pytest.raises(ConfigError, match="not an rlvr_lightning checkpoint"):
        policy_from_checkpoint(tmp_path / "other.ckpt")


@pytest.mark.e2e
def test_eval_in_a_users_environment_logs_its_episode_metrics(tmp_path, quick_warm_start, monkeypatch):
    """`make eval ARGS="--environment my_environment.SecondChance"` (docs/examples), with a metric of the user's own:
    the answers get their second try, and the set's metrics hold the episodes' (turns, inserted tokens, why they
    stopped) and the environment's own."""
    import sys
    import types

    import mlflow

    from tests.support.cli import REPO

    monkeypatch.syspath_prepend(str(REPO / "docs" / "examples"))
    monkeypatch.delitem(sys.modules, "my_environment", raising=False)
    from my_environment import SecondChance

    class Counted(SecondChance):
        def metrics(self, episodes):
            return {"second_tries": sum(e.turns > 1 for e in episodes) / len(episodes)}

    monkeypatch.setitem(sys.modules, "my_counted_environment", types.SimpleNamespace(Counted=Counted))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    main(["--model", str(quick_warm_start[1]), "--bench", "embedded", "--limit", "8", "--n", "2", "--k", "1",
          "--max-tokens", "96", "--engine", "hf", "--no-greedy", "--environment", "my_counted_environment.Counted",
          "--tracking-uri", uri, "--run-name", "second-chance"])  # fmt: skip
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rlvr_lightning").experiment_id])
    m = run.data.metrics
    assert 1 < m["eval/embedded/turns_mean"] <= 2 and 0 < m["eval/embedded/inserted_token_frac"] < 1
    assert m["eval/embedded/second_tries"] == pytest.approx(m["eval/embedded/turns_mean"] - 1)
    ends = sum(m[f"eval/embedded/stop_{r}_frac"] for r in ("answered", "length", "max_turns"))
    assert ends == pytest.approx(1.0)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--environment", "my_missing_envs.Countdown"], "error: --environment: cannot import 'my_missing_envs.Countdown'"),
        (["--environment", "json.dumps"], "error: --environment: 'json.dumps' is not a subclass of"),
        (["--environment", "rlvr_lightning.environments.python_tool.PythonTool", "--tool-max-calls", "2"],
         "error: --tool-max-calls and --environment: set one"),
        (["--correctness", "environment"], "error: --correctness environment: the answers need an environment"),
        (["--correctness", "my_missing_rewards.f"], "error: model.rewards.correctness: cannot import"),
    ],
)
def test_a_bad_eval_environment_is_one_line(tmp_path, tiny_policy_dir, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(tiny_policy_dir), "--bench", "embedded", "--limit", "2", "--engine", "hf",
              "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", *args])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err[-1].startswith(message), err[-3:]
