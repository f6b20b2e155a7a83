"""`make compare`: the table and plots from an MLflow store, logged back as a `compare` run."""

from __future__ import annotations

import pytest

from rlvr_lightning.compare import compare


def fake_store(tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("rlvr_lightning", artifact_location=str(tmp_path / "artifacts"))
    for name, slope, parts in (("grpo", 0.001, None), ("thr", 0.002, "shaper=thr")):
        run = client.create_run(exp, run_name=name, tags={"algorithm": "GRPO", **({"parts": parts} if parts else {})})
        for step in range(20):
            client.log_metric(run.info.run_id, "train/accuracy", 0.1 + slope * step, step=step)
            client.log_metric(run.info.run_id, "time/step", 1.0, step=step)
        for step in (0, 10, 20):
            client.log_metric(run.info.run_id, "val/accuracy", 0.1 + slope * step, step=step)
        client.set_terminated(run.info.run_id)
    client.set_terminated(client.create_run(exp, run_name="grpo").info.run_id, status="FAILED")  # ignored
    return uri, client, exp


def test_compare_writes_table_and_plots_and_logs_them(tmp_path):
    uri, client, exp = fake_store(tmp_path)
    out = compare(uri, "rlvr_lightning", None, tmp_path / "report")
    table = (out / "compare.md").read_text()
    assert "| grpo | GRPO | 20 | 0.100 → 0.120 |" in table
    assert "| thr | GRPO+shaper=thr | 20 | 0.100 → 0.140 |" in table
    for png in ("train_accuracy.png", "val_accuracy.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (report,) = [r for r in client.search_runs([exp]) if r.info.run_name == "compare"]
    assert {a.path for a in client.list_artifacts(report.info.run_id)} >= {"compare.md", "train_accuracy.png", "val_accuracy.png"}
    compared = {r.info.run_id for r in client.search_runs([exp]) if r.info.run_name in ("grpo", "thr") and r.info.status == "FINISHED"}
    assert set(report.data.tags["compared_runs"].split(",")) == compared  # linked to the runs it compares
    assert report.data.tags["mlflow.note.content"] == table  # its Overview shows the table


def test_compare_names_the_runs_it_has_when_one_is_missing(tmp_path):
    uri, _, _ = fake_store(tmp_path)
    with pytest.raises(SystemExit, match="finished runs: grpo, thr"):
        compare(uri, "rlvr_lightning", ["dapo"], tmp_path / "report", log_to_mlflow=False)
