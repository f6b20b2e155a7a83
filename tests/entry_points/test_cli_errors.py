"""An unknown option, on the command line or in a `--config` file, stops the CLI with one line naming the
valid options it most resembles."""

from __future__ import annotations

import pytest

from tests.entry_points.test_presets_config import BASE


def cli_error(args: list[str], capsys) -> str:
    from rlvr_lightning.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(BASE), *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--data.group_size", "4"], "did you mean rollout.group_size?"),  # the same name in another section
        (["--model.init_args.kl_cof", "0.3"], "did you mean model.init_args.kl_coef?"),
        (["--model.init_args.mini_batches", "2"], "did you mean model.init_args.num_mini_batches"),
        (["--rollout.batches_ahead", "1"], "rollout.batches_ahead 1; every option with its value: --print_config"),
        # The module's settings groups: a flat name finds its group, a misspelt one the group's closest option.
        (["--model.init_args.lr", "1e-5"], "did you mean model.init_args.optim.lr?"),
        (["--model.init_args.optim.lrr", "1e-5"], "did you mean model.init_args.optim.lr?"),
        (["--model.init_args.sync_check_every", "2"], "did you mean rollout.sync.check_every?"),
        (["--optimizer", "Adam"], "; the algorithm makes its own AdamW and schedule: model.init_args.optim.lr, "),
        (["--lr_scheduler", "StepLR"], "; the algorithm makes its own AdamW and schedule: model.init_args.optim.lr, "),
    ],
)
def test_an_unknown_option_names_the_options_it_resembles(args, expected, capsys):
    assert expected in cli_error(args, capsys)


def test_an_unknown_option_in_a_config_file_is_reported_too(capsys, tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  class_path: rlvr_lightning.algos.real.REAL\n  init_args:\n    two_pas: true\n")
    assert "did you mean model.init_args.two_pass" in cli_error(["--config", str(old)], capsys)


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--model.init_args.clip_eps_high", "0.28"],
         "clip_eps_high is a knob of a piece, set in its section: --model.init_args.policy_loss.knobs.clip_eps_high"),
        (["--model.init_args.dual_clip_c", "3.0"], "--model.init_args.policy_loss.knobs.dual_clip_c"),
        (["--model.init_args.tis_cap", "1.5"], "--model.init_args.rollout_correction.knobs.tis_cap"),
        (["--model.init_args.tau", "0.5"], "tau is a knob of a piece, set in its section: --model.init_args.policy_loss.knobs.tau"),
        (["--model.init_args.policy_loss", "gspo"], "a piece is chosen by name: --model.init_args.policy_loss.name gspo"),
        (["--model.init_args.rollout_correction", "tis-token"],
         "a piece is chosen by name: --model.init_args.rollout_correction.name tis-token"),
        (["--model.init_args.piece_args", "{pass_at_k: 2}"],
         "a piece's knobs are set in its own section: --model.init_args.<kind>.knobs.<knob>"),
        (["--model.init_args.piece_args.pass_at_k", "2"],
         "a piece's knobs are set in its own section: --model.init_args.<kind>.knobs.<knob>"),
    ],
    ids=["clip", "dual-clip", "tis-cap", "tau", "bare-loss", "bare-correction", "piece-args", "piece-args-dotted"],
)  # fmt: skip
def test_an_old_spelling_of_a_piece_or_knob_is_one_line_naming_the_new_one(args, expected, capsys):
    assert expected in cli_error(args, capsys)


def test_an_old_spelling_in_a_config_file_is_one_line_naming_the_new_one(capsys, tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  class_path: rlvr_lightning.algos.real.REAL\n  init_args:\n    tau: 0.25\n")
    assert "--model.init_args.policy_loss.knobs.tau" in cli_error(["--config", str(old)], capsys)
    old.write_text("model:\n  init_args:\n    piece_args: {pass_at_k: 2}\n")
    assert "--model.init_args.<kind>.knobs.<knob>" in cli_error(["--config", str(old)], capsys)


def test_an_option_of_a_group_in_a_config_file_is_reported_with_its_group(capsys, tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text("model:\n  init_args:\n    lr: 1.0e-5\n")
    assert "did you mean model.init_args.optim.lr?" in cli_error(["--config", str(flat)], capsys)
    misspelt = tmp_path / "misspelt.yaml"
    misspelt.write_text("model:\n  init_args:\n    compute:\n      micro_batch_sise: 8\n")
    assert (f"Group 'compute' does not accept option 'micro_batch_sise' (set in {misspelt}); did you mean "
            "model.init_args.compute.micro_batch_size") in cli_error(["--config", str(misspelt)], capsys)  # fmt: skip


def test_an_unknown_option_in_a_config_file_names_the_file_that_sets_it(capsys, tmp_path):
    """Of the config files given, the one that sets the unknown option is named (a preset, the user's own file);
    one set by a flag names none."""
    fine, bad = tmp_path / "fine.yaml", tmp_path / "bad.yaml"
    fine.write_text("data:\n  batch_size: 4\n")
    bad.write_text("trainer:\n  max_stepz: 4\n")
    line = cli_error(["--config", str(fine), f"--config={bad}"], capsys)
    assert f"max_stepz' (set in {bad}); did you mean trainer.max_steps" in line and str(fine) not in line
    assert "set in" not in cli_error(["--config", str(fine), "--data.batch_sise", "4"], capsys)
    assert f"(set in {bad})" in cli_error(["-c", str(bad)], capsys)  # LightningCLI's short form


@pytest.mark.parametrize(
    "args,new",
    [
        (["--rollout.max_staleness", "2"], "rollout.stream.max_staleness"),  # the same name, now in a group
        (["--rollout.weight_transfer", "nccl"], "rollout.sync.weight_transfer"),
        (["--rollout.stream_mode", "throughput"], "rollout.stream.mode"),  # renamed in its group
        (["--rollout.sync_check_tol", "0.01"], "rollout.sync.check_tol"),
        (["--rollout.server_urls", "[http://h:1]"], "rollout.servers.urls"),
        (["--rollout.server_unresponsive_s", "10"], "rollout.servers.unresponsive_s"),
        (["--rollout.stream.max_stalness", "1"], "rollout.stream.max_staleness"),  # misspelt in its group
    ],
)
def test_a_flat_rollout_option_now_in_a_group_names_its_new_spelling(args, new, capsys):
    grpo = ["--config", str(BASE.parent / "algo" / "grpo.yaml")]
    assert cli_error([*grpo, *args], capsys).endswith(f"; did you mean {new}?")


@pytest.mark.parametrize(
    "section,new",
    [("server_urls: [http://h:1]", "rollout.servers.urls"), ("max_staleness: 2", "rollout.stream.max_staleness")],
)
def test_a_flat_rollout_option_in_a_config_file_names_its_new_spelling(section, new, capsys, tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text(f"rollout:\n  {section}\n")
    name = section.partition(":")[0]
    assert cli_error(["--config", str(old)], capsys) == (
        f"error: Subcommand 'fit' does not accept option 'rollout.{name}' (set in {old}); did you mean {new}?"
    )


def test_the_runs_length_is_given_once_in_rollout_batches(capsys):
    """base.yaml gives the run's length in rollout batches; Lightning's max_steps (optimizer steps) follows."""
    err = cli_error(["--config", str(BASE.parent / "algo" / "grpo.yaml"), "--trainer.max_steps", "3"], capsys)
    assert "rollout_batches=160 and trainer.max_steps=3 both set the run's length: give it once" in err
    err = cli_error(["--config", str(BASE.parent / "algo" / "grpo.yaml"), "--rollout_batches", "0"], capsys)
    assert err == "error: rollout_batches=0: the run's length must be ≥ 1 rollout batch"


def test_a_negative_number_in_scientific_notation_is_read_as_a_number(capsys, tmp_path, monkeypatch):
    """Python 3.11's argparse took `-1e-3` for an option ("expected one argument"); read as the number, a negative
    learning rate is the settings' own one-line refusal."""
    monkeypatch.chdir(tmp_path)
    err = cli_error(["--config", str(BASE.parent / "algo" / "grpo.yaml"), "--model.init_args.optim.lr", "-1e-3"], capsys)
    assert "model.optim.lr must be ≥ 0, got -0.001" in err, err


def test_help_says_how_to_list_the_algorithms_own_arguments(capsys):
    """In subclass mode `--help` lists `--model` alone: its epilog names `--model.help <Class>`, which lists them."""
    from rlvr_lightning.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    assert "--model.help GRPO" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["fit", "--model.help", "GRPO"])
    assert "--model.shapers.thr" in capsys.readouterr().out
