"""Answers as MLflow traces: for each answer the completions table logs, one trace linked to the run, so MLflow's
Traces tab shows it as it happened. The root span is the episode (the prompt and gold in, the completion, reward and
correctness out); under it, in order, a span per model turn (its text, the stop string it ended on), a span per tool
call (its code in; its observation, stdout and stderr out; how it ended, its exit code, time and memory; an error or
a timeout marks the span failed), a span per other environment reply (the text it inserted, why it ended the
episode, its reward), and the scoring (the extracted answer, gold, verdict, each reward term, the reward and its
advantage).

Times are the wall clock the episode recorded (`Completion.events`): a turn spans the generation call that began it
to the one that ended it (batched with the other answers of its batch), a reply the environment's call for its batch,
a tool call the reply's start plus the call's own time. An answer in one piece records no times: its spans sit at the
moment the trace is written. The scoring span holds values only.

MLflow exports traces to the process's tracking store (`mlflow.set_tracking_uri`): `CompletionsTable` points it at the
run's store before its first trace (unless it is there already) and restores the process's own when the fit ends,
however it ends.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from rlvr_lightning.callbacks.answer_rows import clipped, finish_of, reward_terms_of
from rlvr_lightning.context import ScoredBatch
from rlvr_lightning.environments.episodes import plain_value
from rlvr_lightning.rewards.extraction import extract_prediction


def json_safe(value: Any) -> Any:
    """`value` as JSON values: what a user's environment put in its calls may be any object (written as its repr),
    or hold what JSON cannot (a tuple as a key, itself): then the whole value as its repr."""
    try:
        return json.loads(json.dumps(value, default=repr))
    except (TypeError, ValueError):
        return repr(value)


def point_tracing_at(tracking_uri: str | None) -> str | None:
    """Export traces to `tracking_uri` (MLflow's tracer writes to the process's tracking URI, not a client's); the
    URI the process had set before (None: none), to restore once the traces are written."""
    import mlflow

    previous = os.environ.get("MLFLOW_TRACKING_URI")  # what `mlflow.set_tracking_uri` sets, or the user did
    mlflow.set_tracking_uri(tracking_uri)
    return previous


def log_episode_traces(
    client, experiment_id: str, run_id: str, batch: ScoredBatch, rows: Sequence[int], decode: Callable, step: int,
    max_chars: int,
) -> list[str]:  # fmt: skip
    """One trace per answer `rows` of a scored batch, linked to the run; their trace ids. An answer whose trace
    cannot be made (a call shaped like the tool's whose fields are not) ends as a failed trace, the others are made;
    the first error is raised at the end."""
    traces, errors = [], []
    for n in rows:
        try:
            traces.append(trace_answer(client, experiment_id, run_id, batch, n, decode, step, max_chars))
        except Exception as err:  # noqa: BLE001 - reported by the caller, the other answers traced
            errors.append(err)
    if errors:
        raise errors[0]
    return traces


def trace_answer(
    client, experiment_id: str, run_id: str, batch: ScoredBatch, n: int, decode: Callable, step: int, max_chars: int
) -> str:
    rollout = batch.rollout
    c, b = rollout.completions[n], rollout.group_of(n)
    events = c.events or [{"kind": "turn", "tokens": [0, len(c.token_ids)], "ns": [None, None], "stopped_at": None}]
    correct = float(rollout.correct[n])
    tags = {"step": str(step), "group": str(b), "answer": str(n % rollout.group_size), "correct": f"{correct:g}"}
    inputs = {"prompt": clipped(rollout.batch.prompts[b], max_chars), "gold": rollout.batch.answers[b]}
    root = client.start_trace("episode", span_type="AGENT", inputs=inputs, tags=tags, experiment_id=experiment_id,
                              run_id=run_id, start_time_ns=events[0]["ns"][0])  # fmt: skip
    trace = root.trace_id
    span = lambda name, kind, window, **kw: span_in(client, trace, root.span_id, name, kind, window, **kw)  # noqa: E731
    try:
        turn = 0
        for event in events:
            a, b_ = event["tokens"]
            text = clipped(decode(c.token_ids[a:b_]), max_chars)
            if event["kind"] == "turn":
                turn += 1
                span(f"turn {turn}", "LLM", event["ns"], inputs={"context_tokens": len(rollout.prompt_ids[b]) + a},
                     outputs={"text": text}, attributes={"tokens": b_ - a, "stopped_at": event["stopped_at"]})  # fmt: skip
                continue
            for call in event["calls"]:
                tool_span(span, plain_value(call), event["ns"][0], text, max_chars)
            if not event["calls"] and (text or event["stop"] not in (None, "answered") or event["reward"] is not None):
                span("environment", "TOOL", event["ns"], outputs={"inserted": text, "stop": event["stop"],
                                                                 "reward": event["reward"]})  # fmt: skip
        end = events[-1]["ns"][1]
        own = rollout.answer_texts[n]
        scores = {"extracted_answer": extract_prediction(own), "gold": rollout.batch.answers[b], "correct": correct,
                  **reward_terms_of(rollout, n), "reward": float(batch.rewards[n]),
                  "advantage": float(batch.advantages[n]), "finish_reason": finish_of(c)}  # fmt: skip
        span("score", "EVALUATOR", [end, end], inputs={"answer": clipped(own, max_chars)}, outputs=scores)
    except BaseException:
        client.end_trace(trace, status="ERROR")  # never left open in MLflow's trace manager
        raise
    outputs = {"completion": clipped(rollout.texts[n], max_chars), "correct": correct, "reward": scores["reward"]}
    client.end_trace(trace, outputs=outputs, end_time_ns=end)
    return trace


def tool_span(span: Callable, call: Any, start_ns: int | None, inserted: str, max_chars: int) -> None:
    """A tool call's span: the Python tool's (its code, output and how it ended), or a user's call as it is."""
    execution = call.get("execution") if isinstance(call, dict) else None
    known = {"stdout", "stderr", "status", "exit_code", "seconds"}
    if not isinstance(execution, dict) or "code" not in call or not known <= set(execution):  # a user's own call
        span("call", "TOOL", [start_ns, start_ns], inputs={"call": json_safe(call)}, outputs={"inserted": inserted})
        return
    data = call.get("data")
    appended = call.get("appended", "")
    observation = appended[data[0] : data[1]] if data else appended
    end_ns = None if start_ns is None else start_ns + int(execution["seconds"] * 1e9)
    outputs = {"observation": clipped(observation, max_chars), "stdout": clipped(execution["stdout"], max_chars),
               "stderr": clipped(execution["stderr"], max_chars)}  # fmt: skip
    attributes = {"status": execution["status"], "exit_code": execution["exit_code"], "seconds": execution["seconds"],
                  "memory_peak_mb": execution.get("memory_peak_mb"), "truncated": call.get("truncated")}  # fmt: skip
    status = "OK" if execution["status"] == "ok" else "ERROR"
    span("python", "TOOL", [start_ns, end_ns], inputs={"code": clipped(call["code"], max_chars)}, outputs=outputs,
         attributes=attributes, status=status)  # fmt: skip


def span_in(
    client, trace: str, parent: str, name: str, kind: str, window: Sequence[int | None], *, inputs: Any = None,
    outputs: Any = None, attributes: dict | None = None, status: str = "OK",
) -> None:  # fmt: skip
    """A finished child span of the episode over `window` (ns; None: now)."""
    started = client.start_span(name, trace_id=trace, parent_id=parent, span_type=kind, inputs=inputs,
                                attributes=attributes, start_time_ns=window[0])  # fmt: skip
    client.end_span(trace, started.span_id, outputs=outputs, status=status, end_time_ns=window[1])
