"""Run records: one small JSON file per finished `make results` run, committed beside the page it feeds.

The results page is built from these files, not from the MLflow store, so that the evidence for every
number lives in the repository: anyone can rebuild the page (`--skip-training`) without the store, and
`--resume` goes on where an interrupted `make results` stopped even on another machine (the store is
local; the records travel with the commits). A record keeps only the metrics the page reads, with the
run's budget (`trainer.max_steps`), model, commit and wall time, so a run of another budget or model is
never mixed into the page.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from rlvr_lightning.compare import RunHistory, load_history


@dataclass(frozen=True)
class RunRecord:
    run: RunHistory
    max_steps: str  # as MLflow logs the param: the budget the run was trained with
    model: str  # data.model_name_or_path
    start_time: int  # ms since the epoch: of two records of one name, the later run wins

    def matches(self, max_steps: int, model: str, warm_start: str | None = None) -> bool:
        """Trained with this budget from this model, and from these weights where the run and the caller know
        their digest (`warm_start`: `warm_start_digest`)."""
        return self.max_steps == str(max_steps) and self.model == model and same_weights(self.run.warm_start, warm_start)


def same_weights(recorded: str | None, current: str | None) -> bool:
    """Whether a run recorded from warm-start digest `recorded` began from the weights of digest `current`: equal, or
    one of them unknown (a run that never tagged it, a warm start not known without building it)."""
    return recorded is None or current is None or recorded == current


def record_from_mlflow(client, run, columns) -> RunRecord:
    """The record of a finished MLflow run, with the metrics of `columns` and the plots."""
    params = run.data.params
    return RunRecord(
        load_history(client, run, columns),
        params.get("trainer.max_steps", ""),
        params.get("data.model_name_or_path", ""),
        int(run.info.start_time or 0),
    )


def write_record(record: RunRecord, directory: Path) -> Path:
    r = record.run
    path = directory / f"{r.name}.json"
    body = {
        "name": r.name,
        "run_id": r.run_id,
        "algorithm": r.algorithm,
        "commit": r.commit,
        "warm_start": r.warm_start,
        "seconds": None if math.isnan(r.seconds) else r.seconds,
        "max_steps": record.max_steps,
        "model": record.model,
        "start_time": record.start_time,
        "history": {key: [[step, value] for step, value in points] for key, points in sorted(r.history.items())},
    }
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")  # a kill mid-write leaves the old record, never half of one
    tmp.write_text(json.dumps(body, indent=None, separators=(",", ":")) + "\n")
    tmp.replace(path)
    return path


def read_records(directory: Path) -> dict[str, RunRecord]:
    """Run name → its record, for every record in `directory` (none when it does not exist)."""
    out = {}
    for path in sorted(directory.glob("*.json")):
        try:
            d = json.loads(path.read_text())
            history = {key: [(int(s), float(v)) for s, v in points] for key, points in d["history"].items()}
            seconds = math.nan if d.get("seconds") is None else float(d["seconds"])
            run = RunHistory(
                d["name"],
                d.get("run_id", ""),
                "FINISHED",
                d.get("algorithm", "?"),
                history,
                seconds,
                d.get("commit"),
                d.get("warm_start"),
            )
            out[run.name] = RunRecord(run, str(d["max_steps"]), str(d["model"]), int(d.get("start_time", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise SystemExit(f"error: run record {path} is not a record `make results` wrote ({e!r}); delete it to retrain that run") from e
    return out
