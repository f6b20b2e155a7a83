"""What the model reads back from a call: the TIR recipes' observation (ToRL, SimpleTIR). Standard output, cut
to its head and tail when long; an error as its last line only (the exception, not the traceback: the model
needs what went wrong, and a traceback would spend its tokens on the library's frames); a time-out or an
output flood said in one line."""

from __future__ import annotations

import re

from rlvr_lightning.sandbox.pool import Execution

# Terminal escape sequences (CSI `ESC [ … final`, OSC `ESC ] … BEL/ST`, then ESC, intermediates and a final byte:
# a character set, a reset), then every control character but newline and tab: the observation reaches the
# model, logs and MLflow as plain text.
ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[ -/]*[0-~]")
CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def plain_text(text: str) -> str:
    """`text` with terminal escape sequences and control characters (but newline and tab) removed."""
    return CONTROLS.sub("", ESCAPES.sub("", text))


def cut_middle(text: str, max_chars: int) -> tuple[str, bool]:
    """`text` with its middle cut to fit `max_chars` (head and tail kept, the cut said), and whether it was cut."""
    if len(text) <= max_chars:
        return text, False
    marker = f"\n… [{len(text) - max_chars} characters cut] …\n"
    keep = max(0, max_chars - len(marker))
    head = keep - keep // 2
    return text[:head] + marker + text[len(text) - keep // 2 :], True


def last_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def observation(execution: Execution, timeout_s: float, max_chars: int) -> tuple[str, bool]:
    """The text appended after a call, and whether it was truncated (cut here or at the sandbox's output cap)."""
    out = execution.stdout
    if execution.status == "error":
        out += last_line(execution.stderr)
    elif execution.status == "timeout":
        out += f"TimeoutError: the code ran longer than {timeout_s:g} s"
    elif execution.status == "output_limit":
        out += "… [output too long: stopped]"
    elif execution.status == "crashed":
        out += "Error: the code's sandbox stopped"
    text, cut = cut_middle(plain_text(out).rstrip("\n"), max_chars)
    return text, cut or execution.status == "output_limit"
