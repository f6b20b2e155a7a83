"""`make results` run records and --resume: a resumed invocation trains only what neither the experiment nor
the records hold at this budget and model, and the records alone rebuild the same page."""

from __future__ import annotations

from rlvr_lightning.results import main
from rlvr_lightning.results.grid import run_name
from tests.support.results_runs import log_budget


def test_resume_trains_only_what_the_experiment_lacks(tmp_path, monkeypatch):
    import mlflow

    import rlvr_lightning.results as results  # main looks `train` up there: the one to replace

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("results", artifact_location=str(tmp_path / "artifacts"))
    for name, max_steps, model, finish in [
        ("grpo-seed0", "60", "embedded", True),  # reused
        ("grpo-seed1", "30", "embedded", True),  # another budget
        ("grpo-seed2", "60", "embedded-balanced", True),  # another model
        ("thr-seed0", "60", "embedded", False),
    ]:  # killed
        run = client.create_run(exp, run_name=name)
        log_budget(client, run, max_steps, model)
        if finish:
            client.set_terminated(run.info.run_id)
    trained, parents = [], set()

    def train(preset, seed, args):
        trained.append(run_name(preset.stem, seed))
        parents.add(args.parent_run_id)
        return 0, 1.0

    monkeypatch.setattr(results, "train", train)
    main(["--resume", "--algos", "grpo", "thr", "--seeds", "3", "--tracking-uri", uri,
          "--out", str(tmp_path / "R.md"), "--log-dir", str(tmp_path / "logs")])  # fmt: skip
    assert trained == ["thr-seed0", "grpo-seed1", "thr-seed1", "grpo-seed2", "thr-seed2"]
    (parent,) = [r for r in client.search_runs([exp]) if r.info.run_name == "results"]
    assert parents == {parent.info.run_id} and parent.info.status == "FINISHED"
    assert "R.md" in {a.path for a in client.list_artifacts(parent.info.run_id)}  # the page, on the parent run
    assert parent.data.tags["mlflow.note.content"] == (tmp_path / "R.md").read_text()


def test_records_rebuild_the_page_and_resume_without_the_store(tmp_path, monkeypatch):
    """A fresh clone has the committed run records but no MLflow store: the page comes out the same and
    --resume trains only what no record holds at this budget and model."""
    import shutil

    import mlflow

    import rlvr_lightning.results as results  # main looks `train` up there: the one to replace

    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    (tmp_path / "store").mkdir()
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("results", artifact_location=str(tmp_path / "store" / "artifacts"))
    for name, final, max_steps, model, start in [
        ("grpo-seed0", 0.20, "60", "embedded", 1_000),
        ("grpo-seed0", 0.90, "60", "embedded", 500),  # older: not the one
        ("grpo-seed1", 0.25, "60", "embedded", 1_000),
        ("thr-seed0", 0.30, "30", "embedded", 1_000),  # another budget
        ("thr-seed1", 0.35, "60", "embedded-balanced", 1_000),
    ]:  # model
        tags = {"algorithm": "GRPO", "git_commit": "cafe", "warm_start_sha256": "66d538c8f3b0"}
        run = client.create_run(exp, run_name=name, tags=tags, start_time=start)
        log_budget(client, run, max_steps, model)
        client.log_metric(run.info.run_id, "val/accuracy", 0.15, step=0)
        client.log_metric(run.info.run_id, "val/accuracy", final, step=60)
        client.set_terminated(run.info.run_id, end_time=start + 60_000)
    out = tmp_path / "docs" / "RESULTS.md"
    argv = ["--algos", "grpo", "thr", "--seeds", "2", "--out", str(out), "--log-dir", str(tmp_path / "logs")]
    main(["--skip-training", "--tracking-uri", uri, *argv])
    records = sorted(p.name for p in (tmp_path / "docs" / "results" / "runs").glob("*"))
    assert records == ["grpo-seed0.json", "grpo-seed1.json", "thr-seed0.json", "thr-seed1.json"]
    from rlvr_lightning.run_records import read_records

    assert read_records(tmp_path / "docs" / "results" / "runs")["grpo-seed0"].run.warm_start == "66d538c8f3b0"
    page = out.read_text()
    assert "| grpo | GRPO | 1 | 2 | 0.150 → 0.225 ± 0.318 |" in page  # seed 0's later run (0.20), seed 1's 0.25
    assert "| thr |" not in page  # its runs have another budget or model

    shutil.rmtree(tmp_path / "store")  # a fresh clone: records only
    fresh = f"sqlite:///{tmp_path}/fresh.db"
    stale = mlflow.tracking.MlflowClient(tracking_uri=fresh)  # this machine's store has an older grpo-seed0
    run = stale.create_run(stale.create_experiment("results", artifact_location=str(tmp_path / "a2")),
                           run_name="grpo-seed0", tags={"algorithm": "GRPO"}, start_time=10)  # fmt: skip
    log_budget(stale, run, "60", "embedded")
    stale.log_metric(run.info.run_id, "val/accuracy", 0.99, step=60)
    stale.set_terminated(run.info.run_id, end_time=70)
    main(["--skip-training", "--tracking-uri", fresh, *argv])
    assert out.read_text() == page.replace(uri, fresh)  # the command it names is the only difference
    trained = []
    monkeypatch.setattr(
        results, "train", lambda preset, seed, args: (trained.append(run_name(preset.stem, seed)), (0, 1.0))[1]
    )
    main(["--resume", "--tracking-uri", fresh, *argv])
    assert trained == ["thr-seed0", "thr-seed1"]
