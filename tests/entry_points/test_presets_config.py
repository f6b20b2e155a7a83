"""Every preset in `configs/algo/*.yaml`, on top of `configs/base.yaml` exactly as `make train ALGO=<name>`
composes them, parses and instantiates its algorithm module, its callbacks, its DataModule, its trainer and
its logger, without training: no tokenizer, model or warm start is loaded, no engine or verifier worker is
started, and MLflow is never contacted (a config test in the manner of LitGPT's and torchtune's).

Expected values are read from the YAML files themselves (PyYAML, independent of jsonargparse), so a new
preset is covered by dropping it into `configs/algo/`. The CLI is `RLVRCLI(run=False)`: the same parser as
`fit` without the subcommand level (and hence without `--ckpt_path`). After the imports each preset takes
~0.2 s.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
from pathlib import Path

import pytest
import yaml

# Imported here, at collection, as a real CLI process imports it before anything is printed: Lightning gives its
# logger a handler bound to the sys.stderr of the moment it is first imported, which inside a test is that
# test's capture (closed by the next test).
from rlvr_lightning.cli import main
from tests.conftest import REPO
from tests.support.rewards import PARITY

BASE = REPO / "configs" / "base.yaml"
PRESETS = sorted((REPO / "configs" / "algo").glob("*.yaml"))
# The trainer settings that a Trainer exposes under the same name (the others are checked in the parsed config).
TRAINER_ATTRS = (
    "max_steps",
    "max_epochs",
    "log_every_n_steps",
    "num_sanity_val_steps",
    "limit_val_batches",
    "precision",
)
# Presets whose name promises an advantage shaper: the preset must configure it (`model.init_args.shapers.<key>`).
SHAPER_BY_PREFIX = {"thr": "thr", "oar": "oar"}


class _NoMLflow:
    """Stands in for mlflow's `MlflowClient`. MLFlowLogger builds one in its constructor, and the real one opens
    the tracking store (creating and migrating a sqlite database: seconds). Any use beyond that fails the test."""


    def __init__(self, tracking_uri=None, *args, **kwargs) -> None:
        self.tracking_uri = tracking_uri

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AssertionError(f"MLflow was used while instantiating a config: MlflowClient.{name}")


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No MLflow, and a scratch working directory: relative outputs (exports/, checkpoints/, mlruns/) would land
    there, and the tests assert that nothing does."""
    monkeypatch.setattr("mlflow.tracking.MlflowClient", _NoMLflow)
    monkeypatch.setattr(sys, "argv", ["rlvr_lightning"])  # pytest's own flags are not the CLI's
    monkeypatch.setenv("RLVR_CACHE_DIR", str(tmp_path / "cache"))
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    return workdir


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def make_cli(name: str, *configs: Path, overrides: tuple[str, ...] = ()):
    """`make train ALGO=<name> ARGS='<overrides>'`, less the `fit` subcommand, with MLflow pointed at the
    scratch directory (the client is a stand-in anyway). The run's name is the CLI's own (`name` is the
    preset's, for the reader)."""
    from rlvr_lightning.cli.rlvr_cli import RLVRCLI

    args = [a for c in (BASE, *configs) for a in ("--config", str(c))]
    args += [
        "--trainer.logger.init_args.tracking_uri", f"sqlite:///{Path.cwd()}/mlflow.db",
        "--trainer.logger.init_args.artifact_location", str(Path.cwd() / "artifacts"),
        *overrides,
    ]  # fmt: skip
    return RLVRCLI(args=args, run=False)


def import_class(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def same(actual, expected) -> bool:
    """Equality across YAML's spellings: PyYAML reads `1e-3` (no dot) as a string, jsonargparse as a float;
    paths come back as `Path`, lists may come back as tuples; a bool is never equal to a number; a section
    (`data.tool`) holds what the preset sets, and the defaults of what it leaves out, also as a settings group
    (`rollout.stream`)."""
    if isinstance(expected, dict) and dataclasses.is_dataclass(actual):
        actual = dataclasses.asdict(actual)
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(k in actual and same(actual[k], v) for k, v in expected.items())
    if isinstance(actual, Path):
        actual = str(actual)
    if isinstance(actual, tuple):
        actual = list(actual)
    if isinstance(expected, str) and isinstance(actual, float):
        try:
            expected = float(expected)
        except ValueError:
            return False
    if isinstance(actual, bool) or isinstance(expected, bool):
        return type(actual) is type(expected) and actual == expected
    return actual == expected


def merged(preset: dict) -> dict:
    """configs/base.yaml then the preset, as the CLI merges them: mappings key by key; `callbacks+` appends."""
    base = load(BASE)
    trainer = {k: v for k, v in base["trainer"].items() if k != "callbacks"}
    callbacks = list(base["trainer"].get("callbacks") or [])
    for key, value in (preset.get("trainer") or {}).items():
        if key == "callbacks+":
            callbacks += value if isinstance(value, list) else [value]
        elif key == "callbacks":
            callbacks = list(value or [])
        else:
            trainer[key] = value
    return {
        "seed_everything": preset.get("seed_everything", base.get("seed_everything")),
        "rollout_batches": preset.get("rollout_batches", base.get("rollout_batches")),
        "trainer": trainer,
        "callbacks": callbacks,
        "data": {**(base.get("data") or {}), **(preset.get("data") or {})},
        "rollout": {**(base.get("rollout") or {}), **(preset.get("rollout") or {})},
        "model": preset["model"],
    }


def hparam_mismatches(module, init_args: dict) -> list[str]:
    """Each argument the preset sets, as the module runs with it; a settings group (`optim: {lr: …}`) option by
    option and a piece's choice (`policy_loss: {name: …, knobs: {…}}`) knob by knob, the ones the preset leaves at
    their defaults aside."""
    out = []
    for key, want in (init_args or {}).items():
        have = module.hparams.get(key, KeyError)
        if have is KeyError:
            out.append(f"model.init_args.{key}: not a hyper-parameter of {type(module).__name__}")
        else:
            out += value_mismatches(f"model.init_args.{key}", want, have)
    return out


def value_mismatches(where: str, want, have) -> list[str]:
    if isinstance(want, dict) and isinstance(have, dict):
        return [m for k, v in want.items() for m in value_mismatches(f"{where}.{k}", v, have.get(k))]
    return [] if same(have, want) else [f"{where}: preset {want!r}, module {have!r}"]


def callback_mismatches(instances: list, specs: list[dict]) -> list[str]:
    """Each configured callback instantiated once, of exactly its class, with the configured init args; and no
    project callback that the config does not name."""
    out, remaining = [], list(instances)
    for spec in specs:
        cls = import_class(spec["class_path"])
        found = [c for c in remaining if type(c) is cls]
        if not found:
            out.append(f"{spec['class_path']}: not instantiated")
            continue
        remaining.remove(found[0])
        for key, want in (spec.get("init_args") or {}).items():
            if not hasattr(found[0], key):
                out.append(f"{cls.__name__}.{key}: configured, but the callback has no such attribute")
            elif not same(getattr(found[0], key), want):
                out.append(f"{cls.__name__}.{key}: config {want!r}, callback {getattr(found[0], key)!r}")
    from rlvr_lightning.callbacks.progress import RolloutProgressBar  # the CLI adds it (cli/default_progress_bar.py)
    from rlvr_lightning.callbacks.stopping import StopOnSignal  # the CLI adds it, from `--stop.*`
    from rlvr_lightning.callbacks.watchdog import Watchdog  # the CLI adds it, from `--watchdog.*`

    added_by_the_cli = (RolloutProgressBar, Watchdog, StopOnSignal)
    extra = [type(c).__qualname__ for c in remaining
             if type(c).__module__.startswith("rlvr_lightning.callbacks") and type(c) not in added_by_the_cli]  # fmt: skip
    if sum(type(c) is Watchdog for c in instances) != 1:
        out.append("the run is not watched by exactly one Watchdog")
    if sum(type(c) is StopOnSignal for c in instances) != 1:
        out.append("the run does not stop on a signal through exactly one StopOnSignal")
    if extra:
        out.append(f"callbacks not in the config: {extra}")
    return out


def parse_error(capsys, name: str, *configs: Path, overrides: tuple[str, ...] = ()) -> str:
    """The CLI's parse error: one `error: …` line on stderr (no usage), and exit status 2."""
    with pytest.raises(SystemExit) as exit_info:
        make_cli(name, *configs, overrides=overrides)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err[-40:]
    return err[0]


def preset_like(tmp_path: Path, source: str, edit) -> Path:
    """A copy of configs/algo/<source>.yaml with `edit` applied (never a file under configs/)."""
    cfg = load(REPO / "configs" / "algo" / f"{source}.yaml")
    edit(cfg)
    path = tmp_path / f"{source}_edited.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# ---- every preset ---------------------------------------------------------------------------------------


def test_presets_are_found_and_make_train_composes_base_then_preset():
    assert len(PRESETS) >= 12 and {"grpo", "thr", "oar-p"} <= {p.stem for p in PRESETS}
    recipe = (REPO / "Makefile").read_text()
    # make_cli mirrors these lines; if the composition changes, so must make_cli. The run's name is left to the CLI.
    assert "PRESET = $(if $(wildcard configs/algo/$(ALGO).yaml),configs/algo/$(ALGO).yaml,$(ALGO))" in recipe
    assert re.search(r"-m rlvr_lightning fit --config configs/base\.yaml --config \$\(PRESET\)\s*\\\s*\n", recipe), (
        "the `make train` recipe changed; update make_cli"
    )
    assert "run_name" not in recipe


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_preset_instantiates_without_training(preset, offline):
    from lightning.pytorch.callbacks import ProgressBar
    from lightning.pytorch.loggers import MLFlowLogger

    import rlvr_lightning.algos
    from rlvr_lightning.algos.base import RLVRModule
    from rlvr_lightning.cli.config_logging import MLflowSaveConfig
    from rlvr_lightning.data.datamodule import RolloutDataModule

    want = merged(load(preset))
    cli = make_cli(preset.stem, preset)

    # The algorithm: the class the preset names, one of the public algorithms, with the preset's hparams.
    cls = import_class(want["model"]["class_path"])
    assert type(cli.model) is cls and isinstance(cli.model, RLVRModule)
    assert cls.__name__ in rlvr_lightning.algos.__all__ and getattr(rlvr_lightning.algos, cls.__name__) is cls
    problems = hparam_mismatches(cli.model, want["model"].get("init_args"))
    assert not problems, "\n".join(problems)
    assert cli.model.policy is None and cli.model.ref_policy is None  # no model was built or loaded

    # The callbacks: base's, then the preset's `callbacks+`. THR and OAR presets have their shaper, built with the step.
    problems = callback_mismatches(cli.trainer.callbacks, want["callbacks"])
    assert not problems, "\n".join(problems)
    shapers = want["model"].get("init_args", {}).get("shapers") or {}
    for prefix, key in SHAPER_BY_PREFIX.items():
        assert (shapers.get(key) is not None) == preset.stem.startswith(prefix), (prefix, shapers)
        assert (getattr(cli.model.settings.shapers, key) is not None) == preset.stem.startswith(prefix), prefix
    assert sum(isinstance(c, MLflowSaveConfig) for c in cli.trainer.callbacks) == 1
    assert [type(c).__name__ for c in cli.trainer.callbacks if isinstance(c, ProgressBar)] == ["RolloutProgressBar"]

    # The data: every data setting on the DataModule; nothing set up (no tokenizer, records or engine).
    assert type(cli.datamodule) is RolloutDataModule
    dm = cli.datamodule
    for key, value in want["data"].items():
        assert same(dm.hparams[key], value), (key, value, dm.hparams[key])
    for key, value in want["rollout"].items():  # the `rollout:` section reaches the data module whole
        assert same(getattr(dm.rollout, key), value), (key, value, getattr(dm.rollout, key))
    assert dm.tokenizer is None and dm.policy_path is None and dm.train_records == [] and dm.val_records == []

    # The run's length: every preset trains base's 160 rollout batches, K optimizer steps each.
    h = cli.model.hparams
    assert want["rollout_batches"] == 160 and cli.trainer.max_steps == 160 * h.num_mini_batches * h.ppo_epochs
    # The trainer: base's settings with the preset's overrides.
    trainer_cfg = cli.config.trainer
    for key, value in want["trainer"].items():
        if key == "logger":
            continue
        assert same(trainer_cfg[key], value), (key, value, trainer_cfg[key])
        if key in TRAINER_ATTRS:
            assert same(getattr(cli.trainer, key), value), (key, value, getattr(cli.trainer, key))
    assert cli.config.seed_everything == want["seed_everything"]

    # The logger: MLflow, named and tagged after the preset and its pieces by the CLI, never contacted (see _NoMLflow).
    logger = cli.trainer.logger
    assert isinstance(logger, MLFlowLogger)
    assert cli.config.trainer.logger.init_args.run_name == preset.stem  # the preset's own pieces: its name alone
    h = cli.model.hparams
    pieces = {f"piece.{k}": h[k]["name"] for k in ("advantage_estimator", "policy_loss", "loss_agg", "rollout_correction", "proximal_policy")}
    pieces |= {"piece.kl_estimator": h.kl_estimator["name"]} if h.kl_coef > 0 else {}
    if h.advantage_estimator["name"] == "opd":  # the estimator distillation runs inside it is a piece of the run too
        pieces["piece.opd_reward"] = h.advantage_estimator["knobs"]["opd_reward"]
    # Its parts, read from the preset file: a shaper, a teacher, the tool (none of the presets adds a reward function).
    init_args = want["model"].get("init_args") or {}
    parts = [f"shaper={key}" for key in ("thr", "oar") if (init_args.get("shapers") or {}).get(key)]
    parts += ["tool=python"] if want["data"].get("tool") else []
    parts += [f"teacher={init_args['teacher']['model_name_or_path']}"] if init_args.get("teacher") else []
    assert logger.tags == {"algorithm": cls.__name__, "preset": preset.stem, **pieces,
                           "model": dm.hparams.model_name_or_path, "dataset": dm.hparams.train_data,
                           **({"parts": "+".join(parts)} if parts else {})}  # fmt: skip

    # Nothing written (no exports/, checkpoints/) but the lock beside the store that its creation takes (the real
    # client would create the store there).
    assert [p.name for p in offline.rglob("*") if p.is_file()] == ["mlflow.db.lock"]


def test_hparam_check_catches_a_value_that_differs_from_the_preset():
    """The comparison can fail: an override of one preset key is reported, by name, and nothing else is."""
    preset = REPO / "configs" / "algo" / "grpo.yaml"
    init_args = load(preset)["model"]["init_args"]
    cli = make_cli("grpo", preset, overrides=("--model.init_args.policy_loss.knobs.clip_eps_high", "0.3"))
    assert hparam_mismatches(cli.model, init_args) == ["model.init_args.policy_loss.knobs.clip_eps_high: preset 0.2, module 0.3"]
    cli = make_cli("grpo", preset, overrides=("--model.init_args.policy_loss.name", "gspo"))
    assert hparam_mismatches(cli.model, init_args) == ["model.init_args.policy_loss.name: preset 'ppo-clip', module 'gspo'"]


def test_callback_check_catches_a_changed_missing_or_extra_callback():
    grpo = REPO / "configs" / "algo" / "grpo.yaml"
    specs = merged(load(grpo))["callbacks"]
    callbacks = make_cli("grpo", grpo).trainer.callbacks
    assert callback_mismatches(callbacks, specs) == []
    evaluation = {**specs[0], "init_args": {**specs[0]["init_args"], "every_n_steps": 41}}
    assert callback_mismatches(callbacks, [evaluation, *specs[1:]]) == ["Evaluation.every_n_steps: config 41, callback 40"]
    export = {"class_path": "rlvr_lightning.callbacks.export.HFExport"}
    assert callback_mismatches(callbacks, [*specs, export]) == ["rlvr_lightning.callbacks.export.HFExport: not instantiated"]
    last = specs[-1]["class_path"].rsplit(".", 1)[1]
    assert callback_mismatches(callbacks, specs[:-1]) == [f"callbacks not in the config: ['{last}']"]


@pytest.mark.parametrize(
    ("old", "new"),
    [("rlvr_lightning.callbacks.attribution.THRAttribution", "--model.init_args.shapers.thr.<option>"),
     ("rlvr_lightning.callbacks.attribution.OARAttribution", "--model.init_args.shapers.oar.<option>"),
     ("rlvr_lightning.callbacks.reward.RewardVerifier", "--model.init_args.rewards.verifier.<option>")],
    ids=["thr", "oar", "verifier"],
)  # fmt: skip
def test_a_stage_given_as_a_callback_is_one_line_naming_its_section(old, new, tmp_path, capsys):
    """THR, OAR and the reward verifier were callbacks; now they are the module's sections."""
    args = [
        "fit", "--config", str(BASE), "--config", str(REPO / "configs" / "algo" / "grpo.yaml"),
        f"--trainer.callbacks+={old}", "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp_path}/mlflow.db",
        "--data.model_name_or_path", str(tmp_path / "no_model"),
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and new in err[0], err[-20:]


# ---- the run's name and tags: the preset, and the pieces it changes --------------------------------------


@pytest.mark.parametrize(
    "preset, overrides, name, changed",
    [
        ("grpo", ("--model.init_args.policy_loss.name", "gspo", "--model.init_args.loss_agg.name", "token-mean"),
         "grpo+policy_loss=gspo+loss_agg=token-mean", "policy_loss=gspo+loss_agg=token-mean"),
        ("grpo", ("--model.init_args.kl_estimator.name", "k1"), "grpo+kl_estimator=k1", "kl_estimator=k1"),  # kl_coef 0.001
        ("gspo", ("--model.init_args.kl_estimator.name", "k1"), "gspo", None),  # no KL term: the estimator is unused
        ("grpo", ("--model.init_args.policy_loss.name", "rlvr_lightning.pieces.token_losses.ppo_clip"), "grpo", None),
        ("dr-grpo", ("--model.init_args.policy_loss.knobs.clip_eps_high", "0.28"), "dr-grpo", None),  # a knob is not a piece
        # grpo.yaml names its policy loss (ppo-clip), which a class switch keeps, as it keeps the preset's K: GSPO's
        # loss is chosen with the class.
        ("grpo", ("--model", "GSPO", "--model.init_args.policy_loss.name", "gspo"), "grpo+model=GSPO+policy_loss=gspo",
         "model=GSPO+policy_loss=gspo"),
    ],
    ids=["two-pieces", "kl-estimator-with-kl", "kl-estimator-without-kl", "same-piece-by-path", "knob", "class"],
)  # fmt: skip
def test_a_run_is_named_and_tagged_after_the_pieces_it_changes(preset, overrides, name, changed):
    cli = make_cli(preset, REPO / "configs" / "algo" / f"{preset}.yaml", overrides=overrides)
    tags = cli.trainer.logger.tags
    assert cli.config.trainer.logger.init_args.run_name == name
    assert tags.get("changes") == changed and tags["preset"] == preset
    by_path = {"rlvr_lightning.pieces.token_losses.ppo_clip": "ppo-clip"}  # a tag names the piece, however given
    for key in ("advantage_estimator", "policy_loss", "loss_agg", "rollout_correction"):
        given = cli.model.hparams[key]["name"]
        assert tags[f"piece.{key}"] == by_path.get(given, given)


@pytest.mark.parametrize(
    "preset, overrides, name, parts",
    [
        ("grpo", ("--model.init_args.rewards.functions", "[{function: tests.support.rewards.brevity, weight: 0.1}]"),
         "grpo+reward=brevity", "reward=brevity"),
        ("grpo", ("--model.init_args.rewards.correctness", PARITY), "grpo+correctness=parity", "correctness=parity"),
        ("grpo", ("--data.environment", "tests.environments.test_episodes.Nudge"), "grpo+env=Nudge", "env=Nudge"),
        ("grpo", ("--data.tool.max_calls", "2"), "grpo+tool=python", "tool=python"),
        ("grpo-tir", (), "grpo-tir", "tool=python"),  # its preset's tool: not a change, still a part
        ("gspo-token", ("--model.init_args.shapers.thr.p", "-0.2"), "gspo-token+shaper=thr", "shaper=thr"),
        ("thr", ("--model.init_args.shapers", "{thr: null}"), "thr+shaper=none", None),
        ("grpo-opd", ("--model.init_args.teacher.model_name_or_path", "embedded"), "grpo-opd+teacher=embedded",
         "teacher=embedded"),
        ("grpo", ("--model.init_args.advantage_estimator.name", "opd", "--model.init_args.teacher.model_name_or_path",
                  "embedded"), "grpo+advantage_estimator=opd+opd_reward=none+teacher=embedded", "teacher=embedded"),
    ],
    ids=["reward", "correctness", "environment", "tool", "tool-of-the-preset", "shaper", "shaper-off", "teacher",
         "distillation-added"],
)  # fmt: skip
def test_a_run_is_named_and_tagged_after_the_parts_it_adds(preset, overrides, name, parts):
    """A reward function, a source of correctness, an environment, the tool, an advantage shaper or a teacher the
    preset has not joins the run's name; every part the run has is its `parts` tag."""
    cli = make_cli(preset, REPO / "configs" / "algo" / f"{preset}.yaml", overrides=overrides)
    tags = cli.trainer.logger.tags
    assert cli.config.trainer.logger.init_args.run_name == name
    assert tags.get("parts") == parts and tags.get("changes") == (name.partition("+")[2] or None)


def test_a_name_the_user_gives_wins_and_the_tags_still_name_the_pieces():
    grpo = REPO / "configs" / "algo" / "grpo.yaml"
    cli = make_cli("grpo", grpo, overrides=("--model.init_args.policy_loss.name", "cispo",
                                            "--trainer.logger.init_args.run_name", "my-run"))  # fmt: skip
    assert cli.config.trainer.logger.init_args.run_name == "my-run"
    assert cli.trainer.logger.tags["changes"] == "policy_loss=cispo"
    assert cli.trainer.logger.tags["piece.policy_loss"] == "cispo"


def test_a_preset_file_of_ones_own_names_the_run(tmp_path):
    """`make train ALGO=path/to/mine.yaml`: the file's name is the preset's, its pieces the reference."""
    mine = preset_like(tmp_path, "gspo", lambda c: c["model"]["init_args"]["policy_loss"].update(name="gspo-token"))
    cli = make_cli("mine", mine)
    assert cli.config.trainer.logger.init_args.run_name == "gspo_edited"
    assert cli.trainer.logger.tags["preset"] == "gspo_edited" and "changes" not in cli.trainer.logger.tags
    cli = make_cli("mine", mine, overrides=("--model.init_args.policy_loss.name", "gspo"))
    assert cli.config.trainer.logger.init_args.run_name == "gspo_edited+policy_loss=gspo"


# ---- bad configs fail before anything is built ----------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    ["bad-loss-agg-flag", "bad-engine-flag", "unknown-flag", "bad-type", "misspelt-preset-key", "unknown-algorithm",
     "flat-knob-in-preset", "piece-args-in-preset", "bare-piece-name-in-preset", "bare-piece-name-flag"],
)  # fmt: skip
def test_invalid_preset_fails_at_parse_time_naming_the_key(case, capsys, tmp_path):
    grpo = REPO / "configs" / "algo" / "grpo.yaml"
    if case == "bad-loss-agg-flag":
        err = parse_error(capsys, "grpo", grpo, overrides=("--model.init_args.loss_agg.name", "bogus"))
        assert err.startswith("error: model.loss_agg='bogus'; registered: seq-mean-token-mean, "), err
    elif case == "bad-engine-flag":
        err = parse_error(capsys, "grpo", grpo, overrides=("--rollout.engine", "sglang"))
        assert err == "error: rollout.engine: Expected a typing.Literal['vllm', 'vllm-server', 'hf']. Got value: sglang"
    elif case == "unknown-flag":
        err = parse_error(capsys, "grpo", grpo, overrides=("--model.init_args.not_a_param", "1"))
        assert err == "error: model: Option 'not_a_param' is not accepted; every option with its value: --print_config", err
    elif case == "bad-type":
        err = parse_error(capsys, "grpo", grpo, overrides=("--model.init_args.optim.lr", "fast"))
        assert err == "error: model.optim.lr: Expected a <class 'float'>. Got value: fast", err
    elif case == "misspelt-preset-key":
        path = preset_like(tmp_path, "grpo", lambda c: c["model"]["init_args"].update(kl_cof=0.3))
        err = parse_error(capsys, "typo", path)
        assert err == f"error: model: Option 'kl_cof' is not accepted (set in {path}); did you mean model.init_args.kl_coef?", err
    elif case == "flat-knob-in-preset":  # the old spelling of a knob: one line naming its section
        path = preset_like(tmp_path, "grpo", lambda c: c["model"]["init_args"].update(clip_eps_high=0.28))
        err = parse_error(capsys, "old", path)
        assert err == (f"error: model: Option 'clip_eps_high' is not accepted (set in {path}); clip_eps_high is a knob of "
                       "a piece, set in its section: --model.init_args.policy_loss.knobs.clip_eps_high"), err  # fmt: skip
    elif case == "piece-args-in-preset":
        path = preset_like(tmp_path, "grpo", lambda c: c["model"]["init_args"].update(piece_args={"pass_at_k": 2}))
        err = parse_error(capsys, "old", path)
        assert err.startswith("error: model: Option 'piece_args.pass_at_k' is not accepted; a piece's knobs are set in "
                              "its own section: --model.init_args.<kind>.knobs.<knob>"), err  # fmt: skip
    elif case == "bare-piece-name-in-preset":
        path = preset_like(tmp_path, "grpo", lambda c: c["model"]["init_args"].update(policy_loss="gspo"))
        err = parse_error(capsys, "old", path)
        assert err.endswith("; a piece is chosen by name: --model.init_args.policy_loss.name gspo"), err
    elif case == "bare-piece-name-flag":
        err = parse_error(capsys, "grpo", grpo, overrides=("--model.init_args.policy_loss", "gspo"))
        assert err.endswith("; a piece is chosen by name: --model.init_args.policy_loss.name gspo"), err
    else:
        path = preset_like(
            tmp_path, "grpo", lambda c: c["model"].update(class_path="rlvr_lightning.algos.grpo.NoSuchAlgo")
        )
        err = parse_error(capsys, "unknown", path)
        assert err == "error: model: module 'rlvr_lightning.algos.grpo' has no attribute 'NoSuchAlgo'", err


# A value of the right type that a constructor refuses: (preset, edit of a copy of it, the error's text).
CONSTRUCTOR_REJECTS = {
    "module": ("grpo", lambda c: c["model"]["init_args"].update(num_mini_batches=0), "model.num_mini_batches"),
    "rollout": ("grpo", lambda c: c.setdefault("rollout", {}).update(group_size=1), "rollout.group_size must be ≥ 2"),
    "shaper": ("thr", lambda c: c["model"]["init_args"]["shapers"]["thr"].update(p=2.0), "model.shapers.thr.p=2.0"),
}


@pytest.mark.parametrize("case", list(CONSTRUCTOR_REJECTS))
def test_value_a_constructor_rejects_fails_at_instantiation(case, tmp_path):
    """The constructors' own checks run when the preset is instantiated, before any training. jsonargparse
    re-raises the ConfigError of a class given by class_path (the algorithm, a callback) as a ValueError that
    quotes it; the DataModule's arrives as is."""
    from rlvr_lightning.errors import ConfigError

    source, edit, message = CONSTRUCTOR_REJECTS[case]
    with pytest.raises((ConfigError, ValueError), match=re.escape(message)):
        make_cli(source, preset_like(tmp_path, source, edit))


@pytest.mark.parametrize("case", list(CONSTRUCTOR_REJECTS))
def test_value_a_constructor_rejects_is_a_one_line_error_from_the_cli(case, tmp_path, capsys):
    source, edit, message = CONSTRUCTOR_REJECTS[case]
    args = [
        "fit", "--config", str(BASE), "--config", str(preset_like(tmp_path, source, edit)),
        "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp_path}/mlflow.db",
        "--data.model_name_or_path", str(tmp_path / "no_model"),  # should `fit` start after all: fail fast
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error:") and message in err and "Traceback" not in err


def test_a_plain_value_error_of_a_users_constructor_is_one_line_naming_where(tmp_path, capsys, monkeypatch):
    """A user's own algorithm (or piece check) that raises ValueError, not ConfigError: jsonargparse wraps it in its
    own error while instantiating; the CLI prints its message and where it was raised, no traceback."""
    (tmp_path / "strict_algo.py").write_text(
        "from rlvr_lightning.algos import GRPO\n\n\nclass Strict(GRPO):\n"
        "    def __init__(self, my_knob: float = 1.0, **kwargs):\n"
        "        if my_knob < 0:\n            raise ValueError(f'my_knob must be >= 0, got {my_knob}')\n"
        "        super().__init__(**kwargs)\n"
    )  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["fit", "--config", str(BASE), "--config", str(REPO / "configs" / "algo" / "grpo.yaml"),
            "--model", "strict_algo.Strict", "--model.init_args.my_knob", "-1",
            "--trainer.logger.init_args.tracking_uri", f"sqlite:///{tmp_path}/mlflow.db",
            "--data.model_name_or_path", str(tmp_path / "no_model")]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: my_knob must be >= 0, got -1.0 (ValueError at {tmp_path / 'strict_algo.py'}:7, in __init__)"], err


def test_hparams_and_logged_params_are_the_effective_values_class_defaults_included(tmp_path):
    """A preset that leaves the pieces and knobs to its class (GSPO without policy_loss, clip range or K;
    REAL without its loss or estimator): the module's hparams, the objective it trains with and the
    parameters MLflow records all name the class's defaults, not a base-class default."""
    from rlvr_lightning.cli.config_logging import logged_params
    from rlvr_lightning.pieces import advantage_estimators, loss_aggregators, policy_losses

    def without(*keys):
        return lambda cfg: [cfg["model"]["init_args"].pop(k, None) for k in keys]

    gspo = preset_like(tmp_path, "gspo", without("policy_loss", "num_mini_batches", "loss_agg"))
    real = preset_like(tmp_path, "real", without("policy_loss", "num_mini_batches"))
    for path, expected in (
        (gspo, {"policy_loss": {"name": "gspo", "knobs": {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4, "dual_clip_c": None}},
                "num_mini_batches": 4, "advantage_estimator": {"name": "grpo", "knobs": {}},
                "loss_agg": {"name": "seq-mean-token-mean", "knobs": {}}}),
        (real, {"policy_loss": {"name": "real-anchor", "knobs": {"tau": 0.5}}, "num_mini_batches": 4,
                "advantage_estimator": {"name": "none", "knobs": {}}}),
    ):  # fmt: skip
        cli = make_cli(path.stem, path)
        module, params = cli.model, logged_params(cli.config.as_dict(), cli.model)
        for key, value in expected.items():
            assert module.hparams[key] == value, (path.stem, key, module.hparams[key])
            flat = {f"{key}.name": value["name"], **{f"{key}.knobs.{k}": v for k, v in value["knobs"].items()}} \
                if isinstance(value, dict) else {key: value}  # fmt: skip
            for name, v in flat.items():
                assert same(params[f"model.init_args.{name}"], v), (path.stem, name, params[f"model.init_args.{name}"])
        objective = module.settings.pieces.objective
        assert objective.policy_loss.fn is policy_losses.get(expected["policy_loss"]["name"]).fn
        assert objective.aggregate.func is loss_aggregators.get(module.hparams.loss_agg["name"]).fn
        assert objective.loss.keywords == expected["policy_loss"]["knobs"]  # what the loss runs with
        assert advantage_estimators.selected(module.hparams).name == expected["advantage_estimator"]["name"]


def test_a_knob_flag_adds_to_a_presets_knobs_and_a_files_knobs_replace_them(tmp_path):
    """`--model.init_args.policy_loss.knobs.clip_eps_low 0.1` on DAPO keeps DAPO's clip-higher 0.28; a config file's
    `knobs:` (or a whole `--….knobs '{…}'`) replaces the preset's, the knobs it leaves out at the loss's defaults."""
    dapo = REPO / "configs" / "algo" / "dapo.yaml"
    assert load(dapo)["model"]["init_args"]["policy_loss"]["knobs"] == {"clip_eps_low": 0.2, "clip_eps_high": 0.28}
    mine = tmp_path / "low.yaml"
    mine.write_text("model:\n  init_args:\n    policy_loss:\n      knobs: {clip_eps_low: 0.1}\n")
    for how, configs, overrides, high in (
        ("flag", (dapo,), ("--model.init_args.policy_loss.knobs.clip_eps_low", "0.1"), 0.28),
        ("file", (dapo, mine), (), 0.2),
        ("whole-flag", (dapo,), ("--model.init_args.policy_loss.knobs", "{clip_eps_low: 0.1}"), 0.2),
    ):  # fmt: skip
        module = make_cli("dapo", *configs, overrides=overrides).model
        knobs = {"clip_eps_low": 0.1, "clip_eps_high": high, "dual_clip_c": None}
        assert module.hparams.policy_loss == {"name": "ppo-clip", "knobs": knobs}, how
        assert module.settings.pieces.objective.loss.keywords == knobs, how
