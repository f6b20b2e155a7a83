"""The training completions table (`callbacks.completions`): an environment's inserted text between markers and the
model's turns counted; one row per answer of whole groups with its reward terms, reward and advantage."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.callbacks.answer_rows import INSERTED_CLOSE, INSERTED_OPEN, table_of, turns_text
from rlvr_lightning.callbacks.completions import completion_rows
from rlvr_lightning.context import ScoredBatch
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig


def decode(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i) for i in ids)


def test_inserted_tokens_sit_between_markers_and_the_models_turns_are_counted():
    text, turns = turns_text([0, 1, 2, 3, 4, 5], [True, True, False, False, True, True], decode)
    assert text == "ab" + INSERTED_OPEN + "cd" + INSERTED_CLOSE + "ef" and turns == 2
    assert turns_text([0, 1], [True, True], decode) == ("ab", 1)


def scored_batch() -> ScoredBatch:
    completions = [Completion([0, 1], [0.0] * 2, "stop"), Completion([2, 3, 4], [0.0] * 3, "length", sampled_mask=[True, False, True]),
                   Completion([5], [0.0], "stop"), Completion([6, 7], [0.0] * 2, "stop", excluded="drop_no_call")]  # fmt: skip
    rollout = Rollout(
        batch=PromptBatch(["p0", "p1"], ["What is 1+1?", "What is 2+2?"], ["2", "4"]), group_size=2, prompt_ids=[[0], [1]],
        completions=completions, sampling=SamplingConfig(group_size=2, max_tokens=3), policy_version=0,
        texts=["ab", "cde", "f", "gh"], correct=torch.tensor([1.0, 0.0, 0.0, 1.0]),
        reward_terms={"brevity": torch.tensor([0.125, 0.25, 0.375, 0.5])},
    )  # fmt: skip
    return ScoredBatch(rollout, torch.tensor([1.125, 0.25, 0.375, 1.5]), torch.tensor([0.5, -0.5, -0.5, 0.5]))  # exact in fp32


def test_a_row_per_answer_of_whole_groups_with_every_reward_term_and_its_advantage():
    table = completion_rows(scored_batch(), groups=1, decode=decode, max_chars=100, step=7)
    assert table == {
        "step": [7, 7], "group": [0, 0], "prompt": ["What is 1+1?"] * 2, "gold": ["2", "2"],
        "completion": ["ab", "c" + INSERTED_OPEN + "d" + INSERTED_CLOSE + "e"], "turns": [1, 2],
        "finish_reason": ["stop", "length"], "correct": [1.0, 0.0], "reward": [1.125, 0.25],
        "advantage": [0.5, -0.5], "reward/brevity": [0.125, 0.25],
    }  # fmt: skip


def test_more_groups_than_the_batch_has_give_every_answer_and_long_text_is_cut():
    table = completion_rows(scored_batch(), groups=5, decode=decode, max_chars=1, step=0)
    assert table["group"] == [0, 0, 1, 1] and table["prompt"][0] == "W …" and table["completion"][0] == "a …"
    assert table["finish_reason"][3] == "stop (excluded: drop_no_call)"


def fail_to_log() -> None:
    raise OSError("artifact store full")


def test_a_table_that_fails_to_log_is_a_warning_and_never_the_runs_error():
    from concurrent.futures import ThreadPoolExecutor, wait

    from rlvr_lightning.callbacks.completions import CompletionsTable

    table = CompletionsTable()
    table._writer = ThreadPoolExecutor(max_workers=1)
    table._pending = [table._writer.submit(fail_to_log)]
    wait(table._pending)
    with pytest.warns(UserWarning, match=r"a table could not be logged \(OSError: artifact store full\)"):
        assert table._unfinished() == []  # a write that failed before the next batch's: reported then
    table._pending = [table._writer.submit(fail_to_log)]
    with pytest.warns(UserWarning, match="a table could not be logged"):
        table.teardown(None, None, "fit")  # waited for, reported, not raised
    assert table._writer is None and table._pending == []


@pytest.mark.parametrize("end", ["teardown", "on_exception"])
def test_a_table_that_traced_points_the_process_tracking_uri_back_however_the_fit_ends(end, tmp_path, monkeypatch):
    """A fit that fails or is stopped skips `teardown` (Lightning calls `on_exception`): the process gets its own
    tracking URI back either way."""
    import os

    import mlflow

    from rlvr_lightning.callbacks.completions import CompletionsTable
    from rlvr_lightning.callbacks.episode_traces import point_tracing_at

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri(None)
    table = CompletionsTable()
    table._tracing, table._uri_before = True, point_tracing_at(f"sqlite:///{tmp_path}/mlflow.db")  # as its first traced batch
    if end == "teardown":
        table.teardown(None, None, "fit")
    else:
        table.on_exception(None, None, RuntimeError("stopped"))
    assert "MLFLOW_TRACKING_URI" not in os.environ


def test_a_column_only_some_rows_have_is_kept_and_filled_with_none():
    """An evaluation's rows come from several batches, and a reward term (the environment's) from only those where
    it gave one: the table keeps every column."""
    assert table_of([{"a": 1}, {"a": 2, "reward/environment": 0.5}]) == {"a": [1, 2], "reward/environment": [None, 0.5]}
    assert table_of([]) == {}


def test_turns_are_the_episodes_own_where_it_recorded_them():
    """A turn the environment answered with nothing inserted leaves no mark in the tokens; the episode's events count
    it, as its trace shows it."""
    from rlvr_lightning.callbacks.answer_rows import answer_columns

    events = [{"kind": "turn", "tokens": [0, 1]}, {"kind": "reply", "tokens": [1, 1]}, {"kind": "turn", "tokens": [1, 2]},
              {"kind": "reply", "tokens": [2, 3]}, {"kind": "turn", "tokens": [3, 4]}]  # fmt: skip
    c = Completion([0, 1, 2, 3], [0.0] * 4, "stop", sampled_mask=[True, True, False, True], events=events)
    rollout = Rollout(batch=PromptBatch(["p"], ["q"], ["1"]), group_size=1, prompt_ids=[[0]], completions=[c],
                      sampling=SamplingConfig(group_size=1), policy_version=0, texts=["abcd"], correct=torch.tensor([1.0]))  # fmt: skip
    assert answer_columns(rollout, 0, decode, 100)["turns"] == 3  # the tokens show two runs of the model's
