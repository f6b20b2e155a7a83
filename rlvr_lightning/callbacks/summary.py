"""What identifies a run in MLflow and what it printed last: tags to filter the runs table by (model
family, size, engine, git commit) and its datasets (training and every evaluation set, with source,
digest and size: the runs table's Dataset column), recorded when training starts, and the end-of-run summary (what the run
achieved and where to look next), printed as the run's last lines and kept as the MLflow run's
description (its Overview page shows it)."""

from __future__ import annotations

import hashlib
import json
import statistics
import subprocess
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from rlvr_lightning.callbacks.checkpoint import ResumableCheckpoint
from rlvr_lightning.callbacks.evaluation import Evaluation
from rlvr_lightning.callbacks.export import HFExport
from rlvr_lightning.models.lora import parameter_counts
from rlvr_lightning.models.warm_start import warm_start_digest
from rlvr_lightning.pieces.selection import selected_pieces
from rlvr_lightning.tracking import ui_link

HELD_OUT = [  # (label, metric, its standard error's metric)
    ("accuracy (T = 1)", "val/accuracy", "val/pass_at_1_se"),
    ("greedy accuracy", "val/accuracy_greedy", None),
]


def before_after(client, run_id: str, key: str, se_key: str | None) -> str | None:
    points = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
    if not points:
        return None
    se = sorted((m.step, m.value) for m in client.get_metric_history(run_id, se_key)) if se_key else []
    ses = dict(se)
    cell = lambda step, v: f"{v:.3f}" + (f" ± {ses[step]:.3f}" if step in ses else "")  # noqa: E731
    (s0, v0), (s1, v1) = points[0], points[-1]
    return cell(s0, v0) if s0 == s1 else f"{cell(s0, v0)} → {cell(s1, v1)} (rollout batch {s0} → {s1})"


def pieces_run(values, every_kind: bool = False) -> dict[str, str]:
    """The registered name of each piece `values` (an algorithm's hyper-parameters or its config's init_args)
    select, by selecting key; the KL estimator only with a KL term (`kl_coef` > 0) unless `every_kind`."""
    return {
        key: piece.name
        for key, (piece, _) in selected_pieces(values).items()
        if every_kind or key != "kl_estimator" or (values.get("kl_coef") or 0) > 0
    }


def summary_lines(trainer: L.Trainer, module) -> list[str]:
    logger = next((lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)), None)
    algorithm = module.__class__.__name__
    name = f"{logger._run_name} ({algorithm})" if logger is not None and logger._run_name else algorithm
    lines = [
        f"rlvr_lightning: {name}, {module.rollout_batches} rollout batches",
        "  pieces: " + ", ".join(f"{k}={v}" for k, v in pieces_run(module.hparams).items()),
    ]
    if logger is not None:
        client, run_id = logger.experiment, logger.run_id
        data = client.get_run(run_id).data
        if parts := data.tags.get("parts"):  # reward functions, shapers, environment or tool, teacher (`cli.run_naming`)
            lines.append("  parts: " + parts.replace("+", ", "))
        pass_keys = sorted(
            (k for k in data.metrics if k.startswith("val/pass_at_") and not k.endswith("_se")),
            key=lambda k: int(k.rsplit("_", 1)[1]),
        )
        rows = HELD_OUT + [(f"pass@{k.rsplit('_', 1)[1]}", k, f"{k}_se") for k in pass_keys if k != "val/pass_at_1"]
        for label, key, se_key in rows:
            cell = before_after(client, run_id, key, se_key)
            if cell is not None:
                lines.append(f"  held-out {label}: {cell}")
        step_times = [m.value for m in client.get_metric_history(run_id, "time/step")]
        if step_times:
            lines.append(f"  time per rollout batch: {statistics.fmean(step_times):.2f} s")
        lines.append(f"  MLflow run: {run_id} (experiment {logger.experiment_id}, store {logger._tracking_uri})")
    for cb in trainer.callbacks:
        if isinstance(cb, HFExport) and cb.final:
            lines.append(f"  exported policy (HF format): {cb.run_dir(trainer) / 'final'}")
        if isinstance(cb, ResumableCheckpoint):
            lines.append(f"  checkpoint (resume with RESUME=…): {cb.run_dir(trainer) / 'last.ckpt'}")
    if logger is not None:
        lines.append(f"  look at it: make ui, then {ui_link(logger.experiment_id, logger.run_id)}")
        name = logger._run_name or "<run name>"
        lines.append(f"  compare with other runs: make compare RUNS='{name} <another run name>'")
    return lines


def git_commit() -> str | None:
    """This package's git commit (with `-dirty` for uncommitted changes), or None outside a checkout."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=12"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def run_tags(trainer: L.Trainer, module) -> dict[str, str]:
    config = module.policy.config
    trainable, params = parameter_counts(module.policy)
    tags = {
        "model_family": str(getattr(config, "model_type", "?")),
        "params": f"{params / 1e6:.1f}M",
        "trainable_params": f"{trainable / 1e6:.3f}M ({trainable / params:.2%})",
        "engine": str(trainer.datamodule.rollout.engine),
        "devices": str(trainer.world_size),
    }
    if digest := warm_start_digest(trainer.datamodule.hparams.model_name_or_path):
        tags["warm_start_sha256"] = digest
    commit = git_commit()
    return tags | ({"git_commit": commit} if commit else {})


def dataset_input(source: str, part: str, records, context: str):
    """An MLflow dataset input: named after its source (and the embedded task's part), the digest of its
    problems and answers, its row count, and the context ("training" or "evaluation") the UI shows."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    blob = json.dumps([(r.id, r.problem, r.answer) for r in records]).encode()
    if source == "embedded":
        name, source_type = f"embedded-{part}", "code"
    else:
        name, source_type = (Path(source).name, "local") if Path(source).exists() else (source, "hugging_face")
    dataset = Dataset(
        name=name,
        digest=hashlib.sha256(blob).hexdigest()[:8],
        source_type=source_type,
        source=json.dumps({"uri": str(source), "split": part}),
        profile=json.dumps({"num_rows": len(records)}),
    )
    return DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)])


def dataset_inputs(trainer: L.Trainer) -> list:
    dm = trainer.datamodule
    inputs = [dataset_input(dm.hparams.train_data, dm.hparams.train_split, dm.train_records, "training")]
    for cb in trainer.callbacks:
        if isinstance(cb, Evaluation):
            for task in cb.tasks(dm):  # resolved in the callback's setup, before fit starts
                part = "test" if task.source == "embedded" else task.prefix
                inputs.append(dataset_input(task.source, part, task.records, "evaluation"))
    return inputs


class RunSummary(L.Callback):
    """Tags the MLflow run when training starts; prints the summary when it ends and stores it as the
    MLflow run's description."""

    @rank_zero_only
    def on_fit_start(self, trainer: L.Trainer, pl_module) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                for key, value in run_tags(trainer, pl_module).items():
                    logger.experiment.set_tag(logger.run_id, key, value)
                logger.experiment.log_inputs(logger.run_id, datasets=dataset_inputs(trainer))

    @rank_zero_only
    def on_fit_end(self, trainer: L.Trainer, pl_module) -> None:
        lines = summary_lines(trainer, pl_module)
        print("\n" + "\n".join(lines), flush=True)
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):  # the run's description, shown on its Overview page
                logger.experiment.set_tag(logger.run_id, "mlflow.note.content", "\n".join(["```", *lines, "```"]))
