"""The Python tool's task (`embedded-multiply`) and its warm start's demonstrations: a held-out split, calls whose
output block is exactly what the real tool appends, and that output left out of the warm start's loss."""

from __future__ import annotations

import random
import shutil

import pytest

from rlvr_lightning.data.sources import embedded_records
from rlvr_lightning.environments.python_tool import PythonTool, PythonToolSettings
from rlvr_lightning.models.embedded import build_char_tokenizer
from rlvr_lightning.models.multiplication_task import (
    TEST_SIZE,
    TRAIN_SIZE,
    MultiplicationProblem,
    flawed_demonstration,
    mistyped,
    train_test_split,
)
from rlvr_lightning.models.warm_start import EMBEDDED_WARM_STARTS, WarmStartConfig, _pack_right_padded, _target
from rlvr_lightning.sandbox import SandboxSettings


def test_the_split_is_seeded_disjoint_and_three_digit():
    train, test = train_test_split(seed=0)
    assert (len(train), len(test)) == (TRAIN_SIZE, TEST_SIZE)
    assert not {p.id for p in train} & {p.id for p in test} and len({p.id for p in train}) == TRAIN_SIZE
    assert all(100 <= p.a <= 999 and 100 <= p.b <= 999 for p in train + test)
    assert train_test_split(seed=0) == (train, test) and train_test_split(seed=1)[1] != test
    record = embedded_records("test", task="embedded-multiply")[0]
    assert (record.id, record.problem, record.answer) == (test[0].id, f"What is {test[0].a}*{test[0].b}?\n", str(test[0].value))


def test_a_mistyped_factor_differs_in_one_digit_and_keeps_three():
    rng = random.Random(0)
    for n in (100, 347, 999):
        for _ in range(50):
            m = mistyped(n, rng)
            assert 100 <= m <= 999 and sum(x != y for x, y in zip(str(n), str(m))) == 1


def test_demonstrations_call_the_tool_at_the_set_rate_and_slip_in_the_code():
    rng, problem = random.Random(0), MultiplicationProblem(347, 862)
    demos = [flawed_demonstration(problem, rng, tool_prob=0.3, slip_prob=0.5) for _ in range(2000)]
    calls = [d for d in demos if len(d) == 3]
    assert 0.26 < len(calls) / len(demos) < 0.34
    assert all(d == [("\\boxed{299114}", True)] for d in demos if len(d) == 1)  # the answer in the head
    right = [d for d in calls if d[0][0] == "```python\nprint(347*862)\n```\n"]
    assert 0.4 < len(right) / len(calls) < 0.6
    assert right[0][1:] == [("```output\n299114\n```\n", False), ("\\boxed{299114}", True)]
    for (call, _), (output, trained), (answer, _) in calls:  # a slip: the output and answer follow the mistyped code
        a, b = map(int, call.removeprefix("```python\nprint(").removesuffix(")\n```\n").split("*"))
        assert not trained and output == f"```output\n{a * b}\n```\n" and answer == f"\\boxed{{{a * b}}}"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_a_demonstrations_output_is_what_the_tool_appends():
    """The warm start teaches the tool's own format: its call, run by the real tool in the sandbox, appends exactly
    the demonstration's output block (the task's markers are `PythonToolSettings`' defaults)."""
    rng = random.Random(1)
    demos = [d for p in train_test_split()[0][:40] if len(d := flawed_demonstration(p, rng, 1.0, 0.3)) == 3]
    tool = PythonTool(PythonToolSettings(sandbox=SandboxSettings(workers=2)))
    try:
        codes = [tool.code_of(call) for (call, _), _, _ in demos]
        assert None not in codes
        calls = tool.run(codes)
    finally:
        tool.close()
    assert [c.appended for c in calls] == [output for _, (output, _), _ in demos]


def test_the_warm_start_trains_on_the_call_and_the_answer_not_on_the_output():
    tokenizer = build_char_tokenizer()
    pieces = [("```python\nprint(1*2)\n```\n", True), ("```output\n2\n```\n", False), ("\\boxed{2}", True)]
    prompt = tokenizer("What is 1*2?\n").input_ids
    ids, labels, _ = _pack_right_padded([prompt], [_target(tokenizer, pieces)], tokenizer.pad_token_id)
    whole = tokenizer("".join(text for text, _ in pieces)).input_ids + [tokenizer.eos_token_id]
    assert ids[0].tolist() == prompt + whole  # the model reads the output block
    n_call, n_output = (len(tokenizer(text).input_ids) for text, _ in pieces[:2])
    trained = labels[0, len(prompt) :].tolist()
    assert trained[:n_call] == whole[:n_call] and trained[n_call + n_output :] == whole[n_call + n_output :]
    assert trained[n_call : n_call + n_output] == [-100] * n_output and labels[0, : len(prompt)].eq(-100).all()


def test_fields_added_to_the_warm_start_leave_earlier_caches_valid():
    """The default's and `embedded-balanced`'s cache keys as they were before `task` and `tool_prob` existed."""
    assert WarmStartConfig().key() == "9dfdb7b3b330"
    assert EMBEDDED_WARM_STARTS["embedded-balanced"].key() == "5a678b70b378"
    assert EMBEDDED_WARM_STARTS["embedded-tir"].key() not in ("9dfdb7b3b330", WarmStartConfig(tool_prob=0.2).key())
