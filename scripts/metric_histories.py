"""Dump every metric history of an MLflow store's runs as JSON, or compare two dumps.

Behaviour-preserving changes are shown to be so by training the same presets before and after and
comparing the histories bit for bit (CPU runs are deterministic). Wall-clock metrics (`time/`,
`throughput/`, `system/`, rates `*_per_s` and durations `*seconds`, `*_ms`) differ run to run and are left out.

    python scripts/metric_histories.py dump sqlite:///before/mlflow.db before.json
    python scripts/metric_histories.py diff before.json after.json
"""

from __future__ import annotations

import json
import sys

NOISY = ("time/", "throughput/", "system/")
NOISY_SUFFIXES = ("_per_s", "seconds", "_ms")


def dump(tracking_uri: str, out: str) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    runs = {}
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id]):
            name = run.info.run_name
            histories = {}
            for key in sorted(run.data.metrics):
                if key.startswith(NOISY) or key.endswith(NOISY_SUFFIXES):
                    continue
                points = client.get_metric_history(run.info.run_id, key)
                histories[key] = sorted((p.step, p.value) for p in points)
            runs[name] = histories
    with open(out, "w") as f:
        json.dump(runs, f, indent=0, sort_keys=True)
    print(f"{len(runs)} runs → {out}")


def diff(a_path: str, b_path: str) -> int:
    a, b = json.load(open(a_path)), json.load(open(b_path))
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'after' if name in b else 'before'}")
            bad += 1
            continue
        keys = set(a[name]) | set(b[name])
        differing = sorted(k for k in keys if a[name].get(k) != b[name].get(k))
        points = sum(len(v) for v in a[name].values())
        status = "identical" if not differing else f"{len(differing)} of {len(keys)} metrics differ: {differing[:8]}"
        print(f"{name}: {len(keys)} metrics, {points} points: {status}")
        bad += bool(differing)
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[3])
    else:
        sys.exit(diff(sys.argv[2], sys.argv[3]))
