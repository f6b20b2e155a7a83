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

from dataclasses import dataclass, field

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.sandbox import Execution, Sandbox, SandboxSettings
from rlvr_lightning.sandbox.observation import observation


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
    """One call: its code, how it ran, and the text appended after it (the observation, wrapped)."""

    code: str
    execution: Execution
    appended: str
    truncated: bool


class PythonTool:
    """The tool of a run: finds the code a segment ends with and runs a batch of them side by side."""

    def __init__(self, settings: PythonToolSettings = PythonToolSettings()) -> None:
        settings.check()
        self.settings = settings
        self._sandbox: Sandbox | None = None

    @property
    def stop(self) -> tuple[str, ...]:
        """Where generation stops for a call: the block's closing marker."""
        return (self.settings.code_end,)

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
        if self._sandbox is None:
            self._sandbox = Sandbox(self.settings.sandbox)
        s = self.settings
        calls = []
        for code, execution in zip(codes, self._sandbox.run_many(codes, s.timeout_s)):
            text, truncated = observation(execution, s.timeout_s, s.observation_chars)
            calls.append(ToolCall(code, execution, f"{s.output_start}{text}{s.output_end}", truncated))
        return calls

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None
