"""Answers as MLflow traces (`callbacks.episode_traces`): a two-turn answer that called the Python tool, run through the
real episode loop and the real sandbox, is one trace in a real MLflow store, linked to its run, with a span per turn,
the tool call's code, output and how it ended, and the scoring with each reward term; an answer in one piece is one
turn and its score; a call that failed marks its span failed."""

from __future__ import annotations

import shutil

import pytest
import torch

from rlvr_lightning.callbacks.episode_traces import log_episode_traces, point_tracing_at
from rlvr_lightning.context import ScoredBatch
from rlvr_lightning.environments.episodes import advance_episodes, start_episodes
from rlvr_lightning.environments.python_tool import PythonTool, PythonToolSettings
from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
from rlvr_lightning.sandbox import SandboxSettings
from tests.support.char_tokenizer import Chars

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")

CALL = "Let me compute.\n```python\nprint(6 * 7)\n```\n"
FAILING_CALL = "```python\n1 / 0\n```\n"
ANSWER = "So it is \\boxed{42}."


def tool_answers(segments: list[list[str]]) -> list[Completion]:
    """One answer per list of segments: the model's turns in order, its calls run by the Python tool."""
    tool = PythonTool(PythonToolSettings(max_calls=2, sandbox=SandboxSettings(workers=1)))
    completions = []
    try:
        for texts in segments:
            turns = iter(texts)

            def generate(prompts, sampling, turns=turns):
                text = next(turns)
                return [[Completion([ord(c) for c in text], [-0.5] * len(text), "stop")]]

            (episode,) = start_episodes([[ord("Q")]], 1)
            advance_episodes(generate, Chars(), [episode], SamplingConfig(group_size=1, max_tokens=400), tool)
            completions.append(episode.completion())
    finally:
        tool.close()
    return completions


def scored(completions: list[Completion]) -> ScoredBatch:
    n = len(completions)
    texts = [Chars().decode(c.token_ids) for c in completions]
    own = [Chars().decode([t for t, s in zip(c.token_ids, c.sampled_mask) if s]) for c in completions]
    rollout = Rollout(
        batch=PromptBatch(["p0"], ["What is 6 times 7?"], ["42"]), group_size=n, prompt_ids=[[ord("Q")]],
        completions=completions, sampling=SamplingConfig(group_size=n, max_tokens=400), policy_version=0,
        texts=texts, own_texts=own, correct=torch.tensor([1.0] * n), reward_terms={"brevity": torch.full((n,), 0.25)},
    )  # fmt: skip
    return ScoredBatch(rollout, torch.full((n,), 1.25), torch.tensor([0.5, -0.5, 0.0][:n]))


@pytest.fixture
def store(tmp_path):
    """A real MLflow store (SQLite) with one run; tracing pointed at it for the test, as the callback does."""
    import mlflow
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("traces", artifact_location=str(tmp_path / "artifacts"))
    run = client.create_run(experiment).info.run_id
    previous = point_tracing_at(uri)
    yield client, experiment, run
    mlflow.flush_trace_async_logging()
    point_tracing_at(previous)


def spans_of(client, experiment: str, run: str) -> list[list]:
    import mlflow

    mlflow.flush_trace_async_logging()
    traces = client.search_traces(locations=[experiment], run_id=run)
    return [sorted(t.data.spans, key=lambda s: (s.start_time_ns, s.parent_id is not None)) for t in traces]


def test_a_two_turn_tool_answer_is_one_trace_of_its_turns_its_call_and_its_score(store):
    client, experiment, run = store
    batch = scored(tool_answers([[CALL, ANSWER], [ANSWER], [FAILING_CALL, ANSWER]]))
    ids = log_episode_traces(client, experiment, run, batch, [0, 1, 2], Chars().decode, step=3, max_chars=1000)
    by_id = {spans[0].trace_id: spans for spans in spans_of(client, experiment, run)}
    assert set(by_id) == set(ids)  # every trace linked to the run
    called, plain, failed = (by_id[i] for i in ids)

    root, turn1, tool, turn2, score = called
    assert [s.name for s in called] == ["episode", "turn 1", "python", "turn 2", "score"]
    assert root.inputs == {"prompt": "What is 6 times 7?", "gold": "42"}
    assert all(s.parent_id == root.span_id for s in called[1:])
    assert turn1.outputs == {"text": CALL} and turn1.attributes["stopped_at"] == "\n```\n"
    assert tool.span_type == "TOOL" and tool.inputs == {"code": "print(6 * 7)"}
    assert tool.outputs["observation"] == "42" and tool.outputs["stdout"] == "42\n"
    assert tool.attributes["status"] == "ok" and tool.attributes["exit_code"] == 0 and tool.status.status_code == "OK"
    assert turn2.outputs == {"text": ANSWER} and turn2.inputs["context_tokens"] == 1 + len(CALL) + len("```output\n42\n```\n")
    assert score.outputs["extracted_answer"] == "42" and score.outputs["correct"] == 1.0
    assert score.outputs["reward/brevity"] == 0.25 and score.outputs["advantage"] == 0.5
    assert score.inputs == {"answer": CALL + ANSWER}  # the model's own words: what the reward read
    assert turn1.end_time_ns <= tool.start_time_ns <= tool.end_time_ns and turn1.start_time_ns <= turn2.start_time_ns

    assert [s.name for s in plain] == ["episode", "turn 1", "score"]
    assert plain[0].outputs["completion"] == ANSWER

    tool = next(s for s in failed if s.name == "python")
    assert tool.attributes["status"] == "error" and "ZeroDivisionError" in tool.outputs["stderr"]
    assert tool.status.status_code == "ERROR"


def test_an_answer_without_recorded_turns_is_one_turn_and_its_score(store):
    client, experiment, run = store
    completion = Completion([ord(c) for c in ANSWER], [-0.5] * len(ANSWER), "stop")  # the engine's, no episode
    (ids,) = [log_episode_traces(client, experiment, run, scored([completion]), [0], Chars().decode, 0, 5)]
    (spans,) = spans_of(client, experiment, run)
    assert [s.name for s in spans] == ["episode", "turn 1", "score"] and spans[0].trace_id == ids[0]
    assert spans[1].outputs == {"text": "So it …"}  # cut at max_chars


def test_tracing_pointed_at_a_runs_store_is_pointed_back(tmp_path, monkeypatch):
    """A training process in a test session (or a notebook) gets its own tracking URI back once the traces are
    written: neither MLflow's default nor the environment its subprocesses inherit is left on the run's store."""
    import os

    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri(None)
    default = mlflow.get_tracking_uri()
    previous = point_tracing_at(f"sqlite:///{tmp_path}/mlflow.db")
    assert previous is None and os.environ["MLFLOW_TRACKING_URI"] == mlflow.get_tracking_uri() != default
    point_tracing_at(previous)
    assert "MLFLOW_TRACKING_URI" not in os.environ and mlflow.get_tracking_uri() == default


def test_an_answer_whose_trace_fails_ends_as_a_failed_trace_and_the_others_are_traced(store):
    """A user's call shaped like the tool's but with a time that is no number: its answer's trace ends failed (not
    left open in MLflow), the next answer is traced, and the error reaches the caller (a warning there)."""
    client, experiment, run = store
    bad_call = {"code": "x", "execution": {"stdout": "", "stderr": "", "status": "ok", "exit_code": 0, "seconds": "fast"}}
    events = [{"kind": "turn", "tokens": [0, 2], "ns": [1, 2], "stopped_at": None},
              {"kind": "reply", "tokens": [2, 2], "ns": [3, 4], "stop": None, "reward": None, "calls": [bad_call]}]  # fmt: skip
    bad = Completion([ord("a"), ord("b")], [-0.5] * 2, "stop", events=events)
    good = Completion([ord(c) for c in ANSWER], [-0.5] * len(ANSWER), "stop")
    with pytest.raises(TypeError):
        log_episode_traces(client, experiment, run, scored([bad, good]), [0, 1], Chars().decode, 0, 100)
    import mlflow

    mlflow.flush_trace_async_logging()
    traces = client.search_traces(locations=[experiment], run_id=run)
    assert sorted(t.info.state for t in traces) == ["ERROR", "OK"]
    (ok,) = [t for t in traces if t.info.state == "OK"]
    assert [s.name for s in sorted(ok.data.spans, key=lambda s: s.start_time_ns)] == ["episode", "turn 1", "score"]
