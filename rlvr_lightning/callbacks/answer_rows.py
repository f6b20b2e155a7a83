"""One answer of a scored rollout as the run shows it: in the training completions table (`callbacks.completions`), the
held-out samples table (`callbacks.evaluation`) and the answer's trace (`callbacks.episode_traces`)."""

from __future__ import annotations

from typing import Any

from rlvr_lightning.rollout.types import Completion, Rollout

INSERTED_OPEN, INSERTED_CLOSE = "\n⟦inserted⟧\n", "\n⟦/inserted⟧\n"  # around an environment's text in a completion


def clipped(text: str, max_chars: int) -> str:
    """`text`, or its first `max_chars` characters and an ellipsis."""
    return text if len(text) <= max_chars else text[:max_chars] + " …"


def turns_text(token_ids: list[int], sampled_mask: list[bool], decode) -> tuple[str, int]:
    """The completion's text with each run of inserted tokens (a tool's output) between markers, and how many runs of
    sampled tokens it has."""
    runs: list[tuple[bool, list[int]]] = []
    for token, sampled in zip(token_ids, sampled_mask):
        if runs and runs[-1][0] == sampled:
            runs[-1][1].append(token)
        else:
            runs.append((sampled, [token]))
    parts = [decode(ids) if sampled else INSERTED_OPEN + decode(ids) + INSERTED_CLOSE for sampled, ids in runs]
    return "".join(parts), sum(sampled for sampled, _ in runs)


def turns_taken(c: Completion, sampled_runs: int) -> int:
    """The model's turns in an answer: its episode's turns where it recorded them (a turn answered with nothing
    inserted counts), else its runs of sampled tokens."""
    return sum(e["kind"] == "turn" for e in c.events) if c.events else sampled_runs


def finish_of(c: Completion) -> str:
    return f"{c.finish_reason} (excluded: {c.excluded})" if c.excluded else c.finish_reason


def reward_terms_of(rollout: Rollout, n: int) -> dict[str, float]:
    return {f"reward/{name}": float(values[n]) for name, values in rollout.reward_terms.items()}


def answer_columns(rollout: Rollout, n: int, decode, max_chars: int) -> dict[str, Any]:
    """What every samples table shows of answer n of a scored rollout: its prompt, gold, completion (an environment's
    text between markers), the model's turns, finish reason, correctness and each reward term."""
    c, b = rollout.completions[n], rollout.group_of(n)
    text, runs = turns_text(c.token_ids, c.sampled_mask, decode) if c.has_inserted else (rollout.texts[n], 1)
    return {"prompt": clipped(rollout.batch.prompts[b], max_chars), "gold": rollout.batch.answers[b],
            "completion": clipped(text, max_chars), "turns": turns_taken(c, runs), "finish_reason": finish_of(c),
            "correct": float(rollout.correct[n]), **reward_terms_of(rollout, n)}  # fmt: skip


def table_of(rows: list[dict[str, Any]]) -> dict[str, list]:
    """Rows as MLflow's `log_table` takes them: a list per column, every column any row has in the order first seen
    (None where a row has none: a reward term only some batches of an evaluation gave)."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return {key: [row.get(key) for row in rows] for key in columns}
