"""Options that were renamed (to registered pieces) or moved (to the `rollout:` section, or to a name
that says what they are) stop the CLI with one line naming the new spelling, from a flag or a config file."""

from __future__ import annotations

import pytest

from tests.test_presets_config import BASE


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--model.init_args.surrogate", "gspo"], "use --model.init_args.policy_loss gspo"),
        (["--model.init_args.use_adv_std=false"], "use --model.init_args.advantage_estimator dr-grpo"),
        (["--model.init_args.tis_level", "token"], "use --model.init_args.rollout_correction tis-token"),
        (["--model.token_level", "true"], "use --model.init_args.policy_loss gspo-token"),
        (["--model.init_args.tis_level", "tok"], "rollout_correction (none | tis-token | tis-sequence)"),
        (["--data.group_size", "4"], "data.group_size is now rollout.group_size: use --rollout.group_size"),
        (["--data.engine=hf"], "data.engine is now rollout.engine"),
        (["--data.async_rollouts", "1"], "data.async_rollouts is now rollout.max_staleness"),
        (["--rollout.batches_ahead", "1"], "rollout.batches_ahead is now rollout.max_staleness"),
        (["--model.init_args.mini_batches", "2"], "use --model.init_args.num_mini_batches"),
    ],
)
def test_old_options_are_one_line_errors_naming_the_new_spelling(args, expected, capsys):
    from rlvr_lightning.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(BASE), *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err


@pytest.mark.parametrize(
    "text,expected",
    [
        ("model:\n  class_path: rlvr_lightning.algos.real.REAL\n  init_args:\n    variant: bce\n",
         "use --model.init_args.policy_loss real-bce"),
        ("data:\n  batch_size: 8\n  max_response_length: 64\n",
         "data.max_response_length is now rollout.max_response_length"),
    ],
)  # fmt: skip
def test_an_old_option_in_a_config_file_is_reported_too(text, expected, capsys, tmp_path):
    from rlvr_lightning.cli import main

    old = tmp_path / "old.yaml"
    old.write_text(text)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(BASE), "--config", str(old)])
    assert expected in capsys.readouterr().err
