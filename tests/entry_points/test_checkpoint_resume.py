"""Resuming applies what the user says (`cli/checkpoint_resume.py`): the checkpoint is read once, first, and a
file that is not one is one line; a setting given on the command line wins over the checkpoint's (Lightning's CLI
laid the saved ones over it: `--model.init_args.kl_coef 0.5` trained on with 0.001), printed and recorded in the
MLflow run; another algorithm on a checkpoint is one line."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.support.cli import run_cli, run_in_process

HF = ["--rollout.engine", "hf", "--data.val_data", "null"]


def args_for(run_dir, model_dir, batches: int, preset: str = "grpo") -> list[str]:
    return ["fit", "--config", "configs/base.yaml", "--config", f"configs/algo/{preset}.yaml",
            "--rollout_batches", str(batches), "--data.model_name_or_path", str(model_dir),
            "--trainer.logger.init_args.tracking_uri", f"sqlite:///{run_dir}/mlflow.db",
            "--trainer.logger.init_args.artifact_location", str(run_dir / "artifacts"),
            "--data.batch_size", "4", "--rollout.group_size", "4", "--rollout.max_response_length", "16", *HF]  # fmt: skip


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory, quick_warm_start):
    """A two-batch GRPO run with kl_coef 0.001, and its checkpoint."""
    _, model_dir = quick_warm_start
    run_dir = tmp_path_factory.mktemp("checkpointed")
    proc = run_cli(args_for(run_dir, model_dir, 2), run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (ckpt,) = run_dir.glob("checkpoints/*/last.ckpt")
    return run_dir, model_dir, ckpt


@pytest.mark.e2e
def test_a_setting_given_on_resume_wins_and_is_recorded(checkpointed):
    import mlflow
    import torch

    run_dir, model_dir, ckpt = checkpointed
    proc = run_cli([*args_for(run_dir, model_dir, 3), "--model.init_args.kl_coef", "0.5", "--ckpt_path", str(ckpt)], run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resume: this command line changes model.init_args.kl_coef: 0.001 → 0.5" in proc.stderr, proc.stderr[-3000:]
    saved = torch.load(ckpt, weights_only=True, map_location="cpu", mmap=True)
    assert saved["hyper_parameters"]["kl_coef"] == 0.5 and saved["rlvr"]["rollout_batches"] == 3  # trained with it
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    (run,) = client.search_runs(client.get_experiment_by_name("rlvr_lightning").experiment_id)
    (tag,) = [v for k, v in run.data.tags.items() if k.startswith("resumed.")]
    assert "(rollout batch 2)" in tag and "model.init_args.kl_coef: 0.001 → 0.5" in tag, tag


@pytest.mark.e2e
def test_another_algorithm_or_a_file_that_is_no_checkpoint_is_one_line(checkpointed, tmp_path, monkeypatch, capsys):
    run_dir, model_dir, ckpt = checkpointed
    truncated, empty, noise, directory = tmp_path / "truncated.ckpt", tmp_path / "empty.ckpt", tmp_path / "noise.ckpt", tmp_path / "dir"
    truncated.write_bytes(ckpt.read_bytes()[:4096])
    empty.write_bytes(b"")
    noise.write_bytes(os.urandom(100_000))
    directory.mkdir()
    cases = {truncated: "is not a checkpoint this project can read", empty: "is empty, not a checkpoint",
             noise: "is not a checkpoint this project can read", directory: "is a directory but not a sharded checkpoint",
             tmp_path / "missing.ckpt": "no checkpoint at"}  # fmt: skip
    for path, message in cases.items():
        code, _, err = run_in_process([*args_for(tmp_path, model_dir, 3), "--ckpt_path", str(path)], tmp_path, monkeypatch, capsys)
        lines = err.strip().splitlines()
        assert code == 2 and lines[-1].startswith("error: ckpt_path: ") and message in lines[-1], (path.name, err[-2000:])
        assert "Traceback" not in err, err[-2000:]
    code, _, err = run_in_process([*args_for(tmp_path, model_dir, 3, "dapo"), "--ckpt_path", str(ckpt)], tmp_path, monkeypatch, capsys)
    assert code == 2 and "is a checkpoint of a GRPO run, and this command line selects DAPO" in err.strip().splitlines()[-1], err[-2000:]
    shutil.rmtree(directory)


@pytest.mark.e2e
def test_a_checkpoint_holding_a_nan_weight_is_refused_in_one_line(checkpointed, tmp_path):
    import torch

    run_dir, model_dir, ckpt = checkpointed
    state = torch.load(ckpt, weights_only=True, map_location="cpu")
    name = next(k for k, v in state["state_dict"].items() if v.is_floating_point())
    state["state_dict"][name].view(-1)[0] = float("nan")
    broken = tmp_path / "nan.ckpt"
    torch.save(state, broken)
    proc = run_cli([*args_for(run_dir, model_dir, 4), "--ckpt_path", str(broken)], run_dir)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith(f"error: ckpt_path: {broken} holds a non-finite weight"), proc.stderr[-3000:]


@pytest.mark.e2e
def test_a_changed_checkpoint_or_another_model_is_one_line_and_stale_files_are_removed(
    checkpointed, tmp_path, monkeypatch, capsys
):
    import torch

    _, model_dir, ckpt = checkpointed
    copy = tmp_path / "run"
    shutil.copytree(ckpt.parent, copy)
    (copy / "last.ckpt.tmp").write_bytes(b"what a killed save left")
    other_model = tmp_path / "other-model"
    other_model.symlink_to(model_dir)
    code, _, err = run_in_process(
        [*args_for(tmp_path, other_model, 3), "--ckpt_path", str(copy / "last.ckpt")], tmp_path, monkeypatch, capsys
    )
    last = err.strip().splitlines()[-1]
    assert code == 2 and f"was trained from the model {model_dir}, and this command line gives" in last, err[-2000:]
    assert not (copy / "last.ckpt.tmp").exists()  # removed once the run's directory was held

    state = torch.load(copy / "last.ckpt", weights_only=True, map_location="cpu")
    name = next(k for k, v in state["state_dict"].items() if v.is_floating_point())
    state["state_dict"][name].view(-1)[0] += 1e-3  # still a valid checkpoint, no longer the one its record names
    torch.save(state, copy / "last.ckpt")
    code, _, err = run_in_process(
        [*args_for(tmp_path, model_dir, 3), "--ckpt_path", str(copy / "last.ckpt")], tmp_path, monkeypatch, capsys
    )
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith(f"error: ckpt_path: {copy / 'last.ckpt'} does not match its record"), err[
        -2000:
    ]
    assert "Traceback" not in err


@pytest.mark.e2e
def test_weights_of_another_shape_are_one_line(checkpointed):
    run_dir, model_dir, ckpt = checkpointed
    proc = run_cli(
        [*args_for(run_dir, model_dir, 3), "--model.init_args.lora.rank", "4", "--ckpt_path", str(ckpt)], run_dir
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith(
        "error: ckpt_path: the checkpoint's weights do not fit this run's model"
    ), proc.stderr[-3000:]
    assert "weights missing from it (first: policy.model.layers.0." in last, last


@pytest.mark.e2e
def test_a_second_process_on_the_run_is_refused_and_each_step_is_logged_once(checkpointed, monkeypatch, capsys):
    """Runs last in this file: it takes the checkpoint on to rollout batch 8. The second process is this one (its
    imports done, it reaches the lock while the first still trains)."""
    import subprocess
    import sys
    import time

    import mlflow

    from tests.support.cli import REPO

    run_dir, model_dir, ckpt = checkpointed
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")

    def resumes() -> int:  # the `resumed.<time>` tags of the run: one per process that resumed it
        (run,) = client.search_runs(client.get_experiment_by_name("rlvr_lightning").experiment_id)
        return sum(k.startswith("resumed.") for k in run.data.tags)

    resumed_before = resumes()
    args = [
        str(REPO / a) if a.startswith("configs/") else a
        for a in [*args_for(run_dir, model_dir, 8), "--ckpt_path", str(ckpt)]
    ]
    env = {**os.environ, "RLVR_CACHE_DIR": str(run_dir / "cache"), "PYTHONPATH": str(REPO)}
    first = subprocess.Popen([sys.executable, "-m", "rlvr_lightning", *args, "--plan.check=false"], cwd=run_dir, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        lock = ckpt.parent / "run.lock"
        deadline = time.monotonic() + 120
        while f'"pid": {first.pid}' not in (lock.read_text() if lock.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.05)
        code, _, err = run_in_process(
            [*args_for(run_dir, model_dir, 8), "--ckpt_path", str(ckpt)], run_dir, monkeypatch, capsys
        )
        assert first.poll() is None, "the first run ended before the second was tried"
        last = err.strip().splitlines()[-1]
        assert code == 2 and f"is in use by process {first.pid} on " in last, err[-3000:]
        assert first.wait(timeout=400) == 0, first.stderr.read()[-3000:]
    finally:
        first.kill()
    (run,) = client.search_runs(client.get_experiment_by_name("rlvr_lightning").experiment_id)
    assert resumes() == resumed_before + 1  # the second process was refused before it logged anything to the run
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/reward_mean")]
    assert sorted(steps) == list(range(8)) and run.info.status == "FINISHED", (steps, run.info.status)
