"""Command line: `python -m rlvr_lightning fit --config configs/base.yaml --config configs/algo/grpo.yaml ...`.

A LightningCLI whose model is any `RLVRModule` subclass (the algorithm), whose data is the
RolloutDataModule and whose `rollout:` section (`RolloutSettings`: sampling and the engine) is handed
to the data module. Additions over the stock CLI:
  * `--imports my_pieces` (and installed packages' `rlvr_lightning.pieces` entry points) import a user's
    piece modules before parsing, so the names they register parse (`rlvr_lightning/pieces/loading.py`);
  * the MLflow run is named after the preset and the pieces it changes (`run_identity`), and tagged with
    algorithm, preset, pieces, model and dataset;
  * the resolved config is logged to MLflow (flattened params + `config.yaml` artifact) instead of
    being written to a log directory, which the MLflow logger does not have.
User errors (bad config values, data files, model paths) print one clear line, no usage and no traceback.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import traceback
from argparse import ArgumentError
from pathlib import Path

import yaml
from jsonargparse import ArgumentParser, Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger

import rlvr_lightning.algos  # noqa: F401  (registers every algorithm for `--model <Name>`)
from rlvr_lightning.algos.base import RLVRModule
from rlvr_lightning.callbacks.summary import pieces_run
from rlvr_lightning.console import verbose
from rlvr_lightning.data.datamodule import RolloutDataModule
from rlvr_lightning.data.sources import DataSourceError
from rlvr_lightning.device_defaults import (
    DeviceDefaults,
    apply_to_config,
    config_device_defaults,
    detect_accelerator,
)
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.pieces.loading import OPTION as IMPORTS
from rlvr_lightning.pieces.loading import load_piece_modules
from rlvr_lightning.planner.preflight import preflight
from rlvr_lightning.planner.settings import PlanSettings
from rlvr_lightning.rewards.pool import VerifierUnavailable
from rlvr_lightning.rollout.server_process import RolloutServerError, RolloutServerLost
from rlvr_lightning.rollout.settings import RolloutSettings
from rlvr_lightning.training.dynamic_sampling import DynamicSamplingExhausted


class MLflowSaveConfig(SaveConfigCallback):
    def __init__(self, *args, device_defaults: DeviceDefaults | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.device_defaults = device_defaults  # what the CLI resolved from the accelerator, recorded with the params

    def save_config(self, trainer, pl_module, stage: str) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                text = self.parser.dump(self.config, skip_none=False)
                if self.config.get("ckpt_path"):
                    # Resumed into its own run: the params are there already, and MLflow refuses to change
                    # one (e.g. a longer trainer.max_steps); the resumed config is kept beside the first.
                    logger.experiment.log_text(logger.run_id, text, f"config_resumed_{int(time.time())}.yaml")
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


class RLVRCLI(LightningCLI):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("save_config_callback", MLflowSaveConfig)
        kwargs.setdefault("save_config_kwargs", {"save_to_log_dir": False})
        argv = kwargs.get("args")
        argv = sys.argv[1:] if argv is None else argv
        if isinstance(argv, dict | Namespace):  # a config given as an object: its `imports` only
            argv = [f"--{IMPORTS}", json.dumps(argv.get(IMPORTS))] if argv.get(IMPORTS) else []
        # Before the parser exists: the piece names a user's modules register are values it checks.
        load_piece_modules([str(a) for a in argv])
        super().__init__(RLVRModule, RolloutDataModule, *args, subclass_mode_model=True, **kwargs)

    def init_parser(self, **kwargs) -> LightningArgumentParser:
        # jsonargparse raises instead of printing its usage and a nested message: `parse_arguments` prints one line.
        kwargs.setdefault("exit_on_error", False)
        return super().init_parser(**kwargs)

    def parse_arguments(self, parser, args) -> None:
        try:
            super().parse_arguments(parser, args)
            resolve_run_length(self.config[self.config.subcommand] if self.config.get("subcommand") else self.config)
        except ArgumentError as err:
            if verbose():  # -v: jsonargparse's whole account too
                print(str(err), file=sys.stderr)
            line = parse_error_line(err)
            print(f"error: {line}{option_hint(line)}", file=sys.stderr)
            sys.exit(2)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            f"--{IMPORTS}", type=list[str] | str | None, default=None,
            help="Modules to import before the configuration is read, e.g. your own pieces' (`--imports my_pieces`, "
            "`imports: [my_pieces]` in a config file); their directory must be on PYTHONPATH.",
        )  # fmt: skip
        parser.add_argument(
            "--rollout_batches", type=int | None, default=None,
            help="The run's length in rollout batches (training steps); sets trainer.max_steps, which counts optimizer "
            "steps: model.num_mini_batches × model.ppo_epochs of them per rollout batch.",
        )  # fmt: skip
        parser.add_class_arguments(RolloutSettings, "rollout")
        parser.add_class_arguments(PlanSettings, "plan")
        parser.link_arguments("rollout", "data.rollout", apply_on="instantiate")

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as err:  # a constructor's own check (jsonargparse wraps a class_path's error in its own)
            if user_error_behind(err) is not None:
                raise
            raise ConfigError(constructor_error_line(err)) from err
        except MisconfigurationException as err:  # the Trainer's (e.g. an accelerator this machine lacks)
            raise ConfigError(f"trainer: {err}") from err

    def after_instantiate_classes(self) -> None:
        super().after_instantiate_classes()
        if self.subcommand == "fit":  # after every constructor's own checks, before any weights, engine or process group
            preflight(self.config["fit"])

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        self.resolve_device_defaults(cfg)
        use_rollout_progress_bar(cfg.trainer)
        logger = cfg.trainer.logger
        if not (isinstance(logger, Namespace) and logger.class_path.endswith("MLFlowLogger")):
            return
        args = logger.init_args
        if cfg.get("ckpt_path") and not args.run_id:
            run_id = checkpoint_run_id(cfg.ckpt_path)  # resume into the same MLflow run, if this store has it
            if run_id and mlflow_run_exists(args.tracking_uri, run_id):
                args.run_id = run_id
            elif run_id:
                logging.getLogger(__name__).warning(
                    "checkpoint %s was written by MLflow run %s, which %s does not hold; logging to a new run",
                    cfg.ckpt_path, run_id, args.tracking_uri,
                )  # fmt: skip
        name, tags = run_identity(cfg)
        args.run_name = args.run_name or name  # a name the user gives wins
        args.tags = {**(args.tags or {}), **tags, "model": cfg.data.model_name_or_path, "dataset": cfg.data.train_data}


    def resolve_device_defaults(self, cfg: Namespace) -> None:
        """The settings the user left to the device (`rlvr_lightning.device_defaults`) resolve from the accelerator
        `trainer.accelerator` selects, into the config itself; printed once, and recorded with the params."""
        self.device_defaults = config_device_defaults(cfg, detect_accelerator(cfg.trainer.accelerator))
        apply_to_config(cfg, self.device_defaults)
        if isinstance(self.save_config_callback, type) and issubclass(self.save_config_callback, MLflowSaveConfig):
            self.save_config_kwargs = {**self.save_config_kwargs, "device_defaults": self.device_defaults}
        if not spawned_rank():
            print(self.device_defaults.block(), flush=True)


def spawned_rank() -> bool:
    """A process Lightning's launcher (or torchrun, SLURM) started for a rank other than the first: the first
    one prints what every rank shares."""
    import os

    return any(int(os.environ.get(name, "0") or 0) > 0 for name in ("LOCAL_RANK", "NODE_RANK", "RANK"))


def resolve_run_length(cfg: Namespace) -> None:
    """`rollout_batches` into Lightning's `trainer.max_steps`, which counts optimizer steps: K = num_mini_batches ×
    ppo_epochs of them per rollout batch. The run's length is given once: a preset says 160, whatever its K."""
    batches = cfg.get("rollout_batches")
    if batches is None:
        return
    if batches < 1:
        raise ConfigError(f"rollout_batches={batches}: the run's length must be ≥ 1 rollout batch")
    max_steps = cfg.trainer.max_steps
    if max_steps not in (None, -1):
        raise ConfigError(
            f"rollout_batches={batches} and trainer.max_steps={max_steps} both set the run's length: give it once, as "
            "--rollout_batches (trainer.max_steps counts optimizer steps; --rollout_batches null leaves it to them)"
        )
    args = cfg.model.init_args
    cfg.trainer.max_steps = batches * args.num_mini_batches * args.ppo_epochs


def known_options() -> dict[str, set[str]]:
    """The options of each section, read from the signatures that LightningCLI reads (`model`: every
    algorithm's arguments)."""
    import inspect

    import lightning as L

    def names(*callables) -> set[str]:
        return {p for c in callables for p in inspect.signature(c).parameters if p not in ("self", "args", "kwargs")}

    algorithms = [getattr(rlvr_lightning.algos, n) for n in rlvr_lightning.algos.__all__]
    return {"model": names(*algorithms), "data": names(RolloutDataModule), "rollout": names(RolloutSettings),
            "trainer": names(L.Trainer), "plan": names(PlanSettings)}  # fmt: skip


def option_hint(line: str) -> str:
    """For a parse error about an unknown option, the valid options it most resembles: the same name in
    another section (`data.group_size` → `rollout.group_size`), else the closest names in its own."""
    import difflib

    found = re.match(r"(\w+): Option '(\w+)' is not accepted", line) or re.search(r"unrecognized arguments: --(\w+)\.(?:init_args\.)?(\w+)", line)  # fmt: skip
    if found is None:
        return ""
    section, name = found.groups()
    options = known_options()
    if section not in options:
        return ""
    same = [f"{other}.{name}" for other, names in options.items() if other != section and name in names]
    close = same or [f"{section}.{n}" for n in difflib.get_close_matches(name, sorted(options[section]), n=3)]
    return f"; did you mean {' or '.join(close)}?" if close else "; every option with its value: --print_config"


def parse_error_line(err: ArgumentError) -> str:
    """One line for a parse error: our own ConfigError's message if one caused it (an unknown or unimportable
    piece), else the dotted option jsonargparse names at each level ('Parser key "model"', 'Parser key "lr"')
    and the innermost reason it gives, whitespace collapsed (no usage, no list of union members)."""
    user_error = user_error_behind(err)
    if user_error is not None:
        return " ".join(str(user_error).split())
    keys, reason, previous = [], str(err), None
    for e in error_chain(err):
        text = str(e)
        if text != previous:  # jsonargparse re-raises one message in several wrappers
            key = re.match(r'Parser key "([^"]+)"', text)
            keys += [key.group(1)] if key else []
            reason = text
        previous = text
    reason = " ".join(re.sub(r'^Parser key "[^"]+":', "", reason).split())
    return f"{'.'.join(keys)}: {reason}" if keys else reason


def constructor_error_line(err: ValueError) -> str:
    """One line for a ValueError a configured class's constructor raised (a user's own algorithm or piece
    check): its message and where it was raised."""
    cause = list(error_chain(err))[-1]
    message = " ".join(str(cause).split())
    frames = traceback.extract_tb(cause.__traceback__)
    if not frames:
        return message
    return f"{message} ({type(cause).__name__} at {frames[-1].filename}:{frames[-1].lineno}, in {frames[-1].name})"


def error_chain(err: BaseException):
    """`err`, then what caused it, outermost first."""
    seen = set()
    while err is not None and id(err) not in seen:
        yield err
        seen.add(id(err))
        err = err.__cause__ or err.__context__


def run_identity(cfg: Namespace) -> tuple[str, dict[str, str]]:
    """The run's default name and its tags. The name is the preset's (the last `--config` file that names the
    algorithm class: configs/algo/grpo.yaml → `grpo`), followed by `+<key>=<piece>` for each piece the run
    uses that differs from what the preset alone selects (`grpo+policy_loss=my_loss`), and by `+model=<Class>`
    first when `--model` changed the class. So a run is never taken for its preset's unless it ran the
    preset's pieces. Without a preset file the class's name in lower case is the preset and its defaults the
    reference. Tags: `algorithm` (the class), `preset`, `piece.<key>` for each piece the run uses
    (`kl_estimator` only with a KL term), and `changed_pieces` (`policy_loss=my_loss+…`) when some differ."""
    model = cfg.model
    algorithm = model.class_path.rsplit(".", 1)[-1]
    preset = preset_of(cfg.get("config") or [])
    name, reference = preset if preset else (algorithm.lower(), {"class_path": model.class_path})
    reference = resolved_model(reference)
    changed = [f"model={algorithm}"] if reference.class_path != model.class_path else []
    tags, preset_pieces = {"algorithm": algorithm, "preset": name}, pieces_run(reference.init_args, every_kind=True)
    for key, piece in pieces_run(model.init_args).items():
        tags[f"piece.{key}"] = piece
        if piece != preset_pieces[key]:
            changed.append(f"{key}={piece}")
    if changed:
        tags["changed_pieces"] = "+".join(changed)
    return "+".join([name, *changed]), tags


def preset_of(config_files: list) -> tuple[str, dict] | None:
    """(name, `model:` section) of the last config file that names the algorithm class (`model.class_path`)."""
    for path in reversed(config_files):
        try:
            cfg = yaml.safe_load(path.get_content()) if hasattr(path, "get_content") else None
        except (OSError, yaml.YAMLError):
            continue
        section = cfg.get("model") if isinstance(cfg, dict) else None
        if isinstance(section, dict) and section.get("class_path"):
            return Path(str(path)).stem, section
    return None


def resolved_model(section: dict) -> Namespace:
    """A `model:` section with the class's defaults filled in, as the CLI resolves it."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(RLVRModule, "model", required=True)
    return parser.parse_object({"model": section}).model


def use_rollout_progress_bar(trainer_cfg: Namespace) -> None:
    """Lightning's default progress bar counts epochs and optimizer steps; ours counts rollout batches.
    Added here rather than in a config's callback list, so that `--trainer.enable_progress_bar=false`
    still works and a progress bar a user configures wins."""
    callbacks = trainer_cfg.callbacks or []
    callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
    if trainer_cfg.enable_progress_bar is False or any("ProgressBar" in str(c.get("class_path", "")) for c in callbacks):
        return
    trainer_cfg.callbacks = [*callbacks, Namespace(class_path="rlvr_lightning.callbacks.progress.RolloutProgressBar",
                                                   init_args=Namespace())]  # fmt: skip


def checkpoint_run_id(path: str) -> str | None:
    """The MLflow run a checkpoint was written by (None: start a new run)."""
    import torch

    if not Path(path).exists():
        raise ConfigError(f"ckpt_path: no checkpoint at {path}")
    if Path(path).is_dir():  # a sharded checkpoint: its `last.json` sidecar names the run
        sidecar = Path(path).parent / "last.json"
        return json.loads(sidecar.read_text()).get("mlflow_run_id") if sidecar.exists() else None
    try:  # mmap: only the small metadata is read, not the weights
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as err:
        raise ConfigError(f"ckpt_path: cannot read checkpoint {path} ({type(err).__name__}: {err})") from None
    return (state.get("rlvr") or {}).get("mlflow_run_id")


def mlflow_run_exists(tracking_uri: str | None, run_id: str) -> bool:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(tracking_uri=tracking_uri).get_run(run_id)
        return True
    except MlflowException:
        return False


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        RLVRCLI(args=argv)
    except Exception as err:
        user_error = user_error_behind(err)
        if user_error is None:
            raise
        resume = ""
        if isinstance(user_error, RolloutServerLost):
            resume = " The run stops here; `make train RESUME=checkpoints/<run id>/last.ckpt` continues it from its last checkpoint"
        print(f"error: {user_error}{resume}", file=sys.stderr)
        sys.exit(2)


def user_error_behind(err: BaseException) -> BaseException | None:
    """The ConfigError, DataSourceError, RolloutServerError, DynamicSamplingExhausted or VerifierUnavailable that caused `err`, if any:
    jsonargparse re-raises a class's constructor error as its own ValueError while instantiating the
    config. (A run that stops on exhausted dynamic sampling resumes from its last checkpoint.)"""
    user_errors = (ConfigError, DataSourceError, RolloutServerError, DynamicSamplingExhausted, VerifierUnavailable)
    return next((e for e in error_chain(err) if isinstance(e, user_errors)), None)
