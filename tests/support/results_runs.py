"""MLflow runs as `make results` logs them, for the tests of tests/results/."""

from __future__ import annotations


def log_budget(client, run, max_steps: str, model: str) -> None:
    """The two params every `make results` run logs (its config) that decide whether it counts."""
    client.log_param(run.info.run_id, "trainer.max_steps", max_steps)
    client.log_param(run.info.run_id, "data.model_name_or_path", model)
