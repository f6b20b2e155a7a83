"""What a run reads from outside, checked once the configuration is parsed and before anything else: its data files,
its model and teacher (a local directory, or a hub name this machine can use), and its reward functions. Each problem
is one line, before the memory plan and before an MLflow run exists, so a failed start leaves no run behind."""

from __future__ import annotations

from jsonargparse import Namespace

from rlvr_lightning.data.sources import DataSourceError, check_source
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.models.policy import check_model_source
from rlvr_lightning.models.warm_start import EMBEDDED_WARM_STARTS, resolve_policy_path
from rlvr_lightning.rewards.loading import load_function
from rlvr_lightning.rewards.settings import ENVIRONMENT, MATH_VERIFY, RewardSettings


def check_inputs(cfg: Namespace) -> None:
    data, model_args = cfg.data, cfg.model.init_args
    try:
        for option in ("train_data", "val_data"):
            check_source(data.get(option), f"data.{option}")
    except DataSourceError as err:
        raise ConfigError(str(err)) from None
    models = {"data.model_name_or_path": data.get("model_name_or_path")}
    teacher = model_args.get("teacher")
    if teacher is not None:
        models["model.teacher.model_name_or_path"] = teacher.get("model_name_or_path")
    for option, name in models.items():
        if name is not None and name not in EMBEDDED_WARM_STARTS:
            check_model_source(str(name), option)
    rewards = model_args.get("rewards")
    rewards = RewardSettings.of(rewards.as_dict() if isinstance(rewards, Namespace) else rewards)
    if rewards.correctness not in (MATH_VERIFY, ENVIRONMENT):
        load_function(rewards.correctness, "model.rewards.correctness")
    for function in rewards.functions:
        load_function(function.function)


def build_embedded_models(cfg: Namespace) -> None:
    """Build (or resume building) the embedded warm starts the run names, with their progress shown, before `fit`: an
    interrupted build leaves no MLflow run behind, and the run's first step does not wait for one."""
    teacher = cfg.model.init_args.get("teacher")
    for name in (cfg.data.get("model_name_or_path"), teacher.get("model_name_or_path") if teacher else None):
        if name in EMBEDDED_WARM_STARTS:
            resolve_policy_path(name)
