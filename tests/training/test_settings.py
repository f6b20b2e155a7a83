"""The training module's settings: the flat algorithm arguments and the three checked groups, made once when
the module is built (`training/settings.py`), and what `make plan` and `make doctor` build from a parsed
configuration without a module."""

from __future__ import annotations

import pytest

from rlvr_lightning.algos import DAPO, GRPO, REAL
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rollout.settings import RolloutSettings
from rlvr_lightning.training.settings import BehaviourSettings, ComputeSettings, OptimSettings, StepSettings
from tests.support.cli import REPO


def test_each_group_checks_its_own_values_when_the_module_is_built():
    with pytest.raises(ConfigError, match="model.compute.micro_batch_size must be ≥ 1, got 0"):
        GRPO(compute=ComputeSettings(micro_batch_size=0))
    with pytest.raises(ConfigError, match="model.compute.logprob_chunk_tokens must be ≥ 0"):
        GRPO(compute=ComputeSettings(logprob_chunk_tokens=-1))
    with pytest.raises(ConfigError, match="model.optim.lr_schedule"):
        GRPO(optim=OptimSettings(lr_schedule="linear"))
    with pytest.raises(ConfigError, match="model.behaviour.logprobs"):
        GRPO(behaviour=BehaviourSettings(logprobs="engine"))
    with pytest.raises(ConfigError, match="model.num_mini_batches and model.ppo_epochs must be ≥ 1"):
        GRPO(num_mini_batches=0)
    with pytest.raises(ConfigError, match="rollout.sync.check_every must be ≥ 1"):
        RolloutSettings(sync={"check_every": 0})


def test_a_group_given_as_a_dict_is_the_same_settings_and_an_unknown_key_names_the_groups_fields():
    """A checkpoint's hyper-parameters hold the groups as plain dicts (flat MLflow params, plain pickles): a
    module built from them runs with the same settings."""
    module = DAPO(optim=OptimSettings(lr=3e-5, warmup_steps=2), compute=ComputeSettings(micro_batch_size=16))
    again = DAPO(**{k: v for k, v in module.hparams.items() if k != "lora"})
    assert module.hparams["optim"] == {"lr": 3e-5, "weight_decay": 0.0, "warmup_steps": 2, "lr_schedule": "constant",
                                       "max_grad_norm": 1.0, "fused": False}  # fmt: skip
    assert (again.settings.optim, again.settings.compute, again.settings.behaviour) == (
        module.settings.optim, module.settings.compute, module.settings.behaviour)  # fmt: skip
    assert again.settings.args["policy_loss"].knobs["clip_eps_high"] == 0.28
    assert again.settings.pieces.objective.loss.keywords == module.settings.pieces.objective.loss.keywords
    with pytest.raises(ConfigError, match="OptimSettings: .*'lrr'.*its settings are lr, weight_decay"):
        GRPO(optim={"lrr": 1e-3})


def test_the_groups_do_not_feed_the_pieces_knobs_and_two_pass_is_reals():
    """Only the flat algorithm arguments are the step's `args` (the pieces read their own choices' knobs);
    `two_pass` is REAL's argument."""
    settings = GRPO(optim=OptimSettings(lr=0.5)).settings
    assert "lr" not in settings.args and "optim" not in settings.args and "micro_batch_size" not in settings.args
    assert REAL(two_pass=True).settings.pieces.objective.two_pass
    with pytest.raises(TypeError, match="two_pass"):
        GRPO(two_pass=True)


def test_the_resolved_step_lays_out_the_update_and_picks_theta_olds_source():
    settings = GRPO(num_mini_batches=2, optim=OptimSettings(max_grad_norm=0.5),
                    compute=ComputeSettings(micro_batch_size=3, packing=False)).settings  # fmt: skip
    step = settings.resolve(RolloutSettings(group_size=4, max_response_length=8), batch_size=2, check=True)
    layout = step.layout
    assert (layout.num_mini_batches, layout.micro_batch_size, layout.max_grad_norm, layout.norm_const) == (2, 3, 0.5, 8.0)
    assert step.behaviour == "trainer" and not step.needs_reference and not step.whole_groups
    one = GRPO().settings.resolve(RolloutSettings(group_size=4), batch_size=2)
    assert one.behaviour == "update"  # one optimizer step: θ_old from the update's own forward
    with pytest.raises(ConfigError, match="data.batch_size=3 prompts must divide into model.num_mini_batches=2"):
        settings.resolve(RolloutSettings(group_size=4), batch_size=3, check=True)
    # A REAL step with micro-batches that split its groups is refused, naming the group's option.
    real = REAL(num_mini_batches=1, compute=ComputeSettings(micro_batch_size=3)).settings
    with pytest.raises(ConfigError, match="model.compute.micro_batch_size=3 would split groups"):
        real.resolve(RolloutSettings(group_size=4), batch_size=2, check=True)
    # Compiled layers beside the HF engine, which decodes with the same policy (a recompile per cache length).
    compiled = GRPO(compute=ComputeSettings(compile_layers=True)).settings
    compiled.resolve(RolloutSettings(group_size=4), batch_size=2, check=True)  # vLLM (the default): fine
    with pytest.raises(ConfigError, match="compile_layers with rollout.engine hf"):
        compiled.resolve(RolloutSettings(group_size=4, engine="hf"), batch_size=2, check=True)


def test_the_settings_of_a_parsed_configuration_are_the_modules():
    """`make plan` and `make doctor` read a configuration's step settings without building the module: the
    same as the module's own, subclass defaults and presets' groups included."""
    from rlvr_lightning.plan import parse

    configs = REPO / "configs"
    cfg, _ = parse(["--config", str(configs / "base.yaml"), "--config", str(configs / "algo" / "dapo.yaml"),
                    "--model.init_args.compute.micro_batch_size", "8"])  # fmt: skip
    settings = StepSettings.of_config(cfg.model)
    assert settings.optim.lr == 3e-5 and settings.compute.micro_batch_size == 8
    assert settings.args["policy_loss"].knobs["clip_eps_high"] == 0.28 and settings.optimizer_steps_per_rollout_batch == 4
    built = DAPO(**cfg.model.init_args.as_dict()).settings
    assert (built.optim, built.compute, built.behaviour, dict(built.args)) == (
        settings.optim, settings.compute, settings.behaviour, dict(settings.args))  # fmt: skip


def test_a_presets_k_takes_what_it_leaves_unset_from_its_class(tmp_path):
    """`make results` reads K from a preset's YAML alone (its budget is rollout batches × K): an argument the
    preset leaves unset is its class's own default (GSPO's K = 4), not the base class's 1."""
    from rlvr_lightning.results.grid import steps_per_rollout_batch

    preset = tmp_path / "my-gspo.yaml"
    preset.write_text("model:\n  class_path: rlvr_lightning.algos.gspo.GSPO\n  init_args:\n    ppo_epochs: 2\n")
    assert steps_per_rollout_batch(preset) == 8
    grpo = tmp_path / "my-grpo.yaml"
    grpo.write_text("model:\n  class_path: rlvr_lightning.algos.GRPO\n")
    assert steps_per_rollout_batch(grpo) == 1
    (tmp_path / "none.yaml").write_text("trainer: {}\n")
    with pytest.raises(ConfigError, match="names its algorithm"):
        steps_per_rollout_batch(tmp_path / "none.yaml")


def test_the_recorded_hyper_parameters_are_plain_values_a_weights_only_checkpoint_loads(tmp_path):
    """The CLI parses each piece into its choice (a dataclass) with the name a checked `str` subtype; a checkpoint's
    hyper-parameters must hold plain strings and dicts, or `torch.load(weights_only=True)` refuses the resumed
    run's checkpoint."""
    import torch

    from rlvr_lightning.pieces.choices import AdvantageEstimatorChoice, PolicyLossChoice
    from rlvr_lightning.pieces.kinds import AdvantageEstimatorName, PolicyLossName

    module = GRPO(advantage_estimator=AdvantageEstimatorChoice(AdvantageEstimatorName("rloo")),
                  policy_loss=PolicyLossChoice(PolicyLossName("ppo-clip"), {"clip_eps_high": 0.28}))  # fmt: skip
    recorded = module.hparams["advantage_estimator"]
    assert type(recorded) is dict and type(recorded["name"]) is str and recorded == {"name": "rloo", "knobs": {}}
    assert type(module.hparams["policy_loss"]["name"]) is str and module.settings.args["advantage_estimator"].name == "rloo"
    torch.save({"hyper_parameters": dict(module.hparams)}, tmp_path / "hparams.pt")
    assert torch.load(tmp_path / "hparams.pt", weights_only=True)["hyper_parameters"]["compute"]["micro_batch_size"] == 64
