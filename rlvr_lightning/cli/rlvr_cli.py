"""`RLVRCLI`: the LightningCLI whose model is any `RLVRModule` subclass (the algorithm), whose data is the
RolloutDataModule and whose `rollout:` section (`RolloutSettings`: sampling and the engine) is handed to the
data module; `plan:` configures the pre-flight check. A user's piece modules are imported before the parser
exists, parse errors and constructor errors become one line, and the config is completed (run length, device
defaults, progress bar, the MLflow run's name, tags and resumed run) before any class is instantiated."""

from __future__ import annotations

import json
import re
import sys
from argparse import ArgumentError
from pathlib import Path

from jsonargparse import Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import rlvr_lightning.algos  # noqa: F401  (registers every algorithm for `--model <Name>`)
from rlvr_lightning import checkpoint_record
from rlvr_lightning.algos.base import RLVRModule
from rlvr_lightning.callbacks.stopping import StopOnSignal
from rlvr_lightning.callbacks.watchdog import Watchdog
from rlvr_lightning.cli.accelerator_defaults import apply_device_defaults
from rlvr_lightning.cli.checkpoint_resume import describe_changes, read_resume_point, settings_changed
from rlvr_lightning.cli.config_logging import MLflowSaveConfig
from rlvr_lightning.cli.default_progress_bar import use_rollout_progress_bar
from rlvr_lightning.cli.error_lines import constructor_error_line, parse_error_line, user_error_behind
from rlvr_lightning.cli.input_checks import build_embedded_models, check_inputs
from rlvr_lightning.cli.mlflow_resume import reopen_checkpoint_run
from rlvr_lightning.cli.option_hints import files_setting, option_hint
from rlvr_lightning.cli.run_length import resolve_run_length
from rlvr_lightning.cli.run_naming import run_identity
from rlvr_lightning.console import verbose
from rlvr_lightning.data.datamodule import RolloutDataModule
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.pieces.loading import OPTION as IMPORTS
from rlvr_lightning.pieces.loading import load_piece_modules
from rlvr_lightning.planner.preflight import preflight
from rlvr_lightning.planner.settings import PlanSettings
from rlvr_lightning.rollout.settings import RolloutSettings
from rlvr_lightning.run_lock import hold_run_directory
from rlvr_lightning.slurm_requeue import requeued_checkpoint, slurm_job

NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$|^-(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def checkpoints_dir(cfg: Namespace) -> str:
    """Where the run's `ResumableCheckpoint` writes (its `dirpath`), from the parsed config."""
    for callback in cfg.trainer.get("callbacks") or []:
        if isinstance(callback, Namespace) and str(callback.get("class_path", "")).endswith(".ResumableCheckpoint"):
            return (callback.get("init_args") or Namespace()).get("dirpath") or "checkpoints"
    return "checkpoints"


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
        # The module makes its own optimizer and schedule (`model.optim`): Lightning's `--optimizer`/`--lr_scheduler`
        # would parse and then fail inside `fit`, so they are not options (the hints name `model.init_args.optim`).
        kwargs.setdefault("auto_configure_optimizers", False)
        super().__init__(RLVRModule, RolloutDataModule, *args, subclass_mode_model=True, **kwargs)

    def init_parser(self, **kwargs) -> LightningArgumentParser:
        # jsonargparse raises instead of printing its usage and a nested message: `parse_arguments` prints one line.
        kwargs.setdefault("exit_on_error", False)
        parser = super().init_parser(**kwargs)
        # Python 3.11's argparse reads `-1e-3` as an option ("expected one argument"); 3.13 reads it as the number.
        parser._negative_number_matcher = NEGATIVE_NUMBER
        # The algorithm is a class given by name (`--model GRPO`): `--help` lists its arguments only on request.
        parser.epilog = (
            "The algorithm's own arguments (pieces and their knobs, optim, compute, rewards, shapers, …): "
            "--model.help GRPO (or DAPO, DrGRPO, GSPO, REAL). Every option with its value: --print_config."
        )
        return parser

    def parse_arguments(self, parser, args) -> None:
        try:
            super().parse_arguments(parser, args)
            resolve_run_length(self.config[self.config.subcommand] if self.config.get("subcommand") else self.config)
        except ArgumentError as err:
            if verbose():  # -v: jsonargparse's whole account too
                print(str(err), file=sys.stderr)
            line = parse_error_line(err)
            files = files_setting(line, list(sys.argv[1:] if args is None else args))
            where = f" (set in {' and '.join(files)})" if files else ""
            print(f"error: {line}{where}{option_hint(line)}", file=sys.stderr)
            sys.exit(2)

    def _parse_ckpt_path(self) -> None:
        """The checkpoint read once, by the project, first (`checkpoint_resume`); its saved settings are not laid
        over this command line's, as Lightning's CLI does (`resume_changes` says which differ)."""
        cfg = self.config[self.config.subcommand] if self.config.get("subcommand") else None
        path = cfg.get("ckpt_path") if cfg is not None else None
        if cfg is not None and path is None:  # a requeued SLURM job: where its earlier start left off
            path = cfg.ckpt_path = requeued_checkpoint(checkpoints_dir(cfg))
            if path is not None:
                print(f"SLURM job {slurm_job()} was requeued: resuming from {path}", file=sys.stderr, flush=True)
        run_dir = Path(path).parent if path else None
        if run_dir is not None and run_dir.is_dir() and rank_zero_only.rank == 0:  # before anything reads or logs
            hold_run_directory(run_dir, "the run of checkpoint")
            checkpoint_record.tidy(run_dir)  # a save a kill interrupted, put right
        self.resume_point = read_resume_point(path) if path else None

    def resume_changes(self, cfg: Namespace) -> None:
        """The settings this command line gives that differ from the checkpoint's (device defaults resolved):
        printed, and recorded in the MLflow run with the resumed config; another algorithm is one line."""
        changes = settings_changed(self.resume_point, cfg.model, cfg.data.get("model_name_or_path"))
        if changes:
            print(f"resume: this command line changes {describe_changes(changes)}", file=sys.stderr, flush=True)
        if isinstance(self.save_config_callback, type) and issubclass(self.save_config_callback, MLflowSaveConfig):
            where = f"from {self.resume_point.path} (rollout batch {self.resume_point.rollout_batches})"
            said = f"{where}; settings changed: {describe_changes(changes) or 'none'}"
            self.save_config_kwargs = {**self.save_config_kwargs, "resume_changes": said}

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            f"--{IMPORTS}",
            type=list[str] | str | None,
            default=None,
            help="Modules to import before the configuration is read, e.g. your own pieces' (`--imports my_pieces`, "
            "`imports: [my_pieces]` in a config file); their directory must be on PYTHONPATH.",
        )
        parser.add_argument(
            "--rollout_batches",
            type=int | None,
            default=None,
            help="The run's length in rollout batches (training steps); sets trainer.max_steps, which counts optimizer "
            "steps: model.num_mini_batches × model.ppo_epochs of them per rollout batch.",
        )
        parser.add_class_arguments(RolloutSettings, "rollout")
        parser.add_class_arguments(PlanSettings, "plan")
        parser.add_class_arguments(Watchdog, "watchdog")
        parser.add_class_arguments(StopOnSignal, "stop")
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
        # After every constructor's own checks, before any weights, engine or process group: what the run reads from
        # outside (data, models, reward functions), then its memory plan; no MLflow run exists yet.
        if self.subcommand == "fit":
            check_inputs(self.config["fit"])
            preflight(self.config["fit"])
            build_embedded_models(self.config["fit"])  # a warm start to build: after the plan, before any MLflow run
        init = self.config_init[self.subcommand] if self.subcommand else self.config_init
        for name in ("watchdog", "stop"):  # every run is watched and stops on a signal (`--watchdog.*`, `--stop.*`)
            if init.get(name) is not None:
                self.trainer.callbacks.append(init[name])

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        self.resolve_device_defaults(cfg)
        if self.resume_point is not None:
            self.resume_changes(cfg)
        use_rollout_progress_bar(cfg.trainer)
        logger = cfg.trainer.logger
        if not (isinstance(logger, Namespace) and logger.class_path.endswith("MLFlowLogger")):
            return
        args = logger.init_args
        if self.resume_point is not None and not args.run_id:  # resume into the same MLflow run, if this store has it
            reopen_checkpoint_run(self.resume_point, args)
        name, tags = run_identity(cfg)
        args.run_name = args.run_name or name  # a name the user gives wins
        args.tags = {**(args.tags or {}), **tags, "model": cfg.data.model_name_or_path, "dataset": cfg.data.train_data}

    def resolve_device_defaults(self, cfg: Namespace) -> None:
        """The settings the user left to the device resolve into the config itself (`apply_device_defaults`),
        and are recorded with the params."""
        self.device_defaults = apply_device_defaults(cfg)
        if isinstance(self.save_config_callback, type) and issubclass(self.save_config_callback, MLflowSaveConfig):
            self.save_config_kwargs = {**self.save_config_kwargs, "device_defaults": self.device_defaults}
