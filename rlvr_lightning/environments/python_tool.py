"""The Python tool of tool-integrated reasoning (ToRL, SimpleTIR): the model writes a fenced python block in
its answer; generation stops where the block closes, the code runs in the sandbox, and its output is appended
as a fenced output block; the answer continues from there until it ends (an answer, EOS) or a limit.

    ... so the product is
    ```python
    print(347 * 829)
    ```
    ```output
    287663
    ```
    The answer is \\boxed{287663}.

The block's markers are settings: a model trained with other tags (`<code>`/`</code>`) sets its own.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from rlvr_lightning.environments.base import Environment, Reply
from rlvr_lightning.errors import ConfigError
from rlvr_lightning.rewards.extraction import extract_prediction
from rlvr_lightning.sandbox import Execution, Sandbox, SandboxSettings
from rlvr_lightning.sandbox.observation import observation

if TYPE_CHECKING:
    from rlvr_lightning.environments.episodes import Episode


@dataclass(frozen=True)
class PythonToolSettings:
    """max_calls: tool calls per answer; a block written after the last one ends the answer (`max_calls`).
    observation_chars: an output longer than this keeps its head and tail. timeout_s: a call's time limit.
    code_start / code_end: the block's opening and closing markers; output_start / output_end: what wraps the
    output appended after it. sandbox: where the code runs (`docs/sandbox.md`).
    Stability guards (each off by default, its share logged either way): leave out of the loss the answers with a
    void turn (a segment with neither a closed code block nor an answer: SimpleTIR's filter), those that hit
    `max_calls`, and those with a call that timed out."""

    max_calls: int = 4
    observation_chars: int = 512
    timeout_s: float = 5.0
    code_start: str = "```python\n"
    code_end: str = "\n```\n"
    output_start: str = "```output\n"
    output_end: str = "\n```\n"
    sandbox: SandboxSettings = field(default_factory=SandboxSettings)
    drop_void_turns: bool = False
    drop_max_calls: bool = False
    drop_timeouts: bool = False

    def check(self) -> None:
        if self.max_calls < 1 or self.observation_chars < 1 or not self.timeout_s > 0:
            raise ConfigError("tool: max_calls, observation_chars and timeout_s must be > 0")
        if not self.code_start or not self.code_end:
            raise ConfigError("tool: code_start and code_end must be non-empty markers")
        self.sandbox.check()


@dataclass(frozen=True)
class ToolCall:
    """One call: its code, how it ran, and the text appended after it (the observation, wrapped in the
    output markers: `appended[data[0]:data[1]]` is the observation)."""

    code: str
    execution: Execution
    appended: str
    truncated: bool
    data: tuple[int, int] | None = None

    def reply(self) -> Reply:
        return Reply(self.appended, data=self.data, calls=(self,))


class PythonTool(Environment):
    """The Python tool of tool-integrated reasoning: a segment ending on a closed code block is a call, whose
    output is the reply; one that ends otherwise is the answer. A batch's calls run side by side."""

    stop_reasons = ("max_calls",)
    concurrent_replies = True  # the sandbox is thread-safe; its workers are shared by the batches calling

    def __init__(self, settings: PythonToolSettings = PythonToolSettings()) -> None:
        settings.check()
        self.settings = settings
        self._sandbox: Sandbox | None = None
        self._starting = threading.Lock()  # one sandbox, however many batches call first at once

    @property
    def stop(self) -> tuple[str, ...]:
        """Where generation stops for a call: the block's closing marker."""
        return (self.settings.code_end,)

    @property
    def max_turns(self) -> int:
        return 2 * self.settings.max_calls + 2  # a marker that closes no code block resumes without a call

    def reply(self, episodes: Sequence[Episode]) -> list[Reply]:
        """A call's output, the end of the answer, or nothing appended; each reply carries the call it made
        (`Reply.calls`) and, after a void turn (neither a call nor an answer), the episode's count of them."""
        replies: list[Reply | None] = [None] * len(episodes)
        notes: list[dict[str, int]] = [{} for _ in episodes]
        to_run: list[tuple[int, str]] = []
        for i, episode in enumerate(episodes):
            at_marker = episode.stopped_at is not None
            code = self.code_of(episode.segment) if at_marker else None
            if code is None and (at_marker or extract_prediction(episode.segment) is None):
                notes[i] = {"void_turns": episode.state.get("void_turns", 0) + 1}
            if episode.stop is not None:  # out of budget: its code is not run
                replies[i] = Reply(None, episode.stop)
            elif code is not None and len(episode.calls) >= self.settings.max_calls:
                replies[i] = Reply(None, "max_calls")
            elif code is not None:
                to_run.append((i, code))
            else:  # the answer, or a marker that closed no code block: sample on with nothing appended
                replies[i] = Reply("") if at_marker else Reply(None, "answered")
        for (i, _), call in zip(to_run, self.run([code for _, code in to_run])):
            replies[i] = call.reply()
        return [replace(r, notes=n) if n else r for r, n in zip(replies, notes)]  # type: ignore[arg-type]

    def excluded(self, episode: Episode) -> str:
        """The stability guard that leaves this answer out of the loss, or "" (`PythonToolSettings.drop_*`)."""
        s = self.settings
        if s.drop_void_turns and episode.state.get("void_turns", 0):
            return "void_turn"
        if s.drop_max_calls and episode.stop == "max_calls":
            return "max_calls"
        if s.drop_timeouts and timed_out(episode):
            return "timeout"
        return ""

    def metrics(self, episodes: Sequence[Episode]) -> dict[str, float]:
        """Calls per answer, the share of answers that call, how calls ended, outputs cut, call latency, and the
        shares of answers with a void turn, with a timed-out call, and that the stability guards leave out."""
        n = max(1, len(episodes))
        calls = [c for e in episodes for c in e.calls]
        ended = [c.execution.status for c in calls]
        seconds = sorted(c.execution.seconds for c in calls)
        per_call = max(1, len(calls))
        return {
            "tool_calls_per_answer": len(calls) / n,
            "tool_answers_with_call": sum(bool(e.calls) for e in episodes) / n,
            "tool_success_frac": ended.count("ok") / per_call,
            "tool_error_frac": ended.count("error") / per_call,
            "tool_timeout_frac": ended.count("timeout") / per_call,
            "tool_output_truncated_frac": sum(c.truncated for c in calls) / per_call,
            "tool_latency_p50_ms": 1000 * seconds[len(seconds) // 2] if seconds else 0.0,
            "tool_latency_p95_ms": 1000 * seconds[int(0.95 * (len(seconds) - 1))] if seconds else 0.0,
            "tool_void_turn_answers": sum(bool(e.state.get("void_turns", 0)) for e in episodes) / n,
            "tool_timed_out_answers": sum(timed_out(e) for e in episodes) / n,
            "tool_excluded_answers": sum(bool(self.excluded(e)) for e in episodes) / n,
        }

    def code_of(self, text: str) -> str | None:
        """The code of the block that `text` (everything the model wrote so far) closes at its end, or None when
        it does not end on a closed code block."""
        s = self.settings
        end = text.rfind(s.code_end)
        if end == -1 or text[end + len(s.code_end) :].strip():
            return None
        start = text.rfind(s.code_start, 0, end)
        if start == -1:
            return None
        code = text[start + len(s.code_start) : end]
        return None if s.code_end in code else code  # the marker closed another block (an output the model wrote)

    def run(self, codes: list[str]) -> list[ToolCall]:
        """Run each code in the sandbox (as many at once as it has workers), with the text each appends."""
        with self._starting:
            if self._sandbox is None:
                self._sandbox = Sandbox(self.settings.sandbox)
        s = self.settings
        calls = []
        for code, execution in zip(codes, self._sandbox.run_many(codes, s.timeout_s)):
            text, truncated = observation(execution, s.timeout_s, s.observation_chars)
            start = len(s.output_start)
            appended = f"{s.output_start}{text}{s.output_end}"
            calls.append(ToolCall(code, execution, appended, truncated, (start, start + len(text))))
        return calls

    def load_call(self, saved: dict) -> ToolCall:
        data = saved.get("data")
        return ToolCall(**{**saved, "execution": Execution(**saved["execution"]), "data": tuple(data) if data else None})

    def describe(self) -> str:
        """The sandbox's workers, for the watchdog's report."""
        return self._sandbox.describe() if self._sandbox is not None else "sandbox not started"

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None


def environment_of(
    tool: PythonToolSettings | None, environment: Environment | None, options: tuple[str, str]
) -> Environment | None:
    """The environment answers are generated in: the Python tool (`tool`), one's own, or None (one segment per
    answer). Both is a one-line error naming the two `options` that set them."""
    if tool is not None and environment is not None:
        raise ConfigError(f"{options[0]} and {options[1]}: set one (the Python tool is an environment)")
    return PythonTool(tool) if tool is not None else environment


def timed_out(episode: Episode) -> bool:
    return any(c.execution.status == "timeout" for c in episode.calls)
