"""The command line as a user runs it: a 2-step fit on the real vLLM engine, and clear errors on bad input."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.cli import BASE, REPO, run_cli, small_run_args


@pytest.mark.e2e
@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_two_step_fit_writes_an_mlflow_run(two_step_runs, engine):
    verbose = engine == "hf"  # one run of each: the quiet default and everything
    proc, tmp_path = two_step_runs.get(engine), two_step_runs.root
    assert proc.returncode == 0, proc.stderr[-4000:]
    output = (proc.stdout + proc.stderr).replace("\r", "\n").splitlines()
    noise = ["GPU available", "reduce_op", "LeafSpec", "weights_only", "Loading weights", "Seed set to",
             "MLflow database tables"] + (["MEMBIND", "LD_PRELOAD", "set_num_threads", "Triton"] if engine == "vllm" else [])  # fmt: skip
    printed = [n for n in noise if any(n in line for line in output)]
    if verbose:
        assert "GPU available" in printed and "Seed set to" in printed, printed  # -v: the libraries' own output
    else:
        assert printed == [], printed
        other = [line for line in output if line.strip() and not line.startswith("rollout batches")]
        assert len(other) <= 30, other  # the bar aside, a short run prints a few lines and the summary
    summary = proc.stdout[proc.stdout.index("rlvr_lightning: GRPO, 2 rollout batches") :]
    assert "held-out accuracy (T = 1): " in summary and "held-out greedy accuracy: " in summary

    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    experiment_id = client.get_experiment_by_name("rlvr_lightning").experiment_id
    (run,) = client.search_runs(experiment_id, filter_string=f"tags.engine = '{engine}'")
    assert run.info.status == "FINISHED"
    assert run.info.run_name == f"grpo-{engine}"
    assert run.data.tags["algorithm"] == "GRPO" and run.data.tags["model"] == str(two_step_runs.model_dir)
    assert run.data.tags["model_family"] == "qwen2" and run.data.tags["engine"] == engine
    assert run.data.tags["params"].endswith("M") and run.data.tags["devices"] == "1"
    assert run.info.run_id in summary and run.data.tags["mlflow.note.content"].strip("`\n").startswith(
        "rlvr_lightning: GRPO, 2 rollout batches")  # the summary is the run's description  # fmt: skip
    assert "system/cpu_utilization_percentage" in run.data.metrics  # MLflow's system metrics (every 10 s by default)
    datasets = {(d.dataset.name, d.tags[0].value, json.loads(d.dataset.profile)["num_rows"])
                for d in run.inputs.dataset_inputs}  # fmt: skip
    assert datasets == {("embedded-train", "training", 8320), ("embedded-test", "evaluation", 8)}, datasets
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI's training views
    assert run.data.params["model.init_args.lr"] == "3e-05"
    assert run.data.params["rollout.engine"] == engine
    history = {k: client.get_metric_history(run.info.run_id, k) for k in run.data.metrics}
    for key in (
        "train/reward_mean", "train/reward_std", "train/frac_reward_zero_std", "train/response_length_mean",
        "train/response_clip_ratio", "train/clip_frac", "train/entropy", "train/kl", "train/grad_norm",
        "train/lr", "train/policy_version", "train/logprob_mismatch_mean", "time/rollout", "time/reward",
        "time/old_logprob", "time/update", "time/weight_sync", "throughput/rollout_tokens_per_s",
        "train/verifier_errors", "train/verifier_timeouts",
    ):  # fmt: skip
        assert [m.step for m in history[key]] == [0, 1], key
    assert [m.value for m in history["train/policy_version"]] == [1.0, 2.0]
    assert max(m.value for m in history["train/logprob_mismatch_mean"]) < 1e-3
    assert [m.step for m in history["val/accuracy"]] == [0, 2]  # before RL and after the last step
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "config.yaml" in artifacts
    samples = sorted(a.path for a in client.list_artifacts(run.info.run_id, "samples"))
    assert samples == ["samples/val_step_000000.json", "samples/val_step_000002.json"]  # one per evaluation
    table = json.loads(Path(client.download_artifacts(run.info.run_id, samples[0], str(tmp_path))).read_text())
    assert table["columns"] == ["prompt", "completion", "parsed_answer", "gold", "reward", "step"]
    assert 0 < len(table["data"]) <= 16
    assert "val/maj_at_8" in history and "val/pass_at_8_se" in history
    export = Path(run.data.tags["export/final"])  # HFExport of configs/base.yaml, under the working directory
    assert export == (tmp_path / "exports" / run.info.run_id / "final").resolve()
    assert (export / "config.json").exists() and (export / "tokenizer.json").exists()


def test_print_config_shows_the_resolved_algorithm(tmp_path):
    proc = run_cli([*BASE, "--print_config"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    model = yaml.safe_load(proc.stdout)["model"]
    assert model["class_path"] == "rlvr_lightning.algos.grpo.GRPO"
    assert model["init_args"]["clip_eps_high"] == 0.2  # the value itself: 0.28 is no match


def test_unknown_algo_lists_the_valid_ones():
    proc = subprocess.run(["make", "-s", "train", "ALGO=nope"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "unknown ALGO 'nope'" in proc.stderr and "grpo" in proc.stderr


@pytest.mark.parametrize(
    "lines,field_args,expected",
    [
        (['{"problem": "1+1", "answer": "2"}', '{"problem": "2+2", "answer": "4"}', "{not json"], [], "line 3"),
        (['{"question": "1+1", "result": "2"}'], [], "answer"),
        (['{"problem": "1+1", "answer": "2"}'], ["--data.answer_field", "gold"], "gold"),
    ],
    ids=["malformed-line", "missing-answer-field", "unknown-explicit-field"],
)
def test_bad_data_file_is_a_clear_error_before_training(tmp_path, tiny_policy_dir, lines, field_args, expected):
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(lines) + "\n")
    args = [*small_run_args(tmp_path, tiny_policy_dir), "--data.train_data", str(data), *field_args]
    proc = run_cli(args, tmp_path, timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("error:") and str(data) in err and expected in err
    assert "Traceback" not in proc.stderr
    if expected == "answer":
        assert "question" in err and "result" in err  # the columns that were found


def test_missing_model_path_is_a_clear_error(tmp_path, tiny_policy_dir):
    args = [*small_run_args(tmp_path, tiny_policy_dir), "--data.model_name_or_path", str(tmp_path / "no_model")]
    proc = run_cli(args, tmp_path, timeout=180)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and str(tmp_path / "no_model") in proc.stderr
    assert "Traceback" not in proc.stderr


def test_embedded_warm_start_is_cached_and_partially_correct(quick_warm_start):
    from rlvr_lightning.models.warm_start import embedded_policy_path

    cfg, path = quick_warm_start
    meta = json.loads((path / "warm_start.json").read_text())
    assert meta["config"]["steps"] == cfg.steps
    mtime = (path / "model.safetensors").stat().st_mtime
    assert embedded_policy_path(cfg) == path  # second call reuses the cache...
    assert (path / "model.safetensors").stat().st_mtime == mtime  # ...without rebuilding
    assert (path / "tokenizer.json").exists() and (path / "config.json").exists()
