"""Running the command line as a user does, for the end-to-end tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

REPO = Path(__file__).resolve().parents[2]
BASE = ["fit", "--config", "configs/base.yaml", "--config", "configs/algo/grpo.yaml"]


def run_cli(
    args: list[str], tmp_path: Path, timeout: int = 420, pythonpath: tuple[Path, ...] = (), module: str = "rlvr_lightning"
) -> subprocess.CompletedProcess:
    """The CLI as a user runs it, from a scratch directory (relative outputs such as `exports/` land
    there, not in the repository); `configs/…` arguments point into the repository. `pythonpath`: a
    user's own directories (their piece modules), after this checkout. `module`: another entry point
    (`rlvr_lightning.evaluate`, what `make eval` runs)."""
    # PYTHONPATH: this checkout (and its tests' stand-in callbacks), whichever one the venv installed.
    path = os.pathsep.join(map(str, (REPO, *pythonpath)))
    env = {**os.environ, "RLVR_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    # An in-process vLLM engine built earlier in this pytest process set vLLM's log level in its environment;
    # a user's shell has none, and the CLI's own quiet default is what these runs check.
    env.pop("VLLM_LOGGING_LEVEL", None)
    args = [str(REPO / a) if a.startswith("configs/") else a for a in args]
    if args and args[0] == "fit" and not any(a.startswith("--plan.") for a in args):
        args.append("--plan.check=false")  # the planner's own tests run it; here it would only add seconds
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def run_in_process(args: list[str], tmp_path: Path, monkeypatch, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the CLI's `main` called in this process from `tmp_path`, as `run_cli` runs
    it, for what ends before training starts (a one-line error, a printed config): a new interpreter's imports
    cost more than the check."""
    from rlvr_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RLVR_CACHE_DIR", str(tmp_path / "cache"))
    args = [str(REPO / a) if a.startswith("configs/") else a for a in args]
    if args and args[0] == "fit" and not any(a.startswith("--plan.") for a in args):
        args.append("--plan.check=false")
    try:
        main(args)
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def small_run_args(tmp_path: Path, model_dir: Path) -> list[str]:
    return [
        *BASE,
        "--rollout_batches", "2",
        "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp_path}/mlflow.db",
        "--trainer.logger.init_args.artifact_location", str(tmp_path / "artifacts"),
        "--data.model_name_or_path", str(model_dir),
        "--data.batch_size", "4",
        "--rollout.group_size", "4",
        "--data.val_size", "8",
        "--rollout.max_response_length", "16",
    ]  # fmt: skip


class TwoStepRuns:
    """2-step GRPO fits into one MLflow store, one per engine (vLLM with the quiet default output, HF with
    -v), each trained the first time a test asks for it. test_cli checks each run; the MLflow UI test
    browses the store holding both."""

    def __init__(self, root: Path, model_dir: Path):
        self.root, self.model_dir, self.procs = root, model_dir, {}

    @property
    def tracking_uri(self) -> str:
        return f"sqlite:///{self.root}/mlflow.db"

    def get(self, engine: str) -> subprocess.CompletedProcess:
        """The run on `engine`: trained by the first test process that asks (the session's workers share `root`),
        read back from its record by the others."""
        if engine not in self.procs:
            record = self.root / f"grpo-{engine}.json"
            with FileLock(str(record) + ".lock"):
                if not record.exists():
                    proc = run_cli([*(["-v"] if engine == "hf" else []), *small_run_args(self.root, self.model_dir),
                                    "--rollout.engine", engine, "--trainer.logger.init_args.run_name", f"grpo-{engine}",
                                    # Room for the warm start's whole answers, so some are right.
                                    "--rollout.max_response_length", "40",
                                    "--trainer.logger.init_args.system_metrics_interval_s", "1"], self.root)  # fmt: skip
                    record.write_text(json.dumps({"args": proc.args, "returncode": proc.returncode,
                                                  "stdout": proc.stdout, "stderr": proc.stderr}))  # fmt: skip
            run = json.loads(record.read_text())
            self.procs[engine] = subprocess.CompletedProcess(run["args"], run["returncode"], run["stdout"], run["stderr"])
        return self.procs[engine]
