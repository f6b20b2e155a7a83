"""What the model reads back from a call (the TIR recipes' format), and `python -m rlvr_lightning.sandbox`."""

from __future__ import annotations

import pytest

from rlvr_lightning.sandbox.observation import cut_middle, last_line, observation
from rlvr_lightning.sandbox.pool import Execution


def execution(stdout="", stderr="", status="ok"):
    return Execution(stdout, stderr, status, 0 if status == "ok" else 1, 0.01)


def test_a_long_output_keeps_its_head_and_tail_within_the_limit():
    text = "".join(str(i % 10) for i in range(1000))
    cut, was_cut = cut_middle(text, 100)
    assert was_cut and len(cut) == 100
    assert cut.startswith(text[:10]) and cut.endswith(text[-10:]) and "[900 characters cut]" in cut
    assert cut_middle("short", 100) == ("short", False)


@pytest.mark.parametrize(
    "result, expected",
    [
        (execution("42\n"), "42"),
        (execution("partial\n", "Traceback (most recent call last):\n  File ...\nValueError: bad\n", "error"), "partial\nValueError: bad"),
        (execution("", "", "timeout"), "TimeoutError: the code ran longer than 5 s"),
        (execution("xxxx", "", "output_limit"), "xxxx… [output too long: stopped]"),
        (execution("", "the sandbox worker died", "crashed"), "Error: the code's sandbox stopped"),
    ],
)
def test_each_ending_reads_as_the_recipes_show_it(result, expected):
    text, truncated = observation(result, timeout_s=5.0, max_chars=1000)
    assert text == expected
    assert truncated == (result.status == "output_limit")
    assert last_line("a\n\nKeyError: 'x'\n\n") == "KeyError: 'x'"


def test_the_sandbox_command_prints_what_the_model_reads(tmp_path, capsys):
    from rlvr_lightning.sandbox.__main__ import main
    from tests.sandbox.test_hostile import needs_bwrap

    if needs_bwrap.args[0]:
        pytest.skip(needs_bwrap.kwargs["reason"])
    program = tmp_path / "tool.py"
    program.write_text("import sympy\nx = sympy.symbols('x')\nsympy.solve(x**2 - 5*x + 6, x)\n")
    assert main([str(program)]) == 0
    out, err = capsys.readouterr()
    assert out == "```output\n[2, 3]\n```\n" and err.startswith("[ok, exit code 0,")
    program.write_text("def f():\n    return {}['k']\nf()\n")
    assert main([str(program)]) == 1
    out, _ = capsys.readouterr()
    assert out == "```output\nKeyError: 'k'\n```\n"


def test_an_unisolated_sandbox_runs_only_when_asked_and_cleans_up(tmp_path):
    """`isolation: none` (the user's explicit choice) still limits time and output and keeps its files in a
    private directory that goes with the worker."""
    import glob
    import tempfile

    from rlvr_lightning.sandbox import Sandbox, SandboxSettings

    before = set(glob.glob(f"{tempfile.gettempdir()}/rlvr-sandbox-*"))
    with Sandbox(SandboxSettings(isolation="none", workers=1, timeout_s=1.0, output_bytes=1000)) as box:
        assert box.run("open('f.txt', 'w').write('x')\nimport os\nprint(sorted(os.listdir('.')))").stdout == "['f.txt']\n"
        assert box.run("import os\nprint(os.listdir('.'))").stdout == "[]\n"  # the call's files are gone
        assert box.run("while True:\n    pass").status == "timeout"
        assert box.run("print('x' * 10**6)").status == "output_limit"
    assert set(glob.glob(f"{tempfile.gettempdir()}/rlvr-sandbox-*")) == before


def test_without_isolation_the_sandbox_refuses_in_one_line(tmp_path, monkeypatch):
    from rlvr_lightning.sandbox import Sandbox, SandboxSettings, SandboxUnavailable

    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on this PATH
    with pytest.raises(SandboxUnavailable, match=r"bubblewrap \(bwrap\) is not installed.*isolation to `none`") as e:
        Sandbox(SandboxSettings(workers=1))
    assert "\n" not in str(e.value)


def test_terminal_escapes_and_control_characters_never_reach_the_model():
    """Escape sequences (colour, a window title, cursor moves), NUL and other control characters are removed
    from what the model reads (and logs and MLflow show); newlines and tabs stay."""
    out = "\x1b[31mred\x1b[0m\t\x1b]0;title\x07ok\x00\r\x08\x1bc\x7f\u0085done\n"
    text, _ = observation(execution(out), timeout_s=5.0, max_chars=1000)
    assert text == "red\tokdone"
    error, _ = observation(execution("", "Traceback\n\x1b[1mValueError: \x00bad\x1b[0m\n", "error"), 5.0, 1000)
    assert error == "ValueError: bad"
