"""What the model reads back from a call: the TIR recipes' observation (ToRL, SimpleTIR). Standard output, cut
to its head and tail when long; an error as its last line only (the exception, not the traceback: the model
needs what went wrong, and a traceback would spend its tokens on the library's frames); a time-out or an
output flood said in one line."""

from __future__ import annotations

from rlvr_lightning.sandbox.pool import Execution


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
    text, cut = cut_middle(out.rstrip("\n"), max_chars)
    return text, cut or execution.status == "output_limit"
