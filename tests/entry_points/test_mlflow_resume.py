"""Which MLflow run a resumed checkpoint continues (the kill-and-resume runs themselves:
tests/e2e/test_stream_resume.py and tests/e2e/test_fsdp_resume.py)."""

from __future__ import annotations


def test_a_checkpoint_from_another_store_resumes_into_a_new_run(tmp_path):
    import mlflow

    from rlvr_lightning.cli.mlflow_resume import mlflow_run_exists

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("x"))
    assert mlflow_run_exists(uri, run.info.run_id)
    assert not mlflow_run_exists(uri, "0" * 32)  # written elsewhere: the CLI warns and opens a new run
