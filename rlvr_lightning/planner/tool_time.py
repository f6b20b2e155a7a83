"""What the Python tool (`data.tool`) adds to a step: its calls' wall time on the sandbox's workers, and the
tokens its outputs take from the response budget.

A batch's episodes reach their calls turn by turn: in a turn the rank's calls run on its `sandbox.workers`
side by side while the engine waits (`environments.episodes`), so N answers making c calls each take about
⌈N·c / workers⌉ call times (expected: `plan.tool_calls_per_answer`, default the most, `max_calls`, at
`plan.tool_call_ms`), and at the worst every answer makes `max_calls` calls that each run to the time limit:
max_calls · ⌈N / workers⌉ · timeout_s. With `rollout.stream.max_staleness` ≥ 1 this runs beside the update, with the
rest of generation. An output's tokens are inside `rollout.max_response_length` (so in the memory plan); the
generation model prices them as decoded tokens although vLLM prefills them, which overestimates a little.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A warm sandbox call that imports sympy and prints a result, the median on a 2-core CPU machine with both
# workers busy (bench/sandbox.py, bench/results/sandbox.json: 63 ms; a call that only prints: 7 ms).
DEFAULT_CALL_MS = 63.0


@dataclass(frozen=True)
class ToolPlan:
    max_calls: int  # data.tool.max_calls
    calls_per_answer: float  # expected (plan.tool_calls_per_answer; default max_calls)
    call_s: float  # a call's expected wall time (plan.tool_call_ms)
    timeout_s: float  # data.tool.timeout_s: a call's limit
    workers: int  # data.tool.sandbox.workers: calls that run at once
    output_tokens: int  # the most one call's output adds: its characters, wrapped (a token holds ≥ 1 ASCII character)

    def seconds(self, sequences: int, worst: bool = False) -> float:
        """A rank's tool time per step for its `sequences` answers."""
        if worst:
            return self.max_calls * math.ceil(sequences / self.workers) * self.timeout_s
        return math.ceil(sequences * self.calls_per_answer / self.workers) * self.call_s

    def describe(self, response_budget: int) -> str:
        most = self.max_calls * self.output_tokens
        share = f"{most:,} of the {response_budget:,}-token response budget" + (" (all of it)" if most >= response_budget else "")
        return (
            f"Python tool: {self.calls_per_answer:g} calls per answer expected at {self.call_s * 1e3:.0f} ms, at the worst "
            f"{self.max_calls} at the {self.timeout_s:g} s limit, on {self.workers} sandbox workers, in generation; "
            f"its outputs, up to {self.output_tokens:,} tokens a call: {share}"
        )


def tool_plan(tool, plan) -> ToolPlan | None:
    """The ToolPlan of a parsed `data.tool` (None: no tool) and `plan:` section."""
    if tool is None:
        return None
    expected = getattr(plan, "tool_calls_per_answer", None)
    call_ms = getattr(plan, "tool_call_ms", None)
    wrap = len(tool.output_start) + len(tool.output_end)  # a cut output says so within observation_chars
    return ToolPlan(
        max_calls=tool.max_calls,
        calls_per_answer=tool.max_calls if expected is None else min(expected, tool.max_calls),
        call_s=(DEFAULT_CALL_MS if call_ms is None else call_ms) / 1e3,
        timeout_s=tool.timeout_s,
        workers=tool.sandbox.workers,
        output_tokens=tool.observation_chars + wrap,
    )
