"""The resolved config logged to MLflow: the `config.yaml` artifact and flattened params (the module's effective
hyper-parameters, and where each device-defaulted setting came from), instead of a file in a log directory,
which the MLflow logger does not have."""

from __future__ import annotations

import time

from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger

from rlvr_lightning.device_defaults import DeviceDefaults


class MLflowSaveConfig(SaveConfigCallback):
    def __init__(self, *args, device_defaults: DeviceDefaults | None = None, resume_changes: str = "none", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.device_defaults = device_defaults  # what the CLI resolved from the accelerator, recorded with the params
        self.resume_changes = resume_changes  # on a resume: where from, and the settings this command line changed

    def save_config(self, trainer, pl_module, stage: str) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                text = self.parser.dump(self.config, skip_none=False)
                if self.config.get("ckpt_path"):
                    # Resumed into its own run: the params are there already, and MLflow refuses to change
                    # one (e.g. a longer trainer.max_steps); the resumed config is kept beside the first.
                    stamp = int(time.time())
                    logger.experiment.log_text(logger.run_id, text, f"config_resumed_{stamp}.yaml")
                    logger.experiment.set_tag(logger.run_id, f"resumed.{stamp}", self.resume_changes[:5000])
                    continue
                logger.experiment.log_text(logger.run_id, text, "config.yaml")
                logger.log_hyperparams(logged_params(self.config.as_dict(), pl_module, self.device_defaults))


def logged_params(cfg: dict, module, device_defaults: DeviceDefaults | None = None) -> dict[str, object]:
    """The run's parameters for MLflow: the resolved config, with the model's section replaced by the
    values the module runs with (its effective hyper-parameters, class defaults included), and for each
    setting that follows the device where its value came from (`device_defaults.<key>`)."""
    params = {k: v for k, v in flatten_config(cfg).items() if not k.startswith("model.init_args.")}
    effective = {k: v for k, v in module.hparams.items() if not k.startswith("_")}
    sources = device_defaults.params() if device_defaults is not None else {}
    return {**params, **flatten_config({"model": {"init_args": effective}}), **sources}


def flatten_config(cfg: dict, prefix: str = "") -> dict[str, object]:
    """Dotted keys, exactly the CLI flag names (`model.init_args.optim.lr`), for MLflow params.

    The logger's own settings are left out: they are not hyper-parameters, and the tracking URI is
    machine-specific. Lists (callbacks) are flattened by index.
    """
    flat: dict[str, object] = {}
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if name in ("trainer.logger", "_instantiator", "__path__", "ckpt_path"):
            continue
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            value = {str(i): v for i, v in enumerate(value)}
        if isinstance(value, dict):
            flat.update(flatten_config(value, name + "."))
        else:
            flat[name] = value
    return flat
