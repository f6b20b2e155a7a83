"""What a run reads from outside is checked before any work (`cli.input_checks`): a missing data file, a missing model
directory, a hub name on an offline machine and a misspelt reward function are each one line while the configuration
is parsed (after the constructors' own checks), before the memory plan, and the MLflow store holds no run for them."""

from __future__ import annotations

import pytest

from rlvr_lightning.cli import main
from tests.conftest import REPO

BASE, GRPO = REPO / "configs" / "base.yaml", REPO / "configs" / "algo" / "grpo.yaml"


@pytest.fixture
def offline_hub(monkeypatch):
    """A machine whose hub is unreachable, as CI's is (and as `HF_HUB_OFFLINE=1` says)."""
    from huggingface_hub import constants

    from rlvr_lightning.models import hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.why_offline.cache_clear()
    yield
    hub.why_offline.cache_clear()


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--data.train_data", "/nowhere/train.jsonl"], "error: data.train_data: data file not found: /nowhere/train.jsonl"),
        (["--data.val_data", "my_eval.jsonl"], "error: data.val_data: data file not found: my_eval.jsonl"),
        (["--data.model_name_or_path", "/nowhere/model"], "error: data.model_name_or_path: model directory does not exist: /nowhere/model"),
        (["--data.model_name_or_path", "Qwen/Qwen2.5-0.5B-Instruct"],
         "error: data.model_name_or_path: 'Qwen/Qwen2.5-0.5B-Instruct' is a Hugging Face model name, and this machine is "
         "offline (HF_HUB_OFFLINE=1) with no cached copy: download it where the hub is reachable, or give a local path"),
        (["--data.train_data", "HuggingFaceH4/MATH-500"],
         "error: data.train_data: 'HuggingFaceH4/MATH-500' is a Hugging Face dataset name, and this machine is offline"),
        (["--model.init_args.rewards.functions=[{function: tests.support.rewards.brevty}]"],
         "error: model.rewards.functions: cannot import 'tests.support.rewards.brevty' (AttributeError"),
        (["--model.init_args.rewards.correctness", "tests.support.nowhere.score"],
         "error: model.rewards.correctness: cannot import 'tests.support.nowhere.score'"),
        (["--model.init_args.teacher.model_name_or_path", "/nowhere/teacher",
          "--model.init_args.advantage_estimator.name", "opd"],
         "error: model.teacher.model_name_or_path: model directory does not exist: /nowhere/teacher"),
    ],
    ids=["train-file", "val-file", "model-dir", "offline-model", "offline-dataset", "reward-function", "correctness",
         "teacher"],
)  # fmt: skip
def test_an_input_the_run_cannot_read_is_one_line_before_the_plan_and_leaves_no_run(flags, line, tmp_path, capsys, offline_hub):
    args = ["fit", "--config", str(BASE), "--config", str(GRPO),
            "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp_path}/mlflow.db", *flags]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    out, err = capsys.readouterr()
    lines = [x for x in err.strip().splitlines() if not x.startswith("INFO")]
    assert exit_info.value.code == 2 and len(lines) == 1 and lines[0].startswith(line), err[-3000:]
    assert "plan:" not in out + err  # refused before the memory plan
    assert runs_in(tmp_path / "mlflow.db") == []


def runs_in(store) -> list[str]:
    """The names of the runs in an MLflow sqlite store (the logger opens the store when it is built; a run is made
    only when training starts)."""
    if not store.exists():
        return []
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{store}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    return [r.info.run_name for r in client.search_runs(experiments)] if experiments else []
