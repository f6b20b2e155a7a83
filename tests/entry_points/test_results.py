"""`make results` statistics: intervals over seeds, paired differences against the GRPO run of the same
seed and K, the claims' verdicts, and the page built from a real MLflow store."""

from __future__ import annotations

import math

import pytest

from rlvr_lightning.compare import RunHistory
from rlvr_lightning.results import (
    PresetRuns,
    claims_table,
    differences_table,
    main,
    paired_difference,
    start_sentence,
    t_interval,
    verdict,
)


def test_t_interval_matches_the_textbook_formula():
    mean, half = t_interval([1.0, 2.0, 3.0])  # sd 1, n 3, t(0.975, 2) = 4.302653
    assert mean == 2.0 and half == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)
    mean, half = t_interval([0.5])
    assert mean == 0.5 and math.isnan(half)


@pytest.mark.parametrize(
    "mean,half,direction,expected",
    [(0.05, 0.03, +1, "reproduced"), (-0.05, 0.03, +1, "contradicted"), (0.01, 0.03, +1, "not resolved"),
     (-0.05, 0.03, -1, "reproduced"), (0.05, math.nan, +1, "one seed"),
     # A claim of equality: the interval within ±0.02, excluding 0, or neither.
     (0.005, 0.01, 0, "reproduced"), (0.04, 0.01, 0, "contradicted"), (0.005, 0.03, 0, "not resolved"),
     (0.015, 0.02, 0, "not resolved")],
)  # fmt: skip
def test_verdict_needs_the_whole_interval_on_one_side(mean, half, direction, expected):
    assert verdict(mean, half, direction).startswith(expected)


def runs(name: str, finals: dict[int, float]) -> PresetRuns:
    hist = {s: RunHistory(f"{name}-seed{s}", "", "FINISHED", "GRPO", {"val/accuracy": [(0, 0.1), (60, v)]})
            for s, v in finals.items()}  # fmt: skip
    return PresetRuns(name, 1, hist)


def test_paired_difference_pairs_by_seed_and_skips_unpaired_seeds():
    # Seed-to-seed spread is large, the paired differences are constant 0.02: a zero-width interval.
    base = runs("grpo", {0: 0.10, 1: 0.30, 2: 0.50, 3: 0.9})
    other = runs("thr", {0: 0.12, 1: 0.32, 2: 0.52})  # seed 3 did not finish
    mean, half, n = paired_difference(other, base, "val/accuracy", "last")
    assert n == 3 and mean == pytest.approx(0.02) and half == pytest.approx(0.0, abs=1e-12)
    unpaired_half = t_interval([0.12, 0.32, 0.52])[1]
    assert unpaired_half > 0.4  # what comparing the means without pairing would have to allow


def with_start(pr: PresetRuns, greedy_before: dict[int, float], commit: str) -> PresetRuns:
    for seed, r in pr.runs.items():
        r.history["val/accuracy_greedy"] = [(0, greedy_before[seed]), (60, 0.5)]
        r.commit = commit
    return pr


def test_runs_that_began_from_different_evaluations_are_not_paired():
    """A baseline recorded before a verifier fix began from another greedy accuracy than a preset run after it:
    their difference would be the fix's, so those seeds are left out, and the page says which and why."""
    from rlvr_lightning.results import CLAIMS

    base = with_start(runs("grpo", {0: 0.10, 1: 0.30, 2: 0.50}), {0: 0.345, 1: 0.345, 2: 0.45}, "old")
    other = with_start(runs("maxrl", {0: 0.12, 1: 0.32, 2: 0.55}), {0: 0.45, 1: 0.45, 2: 0.45}, "new")
    mean, half, n = paired_difference(other, base, "val/accuracy", "last")
    assert n == 1 and mean == pytest.approx(0.05) and math.isnan(half)  # seed 2 alone began where its baseline did
    results = {"grpo": base, "maxrl": other}
    assert "Not paired" in differences_table(results)[-1] and "`maxrl` seeds 0, 1" in differences_table(results)[-1]
    assert "0.345 at `old`; 0.450 at `new`" in start_sentence(results)
    with_start(base, {0: 0.345, 1: 0.345, 2: 0.345}, "old")
    claim = next(c[0] for c in CLAIMS if c[1] == "maxrl")
    row = next(line for line in claims_table(results) if line.startswith(f"| {claim} |"))
    assert row.endswith("| – | 0 | not comparable (the runs began from different starts) |")
    same = with_start(runs("maxrl", {0: 0.12}), {0: 0.345}, "old")
    assert start_sentence({"grpo": base, "maxrl": same}).startswith("`before` is the same warm start")
    assert paired_difference(same, base, "val/accuracy", "last")[2] == 1
    base.runs[0].warm_start, same.runs[0].warm_start = "66d538c8f3b0", "0123456789ab"  # another build, same greedy
    assert paired_difference(same, base, "val/accuracy", "last")[2] == 0


def log_budget(client, run, max_steps: str, model: str) -> None:
    """The two params every `make results` run logs (its config) that decide whether it counts."""
    client.log_param(run.info.run_id, "trainer.max_steps", max_steps)
    client.log_param(run.info.run_id, "data.model_name_or_path", model)


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
    assert "![val_accuracy](results-x/val_accuracy.png)" in page and (tmp_path / "results-x" / "val_accuracy.png").exists()
    assert "`python -m rlvr_lightning.results --algos grpo thr-explore oar-g --tracking-uri" in page
    # thr-explore − grpo on pass@8: +0.04, +0.05, +0.05 → interval above 0.
    row = next(line for line in page.splitlines() if line.startswith("| THR, p < 0 raises pass@k"))
    assert "| thr-explore − grpo | pass@8 | 0.047 ± 0.014 | 3 | reproduced |" in row
    row = next(line for line in page.splitlines() if line.startswith("| OAR-G above GRPO"))
    assert "| oar-g − grpo | val/accuracy | -0.050 ± 0.000 | 3 | contradicted |" in row  # −0.05 at every seed
    assert "| grpo | GRPO | 1 | 3 | 0.150 → 0.223 ± 0.063 |" in page  # sd 0.0252 × t(0.975, 2) 4.303 / √3
    assert "| OAR-P above GRPO | oar-p − its baseline | val/accuracy | – | 0 | not run |" in page


def test_resume_trains_only_what_the_experiment_lacks(tmp_path, monkeypatch):
    import mlflow

    import rlvr_lightning.results as results

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("results", artifact_location=str(tmp_path / "artifacts"))
    for name, max_steps, model, finish in [("grpo-seed0", "60", "embedded", True),  # reused
                                           ("grpo-seed1", "30", "embedded", True),  # another budget
                                           ("grpo-seed2", "60", "embedded-balanced", True),  # another model
                                           ("thr-seed0", "60", "embedded", False)]:  # killed
        run = client.create_run(exp, run_name=name)
        log_budget(client, run, max_steps, model)
        if finish:
            client.set_terminated(run.info.run_id)
    trained, parents = [], set()

    def train(preset, seed, args):
        trained.append(results.run_name(preset.stem, seed))
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

    import rlvr_lightning.results as results

    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    (tmp_path / "store").mkdir()
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("results", artifact_location=str(tmp_path / "store" / "artifacts"))
    for name, final, max_steps, model, start in [("grpo-seed0", 0.20, "60", "embedded", 1_000),
                                                  ("grpo-seed0", 0.90, "60", "embedded", 500),  # older: not the one
                                                  ("grpo-seed1", 0.25, "60", "embedded", 1_000),
                                                  ("thr-seed0", 0.30, "30", "embedded", 1_000),  # another budget
                                                  ("thr-seed1", 0.35, "60", "embedded-balanced", 1_000)]:  # model
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
    monkeypatch.setattr(results, "train", lambda preset, seed, args: (trained.append(results.run_name(preset.stem, seed)), (0, 1.0))[1])
    main(["--resume", "--tracking-uri", fresh, *argv])
    assert trained == ["thr-seed0", "thr-seed1"]
