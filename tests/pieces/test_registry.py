"""The registries of algorithm pieces (`pieces.registry`): lookup by name or dotted path, parse-time errors that
list the registered names and name the registry a user registers with, and a user's own piece from outside the
package (the README's worked example, `docs/examples/my_pieces.py`) by its dotted path."""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import pytest
import torch

from rlvr_lightning.algos import GRPO
from rlvr_lightning.context import Collectives
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.pieces import KINDS, policy_losses
from rlvr_lightning.pieces.kinds import AdvantageInputs
from tests.conftest import REPO


def test_unknown_names_list_the_registered_ones():
    for registry in KINDS:
        with pytest.raises(ConfigError, match=re.escape(f"registered: {', '.join(registry.names())}")):
            registry.get("no-such-piece")
    with pytest.raises(ConfigError, match="cannot import it"):
        policy_losses.get("no_such_module.loss")
    with pytest.raises(ConfigError, match="is not a registered policy loss"):
        policy_losses.get("torch.nn.functional.mse_loss")


def test_the_errors_name_the_registry_a_user_registers_with():
    import rlvr_lightning.pieces as pieces

    for registry in KINDS:
        assert getattr(pieces, registry.registry_name) is registry
    with pytest.raises(ConfigError, match=r"decorate it with rlvr_lightning\.pieces\.policy_losses\.register"):
        policy_losses.get("torch.nn.functional.mse_loss")


def test_an_algorithm_resolves_every_piece_when_built():
    for kwargs in ({"advantage_estimator": "nope"}, {"rollout_correction": "nope"}, {"loss_agg": "nope"}):
        with pytest.raises(ConfigError, match="registered:"):
            GRPO(**kwargs)


def test_a_users_piece_by_dotted_path_with_knobs_is_what_the_module_trains_with(my_pieces):
    module = GRPO(advantage_estimator={"name": "my_pieces.rank_advantage", "knobs": {"rank_scale": 0.5}})
    rewards = torch.tensor([1.0, 0, 0, 1, 0.2, 0.2, 0.2, 0.2])
    rollout = SimpleNamespace(correct=rewards > 0.5, group_size=4, response_lengths=torch.ones(8, dtype=torch.long))
    got, _, stats = module.settings.pieces.advantages(AdvantageInputs(rewards, rollout.correct, rollout.group_size, Collectives().sum, rollout.response_lengths))
    torch.testing.assert_close(got, 0.5 * torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0]))
    assert stats == pytest.approx({"adv_mean": 0.0, "adv_std": float(got.std()), "adv_abs_max": 1 / 3, "adv_zero_frac": 0.5})
    assert module.hparams.advantage_estimator == {"name": "my_pieces.rank_advantage", "knobs": {"rank_scale": 0.5}}
    with pytest.raises(ConfigError, match=r"^model.advantage_estimator=rank does not read the knob 'rank_scal'; its knobs: rank_scale "):
        GRPO(advantage_estimator={"name": "my_pieces.rank_advantage", "knobs": {"rank_scal": 0.5}})


def test_the_cli_checks_piece_names_while_parsing(my_pieces, capsys, monkeypatch, tmp_path):
    from rlvr_lightning.cli.rlvr_cli import RLVRCLI

    monkeypatch.setattr(sys, "argv", ["rlvr_lightning"])
    monkeypatch.chdir(tmp_path)
    base = ["--config", str(REPO / "configs/base.yaml"), "--config", str(REPO / "configs/algo/grpo.yaml"),
            "--trainer.logger", "false", "--trainer.callbacks", "[]"]  # fmt: skip
    cli = RLVRCLI(args=[*base, "--model.init_args.advantage_estimator.name", "my_pieces.rank_advantage",
                        "--model.init_args.advantage_estimator.knobs.rank_scale", "0.5"], run=False)  # the README's command
    assert cli.model.hparams.advantage_estimator == {"name": "my_pieces.rank_advantage", "knobs": {"rank_scale": 0.5}}
    assert cli.model.settings.pieces.estimator.keywords == {"rank_scale": 0.5}
    with pytest.raises(SystemExit):
        RLVRCLI(args=[*base, "--model.init_args.policy_loss.name", "ppo"], run=False)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: model.policy_loss='ppo'; registered: ppo-clip, gspo-token, gspo, "), err
