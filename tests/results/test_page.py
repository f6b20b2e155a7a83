"""`make results` page and README block, built from a real MLflow store."""

from __future__ import annotations

import pytest

from rlvr_lightning.results import main
from tests.support.results_runs import log_budget


def test_page_from_a_real_mlflow_store(tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("results", artifact_location=str(tmp_path / "artifacts"))
    finals = {"grpo": [0.20, 0.25, 0.22], "thr-explore": [0.24, 0.30, 0.27], "oar-g": [0.15, 0.20, 0.17]}
    for preset, values in finals.items():
        for seed, final in enumerate(values):
            commit = "aaaa" if seed < 2 else "bbbb"  # a resumed `make results`: seed 2 trained at a later commit
            tags = {"algorithm": "GRPO"} | ({"git_commit": commit} if preset != "oar-g" else {})
            run = client.create_run(exp, run_name=f"{preset}-seed{seed}", tags=tags, start_time=1_000)
            log_budget(client, run, "60", "embedded")
            for key in ("val/accuracy", "val/pass_at_8", "val/accuracy_greedy"):
                client.log_metric(run.info.run_id, key, 0.15, step=0)
                client.log_metric(run.info.run_id, key, final, step=60)
            client.set_terminated(run.info.run_id, end_time=1_000 + 20 * 60_000)  # 20 minutes each
    out, readme = tmp_path / "RESULTS-x.md", tmp_path / "README.md"
    readme.write_text("# x\n\nbefore\n<!-- make results: begin -->\nstale figures\n<!-- make results: end -->\nafter\n")
    main(["--skip-training", "--algos", "grpo", "thr-explore", "oar-g", "--tracking-uri", uri,
          "--out", str(out), "--log-dir", str(tmp_path / "logs"), "--readme", str(readme)])  # fmt: skip
    page = out.read_text()
    text = readme.read_text()
    assert "stale figures" not in text and text.startswith("# x\n\nbefore\n") and text.endswith("end -->\nafter\n")
    assert "| `grpo` | 1 | 3 | 0.150 → 0.223 ± 0.063 |" in text  # the page's numbers, a few columns
    assert "--readme" not in text and "on 20" in text  # the command without the flag; dated
    readme.write_text("# no block\n")
    with pytest.raises(SystemExit, match="no '<!-- make results: begin -->'"):
        main(["--skip-training", "--algos", "grpo", "--tracking-uri", uri, "--out", str(out),
              "--log-dir", str(tmp_path / "logs"), "--readme", str(readme)])  # fmt: skip
    assert "commit `aaaa` (4 runs), `not recorded` (3 runs), `bbbb` (2 runs);" in page  # the runs' own commits
    assert "3.00 h of training in all" in page  # 9 runs × 20 min, from the MLflow runs' start and end times
    assert (
        "![val_accuracy](results-x/val_accuracy.png)" in page and (tmp_path / "results-x" / "val_accuracy.png").exists()
    )
    assert "`python -m rlvr_lightning.results --algos grpo thr-explore oar-g --tracking-uri" in page
    # thr-explore − grpo on pass@8: +0.04, +0.05, +0.05 → interval above 0.
    row = next(line for line in page.splitlines() if line.startswith("| THR, p < 0 raises pass@k"))
    assert "| thr-explore − grpo | pass@8 | 0.047 ± 0.014 | 3 | reproduced |" in row
    row = next(line for line in page.splitlines() if line.startswith("| OAR-G above GRPO"))
    assert "| oar-g − grpo | val/accuracy | -0.050 ± 0.000 | 3 | contradicted |" in row  # −0.05 at every seed
    assert "| grpo | GRPO | 1 | 3 | 0.150 → 0.223 ± 0.063 |" in page  # sd 0.0252 × t(0.975, 2) 4.303 / √3
    assert "| OAR-P above GRPO | oar-p − its baseline | val/accuracy | – | 0 | not run |" in page


def test_a_preset_on_its_own_task_keeps_its_warm_start_and_pairs_with_its_baseline(tmp_path, monkeypatch):
    """`grpo-tir` names its warm start (`embedded-tir`): `make results` trains it from there, not from base.yaml's,
    counts its finished runs on that model, and takes its paired differences against `grpo-tir-baseline`, whose
    held-out evaluation differs from the start (no tool) but whose weights are the same (the warm-start digest)."""
    import mlflow

    import rlvr_lightning.results as results  # main looks `train` up there: the one to replace

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("results", artifact_location=str(tmp_path / "artifacts"))
    finals = {"grpo-tir": [0.60, 0.70], "grpo-tir-baseline": [0.02, 0.03], "grpo": [0.3, 0.3]}
    for preset, values in finals.items():
        model = "embedded" if preset == "grpo" else "embedded-tir"
        for seed, final in enumerate(values):
            tags = {"algorithm": "GRPO", "warm_start_sha256": "733e46ce7e61" if preset != "grpo" else "66d538c8f3b0"}
            run = client.create_run(exp, run_name=f"{preset}-seed{seed}", tags=tags)
            log_budget(client, run, "60", model)
            for key in ("val/accuracy", "val/accuracy_greedy"):
                client.log_metric(run.info.run_id, key, 0.0 if preset == "grpo-tir-baseline" else 0.05, step=0)
                client.log_metric(run.info.run_id, key, final, step=60)
            client.set_terminated(run.info.run_id)
    trained = []
    monkeypatch.setattr(results, "train", lambda preset, seed, args: (trained.append((preset.stem, seed)), (0, 1.0))[1])
    out = tmp_path / "R.md"
    main(["--resume", "--algos", "grpo", "grpo-tir", "grpo-tir-baseline", "--seeds", "3", "--tracking-uri", uri,
          "--out", str(out), "--log-dir", str(tmp_path / "logs")])  # fmt: skip
    assert trained == [("grpo", 2), ("grpo-tir", 2), ("grpo-tir-baseline", 2)]  # seeds 0 and 1 counted as done
    page = out.read_text()
    assert page.startswith("# Results: grpo, grpo-tir, grpo-tir-baseline on `embedded`, `embedded-tir`, over seeds")
    assert "warm-started as `embedded` on the embedded arithmetic task (`grpo-tir, grpo-tir-baseline` as `embedded-tir`, on the task their preset names)" in page
    assert "| grpo-tir | grpo-tir-baseline | 0.625 ± " in page  # +0.58, +0.67
    assert not any(line.startswith("| grpo-tir-baseline | grpo |") for line in page.splitlines())
    row = next(line for line in page.splitlines() if line.startswith("| The Python tool raises accuracy"))
    assert "| grpo-tir − grpo-tir-baseline | val/accuracy | 0.625 ± " in row and row.endswith("| 2 | reproduced |")
    trained.clear()  # --model still sets every run's warm start: then the runs on embedded-tir do not count
    main(["--resume", "--model", "embedded-balanced", "--algos", "grpo-tir", "--seeds", "1", "--tracking-uri", uri,
          "--out", str(out), "--log-dir", str(tmp_path / "logs")])  # fmt: skip
    assert trained == [("grpo-tir", 0)]


def test_a_run_from_other_weights_of_its_warm_start_is_trained_again(tmp_path, monkeypatch):
    """`embedded-tir` now ships the weights built under the pinned kernels; a run recorded from the build before the
    pin (another digest) is not one of its runs: `--resume` trains it again. A run whose digest was never tagged
    cannot tell, and counts."""
    import mlflow

    import rlvr_lightning.results as results

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("results", artifact_location=str(tmp_path / "artifacts"))
    for seed, digest in enumerate(["d007cd076800", None]):
        tags = {"algorithm": "GRPO", **({"warm_start_sha256": digest} if digest else {})}
        run = client.create_run(exp, run_name=f"grpo-tir-seed{seed}", tags=tags)
        log_budget(client, run, "60", "embedded-tir")
        client.log_metric(run.info.run_id, "val/accuracy", 0.1, step=0)
        client.set_terminated(run.info.run_id)
    trained = []
    monkeypatch.setattr(results, "train", lambda preset, seed, args: (trained.append((preset.stem, seed)), (0, 1.0))[1])
    main(["--resume", "--algos", "grpo-tir", "--seeds", "2", "--tracking-uri", uri, "--out", str(tmp_path / "R.md"),
          "--log-dir", str(tmp_path / "logs")])  # fmt: skip
    assert trained == [("grpo-tir", 0)]
