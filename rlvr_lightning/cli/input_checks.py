"""What a run reads from outside, checked once the configuration is parsed and its classes are built (the module's
constructor has imported the reward functions by then), before anything else: its data files and its model and
teacher (a local directory, or a hub name this machine can use). Each problem is one line, before the memory plan and
before an MLflow run exists, so a failed start leaves no run behind. Then, after the plan, the embedded warm starts
the run names are built."""

from __future__ import annotations

from jsonargparse import Namespace

from rlvr_lightning.data.sources import DataSourceError, check_source
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.models.policy import check_model_source
from rlvr_lightning.models.warm_start import EMBEDDED_WARM_STARTS, resolve_policy_path


def check_inputs(cfg: Namespace) -> None:
    try:
        for option in ("train_data", "val_data"):
            check_source(cfg.data.get(option), f"data.{option}")
    except DataSourceError as err:
        raise ConfigError(str(err)) from None
    for option, name in models_named(cfg).items():
        if name not in EMBEDDED_WARM_STARTS:
            check_model_source(str(name), option)


def build_embedded_models(cfg: Namespace) -> None:
    """Build (or resume building) the embedded warm starts the run names, with their progress shown, before `fit`: an
    interrupted build leaves no MLflow run behind, and the run's first step does not wait for one."""
    for name in models_named(cfg).values():
        if name in EMBEDDED_WARM_STARTS:
            resolve_policy_path(name)


def models_named(cfg: Namespace) -> dict[str, str]:
    """The models the run loads, by the option that names them: the policy, and a distillation teacher."""
    teacher = cfg.model.init_args.get("teacher")
    named = {"data.model_name_or_path": cfg.data.get("model_name_or_path"),
             "model.teacher.model_name_or_path": teacher.get("model_name_or_path") if teacher else None}  # fmt: skip
    return {option: name for option, name in named.items() if name is not None}
