"""Settings the user leaves unset follow the device (`rlvr_lightning.device_defaults`): on CPU exactly the values
every run had before (so CPU histories stay bit-identical), on CUDA the fast ones (bf16 engine, CUDA graphs,
bf16 compute with fp32 master weights, a memory share that leaves the update room); a value the user sets
always wins. `make train`, `make plan` and `make doctor` read them through the one function.

No GPU is needed: "CUDA" is the pure function called with a CUDA accelerator, or this machine's CUDA detection
reporting a bf16 GPU while nothing is built on it (the CLI stops after resolving its configuration)."""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import pytest
import torch

from rlvr_lightning.device_defaults import KEYS, Accelerator, detect_accelerator, resolve_device_defaults
from rlvr_lightning.training.engine_setup import trainer_compute_dtype
from tests.conftest import REPO
from tests.support.settings import resettle

CPU, CUDA = Accelerator("cpu"), Accelerator("cuda", bf16=True)
CONFIG = ["--config", str(REPO / "configs/base.yaml"), "--config", str(REPO / "configs/algo/grpo.yaml")]
# What every run was given before the defaults followed the device (written out: a changed CPU value must fail).
TODAYS = {"trainer.precision": "32-true", "model.compute.fsdp_param_dtype": "float32", "model.compute.packing": False,
          "model.rollout_correction.name": "none", "rollout.dtype": "float32", "rollout.enforce_eager": True, "rollout.gpu_memory_utilization": 0.3}  # fmt: skip
FAST = {"trainer.precision": "bf16-mixed", "model.compute.fsdp_param_dtype": "bfloat16", "model.compute.packing": True,
        "model.rollout_correction.name": "icepop", "rollout.dtype": "bfloat16", "rollout.enforce_eager": False, "rollout.gpu_memory_utilization": 0.3}  # fmt: skip
# A value for every setting that is neither device's default: the user's, which must win on both.
USERS = {"trainer.precision": "16-mixed", "model.compute.fsdp_param_dtype": "float32", "model.compute.packing": False,
         "model.rollout_correction.name": "tis-token", "rollout.dtype": "float16", "rollout.enforce_eager": True, "rollout.gpu_memory_utilization": 0.7}  # fmt: skip


@pytest.fixture
def cuda_machine(monkeypatch):
    """This machine's CUDA detection reports a bf16 GPU (nothing may be built on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)


# ---- the pure function ----------------------------------------------------------------------------------------
def test_on_cpu_every_default_is_todays():
    resolved = resolve_device_defaults(CPU, {})
    assert resolved.values == TODAYS and resolved.from_device == set(KEYS)
    assert resolved.values == resolve_device_defaults(Accelerator("mps"), {}).values  # any other accelerator too


def test_on_cuda_the_defaults_are_the_fast_ones():
    resolved = resolve_device_defaults(CUDA, {})
    assert resolved.values == FAST and resolved.from_device == set(KEYS)
    assert all(resolved.source(k) == "device default (cuda)" for k in KEYS)


@pytest.mark.parametrize("sleep_level, elsewhere, share", [(0, False, 0.3), (1, False, 0.5), (2, False, 0.5), (0, True, 0.9)])
def test_the_engines_gpu_share_leaves_the_update_room(sleep_level, elsewhere, share):
    """Awake through the update the engine keeps a small share; asleep during it, a larger one; on GPUs of its
    own, vLLM's default."""
    resolved = resolve_device_defaults(CUDA, {}, sleep_level=sleep_level, engine_elsewhere=elsewhere)
    assert resolved.values["rollout.gpu_memory_utilization"] == share
    assert resolve_device_defaults(CPU, {}, sleep_level=sleep_level, engine_elsewhere=elsewhere).values == TODAYS


def test_under_fsdp2_bf16_compute_is_applied_once():
    """FSDP2's MixedPrecisionPolicy computes in bf16 (fp32 masters and reduction): the trainer's precision is then
    not autocast on top; a half precision the user chooses keeps the FSDP2 parameters fp32 instead."""
    fsdp = resolve_device_defaults(CUDA, {}, fsdp=True).values
    assert (fsdp["model.compute.fsdp_param_dtype"], fsdp["trainer.precision"]) == ("bfloat16", "32-true")
    assert trainer_compute_dtype(fsdp["trainer.precision"], fsdp["model.compute.fsdp_param_dtype"]) == "bfloat16"
    autocast = resolve_device_defaults(CUDA, {"trainer.precision": "bf16-mixed"}, fsdp=True).values
    assert (autocast["model.compute.fsdp_param_dtype"], autocast["trainer.precision"]) == ("float32", "bf16-mixed")
    plain = resolve_device_defaults(CUDA, {}).values  # no FSDP2: autocast is the one place
    assert trainer_compute_dtype(plain["trainer.precision"], None) == "bfloat16"


def test_a_cuda_card_without_bf16_gets_an_fp16_engine_and_an_fp32_trainer():
    resolved = resolve_device_defaults(Accelerator("cuda", bf16=False), {}, fsdp=True).values
    assert (resolved["rollout.dtype"], resolved["trainer.precision"], resolved["model.compute.fsdp_param_dtype"]) == (
        "float16", "32-true", "float32")  # fmt: skip


@pytest.mark.parametrize("accelerator", [CPU, CUDA], ids=["cpu", "cuda"])
@pytest.mark.parametrize("fsdp", [False, True])
def test_what_the_user_sets_wins(accelerator, fsdp):
    resolved = resolve_device_defaults(accelerator, USERS, fsdp=fsdp, sleep_level=1)
    assert resolved.values == USERS and not resolved.from_device
    assert all(resolved.source(k) == "your config" for k in KEYS)
    one = resolve_device_defaults(accelerator, {"rollout.dtype": "auto"})  # one set, the rest the device's
    assert one.values["rollout.dtype"] == "auto" and one.from_device == set(KEYS) - {"rollout.dtype"}


def test_an_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="not a device-defaulted setting: rollout.dtypo"):
        resolve_device_defaults(CPU, {"rollout.dtypo": "float32"})


def test_the_accelerator_flag_selects_the_defaults(monkeypatch, cuda_machine):
    assert detect_accelerator("auto") == CUDA and detect_accelerator("gpu") == CUDA
    assert detect_accelerator("cpu") == CPU  # a CPU run on a GPU machine keeps the CPU's defaults
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert detect_accelerator("auto") == CPU


# ---- through `make train`'s command line ---------------------------------------------------------------------
def resolved_cli(*overrides: str):
    """`make train`'s CLI up to its resolved configuration: nothing is instantiated."""
    from rlvr_lightning.cli.rlvr_cli import RLVRCLI

    class ResolveOnly(RLVRCLI):
        def instantiate_classes(self) -> None: ...
        def after_instantiate_classes(self) -> None: ...

    return ResolveOnly(args=[*CONFIG, *overrides], run=False)


def recorded_params(cli) -> dict:
    """The params the CLI's MLflow callback records, from the config and the module it builds."""
    from rlvr_lightning.cli.config_logging import MLflowSaveConfig, logged_params

    callback = cli.save_config_callback(cli.parser, cli.config, **cli.save_config_kwargs)
    assert isinstance(callback, MLflowSaveConfig) and callback.device_defaults is cli.device_defaults
    model = cli.config.model
    module_path, _, name = model.class_path.rpartition(".")
    module = getattr(importlib.import_module(module_path), name)(**model.init_args.as_dict())
    return logged_params(cli.config.as_dict(), module, callback.device_defaults)


@pytest.fixture
def cli_argv(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["rlvr_lightning"])
    monkeypatch.chdir(tmp_path)


def test_make_train_on_cuda_resolves_prints_and_records_the_fast_defaults(cli_argv, cuda_machine, capsys):
    cli = resolved_cli()
    cfg = cli.config
    values = (cfg.trainer.precision, cfg["model.init_args.compute.fsdp_param_dtype"], cfg.rollout.dtype, cfg.rollout.enforce_eager,
              cfg.rollout.gpu_memory_utilization)  # fmt: skip
    assert values == ("bf16-mixed", "bfloat16", "bfloat16", False, 0.3)
    assert cfg.model.init_args.compute.packing is True
    out = capsys.readouterr().out
    assert "settings that follow the device (cuda, bf16):" in out
    assert out.count("from: device default (cuda)") == len(cli.device_defaults.keys)
    assert "rollout.dtype                    bfloat16    from: device default (cuda)" in out
    params = recorded_params(cli)
    assert (params["trainer.precision"], params["rollout.dtype"], params["model.init_args.compute.fsdp_param_dtype"]) == (
        "bf16-mixed", "bfloat16", "bfloat16")  # fmt: skip
    assert params["rollout.enforce_eager"] is False and params["rollout.gpu_memory_utilization"] == 0.3
    assert params["device_defaults.accelerator"] == "cuda, bf16"
    assert params["device_defaults.trainer.precision"] == "device default (cuda)"


def test_make_train_on_cuda_keeps_what_the_user_set(cli_argv, cuda_machine, capsys):
    cli = resolved_cli("--trainer.precision", "32-true", "--rollout.dtype", "float32", "--rollout.enforce_eager", "true",
                       "--rollout.sleep_level", "1")  # fmt: skip
    cfg = cli.config
    assert (cfg.trainer.precision, cfg.rollout.dtype, cfg.rollout.enforce_eager) == ("32-true", "float32", True)
    assert cfg.rollout.gpu_memory_utilization == 0.5 and cfg["model.init_args.compute.fsdp_param_dtype"] == "bfloat16"
    out = capsys.readouterr().out
    assert "trainer.precision                32-true     from: your config" in out
    params = recorded_params(cli)
    assert params["device_defaults.rollout.dtype"] == "your config"
    assert params["device_defaults.rollout.gpu_memory_utilization"] == "device default (cuda)"


def test_make_train_on_cpu_resolves_todays_values(cli_argv, capsys):
    cli = resolved_cli()
    cfg = cli.config
    values = {"trainer.precision": cfg.trainer.precision, "model.compute.fsdp_param_dtype": cfg["model.init_args.compute.fsdp_param_dtype"],
              "rollout.dtype": cfg.rollout.dtype, "rollout.enforce_eager": cfg.rollout.enforce_eager,
              "rollout.gpu_memory_utilization": cfg.rollout.gpu_memory_utilization}  # fmt: skip
    assert values == {k: v for k, v in TODAYS.items() if k in values}
    assert cfg.model.init_args.compute.packing is False
    assert "from: device default (cpu)" in capsys.readouterr().out
    assert recorded_params(cli)["device_defaults.accelerator"] == "cpu"


def test_a_cpu_run_on_a_gpu_machine_keeps_the_cpus_values(cli_argv, cuda_machine):
    cfg = resolved_cli("--trainer.accelerator", "cpu").config
    assert (cfg.trainer.precision, cfg.rollout.dtype, cfg.rollout.enforce_eager) == ("32-true", "float32", True)


def test_settings_built_in_python_follow_this_machine(cuda_machine):
    from rlvr_lightning.algos import GRPO
    from rlvr_lightning.rollout.settings import RolloutSettings

    rollout = RolloutSettings(sleep_level=1)
    assert (rollout.dtype, rollout.enforce_eager, rollout.gpu_memory_utilization) == ("bfloat16", False, 0.5)
    assert RolloutSettings(dtype="float32").dtype == "float32"
    assert GRPO().settings.fsdp_param_dtype() == "bfloat16"


def test_settings_built_in_python_on_cpu_are_todays():
    from rlvr_lightning.algos import GRPO
    from rlvr_lightning.rollout.settings import RolloutSettings

    rollout = RolloutSettings()
    assert (rollout.dtype, rollout.enforce_eager, rollout.gpu_memory_utilization) == ("float32", True, 0.3)
    assert GRPO().settings.fsdp_param_dtype() == "float32"


def test_a_module_built_in_python_packs_as_the_device_it_is_on_does(tiny_policy_dir, cuda_machine):
    """`packing` None resolves when the update is planned, from the module's own device (not this machine's:
    a CPU run on a GPU machine stays padded)."""
    from rlvr_lightning.algos import GRPO
    from tests.support.update_harness import attach

    module = attach(GRPO, tiny_policy_dir)
    assert module.settings.compute.packing is None and module.device.type == "cpu"
    assert module.rlvr_step.layout.packing is False
    on_gpu = attach(GRPO, tiny_policy_dir)
    on_gpu._device = torch.device("cuda", 0)  # where the trainer places it before fit start builds the step (nothing moves)
    assert on_gpu.rlvr_step.layout.packing is True
    resettle(on_gpu, packing=False)
    assert on_gpu.rlvr_step.layout.packing is False


# ---- `make plan` and `make doctor` ---------------------------------------------------------------------------
def test_make_plan_plans_the_defaults_of_the_hardware_it_plans_for(cli_argv):
    from rlvr_lightning.plan import parse
    from rlvr_lightning.planner.hardware import hardware
    from rlvr_lightning.planner.report import as_dict, as_text
    from rlvr_lightning.planner.run_spec import run_spec

    cfg, _ = parse([*CONFIG, "--hardware", "h100"])
    spec = run_spec(cfg, hardware("h100"))
    assert (spec.precision, spec.fsdp_param_dtype, spec.engine_dtype, spec.gpu_memory_utilization) == (
        "bf16-mixed", "bfloat16", "bfloat16", 0.3)  # fmt: skip
    assert spec.device_defaults.values == resolve_device_defaults(CUDA, {}).values
    fsdp = run_spec(parse([*CONFIG, "--hardware", "h100", "--config", str(REPO / "configs/strategy/fsdp.yaml"),
                           "--rollout.sleep_level", "1"])[0], hardware("h100"))  # fmt: skip
    assert (fsdp.precision, fsdp.fsdp_param_dtype, fsdp.gpu_memory_utilization) == ("32-true", "bfloat16", 0.5)
    cpu = run_spec(parse([*CONFIG, "--hardware", "cpu"])[0], hardware("cpu"))
    assert (cpu.precision, cpu.fsdp_param_dtype, cpu.engine_dtype) == ("32-true", "float32", "float32")
    assert spec.packing and not cpu.packing  # micro-batches as the run on that hardware lays them out

    from rlvr_lightning.planner.planner import Plan, StepTime, engine_share, measure_trainer, trainer_setup

    trainer = measure_trainer(trainer_setup(spec), with_flops=False)
    plan = Plan(spec, trainer, engine_share(spec, trainer.parameters), 0.0, 0.0, StepTime({}, []))
    assert "rollout.dtype                    bfloat16    from: device default (cuda)" in as_text(plan)
    assert "rows (packed: real tokens only)" in as_text(plan) and as_dict(plan)["layout"]["packed"]
    assert as_dict(plan)["device_defaults"]["trainer.precision"] == {"value": "bf16-mixed", "from": "device default (cuda)"}


def test_the_doctor_reads_the_defaults_and_the_engine_dtype_as_the_run_does(cli_argv, cuda_machine, tmp_path):
    """On CUDA the doctor checks the run's bf16 path; `rollout.dtype auto` is what vLLM makes of the doctor's
    checkpoint, as in the run (`engine_compute_dtype`): an fp32 checkpoint computes in bf16 on a GPU."""
    from rlvr_lightning.doctor.checks import Setup
    from rlvr_lightning.plan import parse
    from rlvr_lightning.training.engine_setup import engine_compute_dtype

    setup = Setup(parse(CONFIG)[0], tmp_path)
    assert setup.device.type == "cuda" and (setup.trainer_dtype, setup.engine_dtype) == ("bfloat16", "bfloat16")
    assert setup.device_defaults.values == resolve_device_defaults(CUDA, {}).values
    auto = Setup(parse([*CONFIG, "--trainer.precision", "32-true", "--rollout.dtype", "auto"])[0], tmp_path)
    run = engine_compute_dtype(auto.rollout, SimpleNamespace(dtype="float32"), "float32", CUDA)
    assert auto.trainer_dtype == "float32" and auto.engine_dtype == run == "bfloat16"
    cpu = Setup(parse([*CONFIG, "--trainer.accelerator", "cpu", "--rollout.dtype", "auto"])[0], tmp_path)
    assert (cpu.device.type, cpu.trainer_dtype, cpu.engine_dtype) == ("cpu", "float32", "float32")


# ---- the rollout correction on CUDA ---------------------------------------------------------------------------
def test_on_cuda_a_masked_correction_is_on_where_it_applies(cli_argv, cuda_machine, capsys):
    """A bf16 engine beside the trainer drifts: IcePop's token mask is on by default, printed and recorded; not for
    a group-level loss (REAL), a loss with one term per sequence (GSPO), truncated sampling, or the engine's own
    log-probs as θ_old (each of which refuses a token correction), nor for the REAL paper's baselines, whose preset
    keeps the paper's objective; what the user sets wins."""
    cli = resolved_cli()
    assert cli.config.model.init_args.rollout_correction.name == "icepop"
    assert "model.rollout_correction.name    icepop      from: device default (cuda)" in capsys.readouterr().out
    recorded = recorded_params(cli)
    assert recorded["model.init_args.rollout_correction.name"] == "icepop"
    assert recorded["model.init_args.rollout_correction.knobs.is_mask_high"] == 5.0  # the device's piece's knobs
    for flags in (["--config", str(REPO / "configs/algo/real.yaml")], ["--model.init_args.policy_loss.name", "gspo"],
                  ["--config", str(REPO / "configs/algo/grpo-real-baseline.yaml")],  # the paper's objective, as REAL's
                  ["--rollout.top_p", "0.9"], ["--model.init_args.behaviour.logprobs", "rollout"]):  # fmt: skip
        assert resolved_cli(*flags).config.model.init_args.rollout_correction.name == "none", flags
    users = resolved_cli("--model.init_args.rollout_correction.name", "tis-token",
                         "--model.init_args.rollout_correction.knobs.tis_cap", "3.0")  # fmt: skip
    assert users.config.model.init_args.rollout_correction.name == "tis-token"
    assert recorded_params(users)["model.init_args.rollout_correction.knobs.tis_cap"] == 3.0


def test_a_module_built_in_python_resolves_the_correction_on_this_machines_device(cuda_machine):
    from rlvr_lightning.algos import GRPO, REAL

    assert GRPO().hparams.rollout_correction["name"] == "icepop" and REAL().hparams.rollout_correction["name"] == "none"
    assert GRPO(rollout_correction="none").hparams.rollout_correction == {"name": "none", "knobs": {}}
    # A choice that gives knobs but leaves the name to the device: the device's correction runs with them.
    tight = GRPO(rollout_correction={"name": None, "knobs": {"is_mask_high": 2.0}})
    assert tight.hparams.rollout_correction == {"name": "icepop", "knobs": {"is_mask_low": 0.5, "is_mask_high": 2.0}}


def test_on_cpu_no_correction_is_chosen_for_anyone():
    from rlvr_lightning.algos import GRPO

    assert GRPO().hparams.rollout_correction == {"name": "none", "knobs": {}}
    assert resolve_device_defaults(CPU, {}, correction_fits=True).values["model.rollout_correction.name"] == "none"
    assert resolve_device_defaults(CUDA, {}, correction_fits=False).values["model.rollout_correction.name"] == "none"
