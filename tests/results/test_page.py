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
