"""The registries of algorithm pieces: lookup by name or dotted path, knob binding, parse-time errors
that list the registered names, a user's own piece from outside the package (the README's worked
example, `docs/examples/my_pieces.py`), and `python -m rlvr_lightning list`."""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import pytest
import torch

from rlvr_lightning.algos import DAPO, GRPO, GSPO, REAL
from rlvr_lightning.context import Collectives
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.pieces import KINDS, advantage_estimators, policy_losses
from rlvr_lightning.pieces.kinds import AdvantageInputs
from tests.conftest import REPO

EXAMPLES = REPO / "docs" / "examples"


@pytest.fixture
def my_pieces(monkeypatch):
    """The README's user module, importable as a user's would be (on the path, outside the package)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import my_pieces

    return my_pieces


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


def test_a_piece_binds_the_knobs_its_choice_gives_else_its_own_defaults(my_pieces):
    """(Was: knobs came from the hyper-parameters, then piece_args, then the defaults.) A piece's knobs come from
    its own choice only; a knob it does not read is refused; one without a default must be given."""
    piece = advantage_estimators.get("my_pieces.rank_advantage")
    assert piece.name == "rank" and piece.knobs == ("rank_scale",)
    assert piece.bind({}).keywords == {"rank_scale": 1.0}  # the function's own default applies
    assert piece.bind({"rank_scale": 2.0}).keywords == {"rank_scale": 2.0}
    assert piece.knob_values({"rank_scale": 2.0}) == {"rank_scale": 2.0}
    with pytest.raises(ConfigError, match=r"^model.advantage_estimator=rank does not read the knob 'clip_eps_low'; its knobs: rank_scale "):
        piece.bind({"rank_scale": 2.0, "clip_eps_low": 0.2})
    with pytest.raises(ConfigError, match=re.escape("model.policy_loss=test-dual-clip-required needs the knob 'clip_eps_low': "
                                                    "set it with --model.init_args.policy_loss.knobs.clip_eps_low")):  # fmt: skip
        policy_losses.get("test-dual-clip-required").bind({})


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


def test_group_level_losses_compose_with_any_algorithm():
    """REAL's loss on the GRPO class: the same objective as REAL's own defaults."""
    real_bce = {"name": "real-bce", "knobs": {"tau": 0.25}}
    mixed = GRPO(policy_loss=real_bce, advantage_estimator="none").settings.pieces.objective
    assert mixed.group_level and mixed.loss.keywords == {"tau": 0.25}
    assert REAL(policy_loss=real_bce).settings.pieces.objective.loss.keywords == {"tau": 0.25}


def test_list_names_every_preset_algorithm_and_piece(capsys):
    from rlvr_lightning.catalogue import main

    main([])
    out = SimpleNamespace(stdout=capsys.readouterr().out)
    for preset in (REPO / "configs" / "algo").glob("*.yaml"):
        assert re.search(rf"^  {re.escape(preset.stem)} ", out.stdout, re.M), preset.stem
    import rlvr_lightning.algos as algos

    for name in algos.__all__:
        assert name == "RLVRModule" or re.search(rf"^  {name} ", out.stdout, re.M), name
    for registry in KINDS:
        assert f"--model.init_args.{registry.key}" in out.stdout
        for piece in (p for p in registry.pieces() if p.fn.__module__.startswith("rlvr_lightning.")):
            assert re.search(rf"^    {re.escape(piece.name)} .*\({re.escape(piece.docs)}\)$", out.stdout, re.M), piece.name
    # Each piece's knobs with their defaults, and each algorithm's pieces with the knobs it sets.
    assert "[knobs: clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=None]" in out.stdout
    assert "[knobs: clip_eps_low=0.2, clip_eps_high=0.2, clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0]" in out.stdout
    assert "[knobs: pass_at_k=4]" in out.stdout and "[knobs: tis_cap=2.0]" in out.stdout
    assert "policy_loss=ppo-clip(clip_eps_high=0.28)" in out.stdout  # DAPO's
    assert "policy_loss=gspo(clip_eps_low=0.0003, clip_eps_high=0.0004)" in out.stdout  # GSPO's


def test_every_builtin_piece_names_a_docs_section_that_exists():
    anchors = {re.sub(r"[^\w\- ]", "", h.strip("# ").lower()).replace(" ", "-")
               for h in (REPO / "docs/algorithms.md").read_text().splitlines() if h.startswith("#")}  # fmt: skip
    for registry in KINDS:
        for piece in registry.pieces():
            if piece.fn.__module__.startswith("rlvr_lightning."):
                assert piece.anchor in anchors, (registry.kind, piece.name, piece.anchor)


def test_the_algorithms_pages_table_of_shared_pieces_lists_every_registry_and_piece():
    """Written by hand, it once listed five registries and none of a year's new pieces."""
    doc = (REPO / "docs/algorithms.md").read_text()
    assert f"one of {('one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight')[len(KINDS) - 1]} registries" in doc
    rows = {line.split("|")[2].strip().split()[0].strip("`"): line for line in doc.splitlines()
            if line.startswith("| ") and "`" in line.split("|")[2]}  # fmt: skip
    for registry in KINDS:
        listed = re.findall(r"`([^`]+)`", rows[registry.key].split("|")[3])
        assert listed == [p.name for p in registry.pieces() if p.fn.__module__.startswith("rlvr_lightning.")], registry.key


def test_the_readme_and_the_configuration_page_name_every_preset_and_builtin_piece():
    """Their tables of presets and pieces are written by hand: they must not drift from the code."""
    readme, config = (REPO / "README.md").read_text(), (REPO / "docs/configuration.md").read_text()
    for preset in sorted((REPO / "configs/algo").glob("*.yaml")):
        assert f"`{preset.stem}`" in readme, preset.stem
    for registry in KINDS:
        key = registry.key.rsplit(".", 1)[-1]
        rows = [line for page in (readme, config) for line in page.splitlines() if line.startswith(f"| `{key}` |")]
        assert len(rows) == 2, key
        for piece in registry.pieces():
            if piece.fn.__module__.startswith("rlvr_lightning."):
                assert all(f"`{piece.name}`" in row for row in rows), (key, piece.name)


def test_the_readme_is_a_short_guide_whose_links_exist_and_whose_example_is_the_tested_file():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert (EXAMPLES / "my_pieces.py").read_text() in readme
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links {target}, which does not exist"


# A researcher's loss whose clip range has no default (the config must give it) and whose c defaults to 3.
@policy_losses.register("test-dual-clip-own-default", anchor=None)
def dual_clip_loss_with_own_default(x, *, clip_eps_low: float, clip_eps_high: float, dual_clip_c: float = 3.0):
    """PPO's clipped surrogate, dual-clipped at c."""
    return policy_losses.get("ppo-clip").fn(x, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, dual_clip_c=dual_clip_c)


@policy_losses.register("test-dual-clip-required", anchor=None)
def dual_clip_loss_without_default(x, *, clip_eps_low: float, clip_eps_high: float, dual_clip_c: float):
    """The same, with c required."""
    return dual_clip_loss_with_own_default(x, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, dual_clip_c=dual_clip_c)


CLIP = {"clip_eps_low": 0.2, "clip_eps_high": 0.2}


def dual_clipped_token_loss(module) -> float:
    """One token at ratio e² with advantage −1: the clipped surrogate's loss is e² ≈ 7.39, dual-clipped at c."""
    from rlvr_lightning.pieces.kinds import TokenLossInputs

    one = torch.ones(1, 1)
    per_token, _ = module.settings.pieces.objective.loss(TokenLossInputs(2 * one, 0 * one, -one, one.bool()))
    return float(per_token)


def test_a_knob_the_choice_leaves_unset_is_the_pieces_own_default():
    """(Was: an unset algorithm argument left a piece's own default.) A piece's own default c = 3 applies until
    its choice gives c; the built-in's default None is off."""
    loss = "test-dual-clip-own-default"
    assert dual_clipped_token_loss(GRPO(policy_loss={"name": loss, "knobs": CLIP})) == pytest.approx(3.0)
    assert dual_clipped_token_loss(GRPO(policy_loss={"name": loss, "knobs": {**CLIP, "dual_clip_c": 2.0}})) == pytest.approx(2.0)
    assert dual_clipped_token_loss(GRPO(policy_loss="ppo-clip")) == pytest.approx(torch.e**2)  # the built-in: off


def test_a_knob_without_a_default_is_not_fed_by_the_algorithm():
    """A user's loss whose clip range has no default is not given the algorithm's (no knob is fed by name from
    anything but its choice): the config must give it, and its error names the flag that does."""
    with pytest.raises(ConfigError, match=re.escape("model.policy_loss=test-dual-clip-own-default needs the knob "
                                                    "'clip_eps_low': set it with --model.init_args.policy_loss.knobs.clip_eps_low")):  # fmt: skip
        DAPO(policy_loss="test-dual-clip-own-default")


def test_a_value_a_knob_cannot_take_is_refused_at_bind_time():
    with pytest.raises(ConfigError, match=re.escape(
        "policy_loss=test-dual-clip-required: its knob dual_clip_c takes float, got None "
        "(--model.init_args.policy_loss.knobs.dual_clip_c)"
    )):  # fmt: skip
        GRPO(policy_loss={"name": "test-dual-clip-required", "knobs": {**CLIP, "dual_clip_c": None}})
    with pytest.raises(ConfigError, match=r"policy_loss=test-dual-clip-required needs the knob 'dual_clip_c'"):
        GRPO(policy_loss={"name": "test-dual-clip-required", "knobs": CLIP})
    required = GRPO(policy_loss={"name": "test-dual-clip-required", "knobs": {**CLIP, "dual_clip_c": 1.5}})
    assert dual_clipped_token_loss(required) == pytest.approx(1.5)


def test_every_algorithm_runs_its_pieces_with_the_knobs_it_records():
    """(Was: binding on purpose (AlgorithmArgs) changed nothing for the library's algorithms.) Every library
    algorithm records each kind's piece with every knob it has, and its bound functions run with those values."""
    from rlvr_lightning import algos
    from rlvr_lightning.pieces.choices import CHOICES

    for name in algos.__all__:
        module = getattr(algos, name)()
        pieces = module.settings.pieces
        bound = {"advantage_estimator": pieces.estimator, "policy_loss": pieces.objective.loss,
                 "rollout_correction": pieces.correct, "proximal_policy": pieces.approximate_proximal}  # fmt: skip
        for registry in KINDS:
            recorded, piece = module.hparams[registry.key], registry.selected(module.settings.args)
            assert set(recorded) == {"name", "knobs"} and recorded["name"] == piece.name, (name, registry.key)
            assert set(recorded["knobs"]) == set(piece.knobs), (name, registry.key)
            assert recorded["knobs"] == piece.knob_values(module.settings.args[registry.key].knobs), (name, registry.key)
            if registry.key in bound:
                fn = bound[registry.key]
                assert fn.keywords == {k: recorded["knobs"][k] for k in piece.declared.taken_by[piece.fn]}, (name, registry.key)
        assert set(CHOICES) == {registry.key for registry in KINDS}


def test_the_algorithms_default_knobs_reach_the_loss():
    """DAPO's clip-higher, GSPO's tiny sequence clip range and REAL's τ are the knobs of their policy_loss choice."""
    assert DAPO().settings.pieces.objective.loss.keywords == {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip_c": None}
    assert GSPO().settings.pieces.objective.loss.keywords == {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4, "dual_clip_c": None}
    assert REAL().settings.pieces.objective.loss.keywords == {"tau": 0.5}
    assert GRPO().settings.pieces.objective.loss.keywords == {"clip_eps_low": 0.2, "clip_eps_high": 0.2, "dual_clip_c": None}
    # A choice given in full replaces the algorithm's: its knobs not given are the loss's own defaults.
    assert DAPO(policy_loss="ppo-clip").settings.pieces.objective.loss.keywords["clip_eps_high"] == 0.2
    assert REAL(policy_loss={"name": "real-anchor", "knobs": {"tau": 0.1}}).settings.pieces.objective.loss.keywords == {"tau": 0.1}
