"""The quiet default and its `-v` switch; the progress bar's total in rollout batches."""

from __future__ import annotations

import logging
import math
import warnings
from types import SimpleNamespace

import pytest

from rlvr_lightning.callbacks.progress import rollout_batches_total
from rlvr_lightning.console import quiet_libraries


@pytest.fixture
def clean_env(monkeypatch):
    for key in ("RLVR_VERBOSE", "VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL", "TRANSFORMERS_VERBOSITY"):
        # setenv first records the variable's state, so what quiet_libraries sets in the test is undone after
        # it (delenv of an absent variable records nothing: `-v` then stayed on for the process's later tests)
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    levels = {name: logging.getLogger(name).level for name in ("vllm", "lightning.fabric.utilities.seed")}
    with warnings.catch_warnings():
        yield monkeypatch
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_quiet_by_default_and_a_user_setting_wins(clean_env):
    clean_env.setenv("TORCH_CPP_LOG_LEVEL", "INFO")
    assert quiet_libraries(["fit", "--config", "x.yaml"]) == ["fit", "--config", "x.yaml"]
    import os

    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR" and os.environ["TORCH_CPP_LOG_LEVEL"] == "INFO"
    assert logging.getLogger("lightning.fabric.utilities.seed").getEffectiveLevel() == logging.WARNING
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet_libraries([])  # the filters go first in the list, ahead of "default"
        warnings.warn("`torch.distributed.reduce_op` is deprecated", FutureWarning, stacklevel=1)
        warnings.warn("something else", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something else"]


@pytest.mark.parametrize("flag", ["-v", "--verbose"])
def test_verbose_flag_is_removed_and_changes_nothing(clean_env, flag):
    import os

    assert quiet_libraries(["fit", flag, "--trainer.max_steps", "2"]) == ["fit", "--trainer.max_steps", "2"]
    assert os.environ["RLVR_VERBOSE"] == "1" and "VLLM_LOGGING_LEVEL" not in os.environ


@pytest.mark.parametrize(
    "max_steps,max_epochs,num_mini_batches,ppo_epochs,expected",
    [(160, -1, 1, 1, 160), (640, -1, 4, 1, 160), (640, -1, 2, 2, 160), (-1, 2, 1, 1, 2 * 520), (-1, -1, 1, 1, math.inf)],
)  # fmt: skip
def test_progress_bar_counts_rollout_batches(max_steps, max_epochs, num_mini_batches, ppo_epochs, expected):
    trainer = SimpleNamespace(max_steps=max_steps, max_epochs=max_epochs, num_training_batches=520)
    from rlvr_lightning.algos import GRPO

    module = GRPO(num_mini_batches=num_mini_batches, ppo_epochs=ppo_epochs)  # no weights until configure_model
    assert rollout_batches_total(trainer, module) == expected
