"""The Python tool: finding the code a segment closes, running a batch in the sandbox, and multi-turn
generation with it on the real engines: token-in/token-out, masks, budgets and limits."""

from __future__ import annotations

import shutil

import pytest

from rlvr_lightning.environments.python_tool import PythonTool, PythonToolSettings
from rlvr_lightning.sandbox import SandboxSettings

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


@pytest.mark.parametrize(
    "text, code",
    [
        ("Let me compute.\n```python\nprint(347 * 829)\n```\n", "print(347 * 829)"),
        ("a\n```python\nx = 1\n```\n```output\n1\n```\nthen\n```python\nprint(x + 1)\n```\n", "print(x + 1)"),
        ("```python\nprint(1)\n```\n  ", "print(1)"),  # a token that ran past the marker: whitespace only
        ("no code here", None),
        ("```python\nprint(1)\n```\nand more text", None),  # the block is not where the segment ends
        ("```python\nx\n```\n```output\n1\n```\n", None),  # the marker closes an output block the model wrote
        ("plain\n```\nblock\n```\n", None),  # a block without the python marker
    ],
)
def test_the_code_a_segment_ends_with(text, code):
    assert PythonTool().code_of(text) == code


@needs_bwrap
def test_a_batch_of_calls_reads_as_the_model_sees_it():
    tool = PythonTool(PythonToolSettings(timeout_s=1.0, observation_chars=60, sandbox=SandboxSettings(workers=2)))
    try:
        calls = tool.run(["print(347 * 829)", "1/0", "while True: pass", "print('y' * 500)", "x = 6\nx * 7"])
    finally:
        tool.close()
    assert [c.appended for c in calls[:3]] == [
        "```output\n287663\n```\n",
        "```output\nZeroDivisionError: division by zero\n```\n",
        "```output\nTimeoutError: the code ran longer than 1 s\n```\n",
    ]
    assert calls[3].truncated and len(calls[3].appended) <= 60 + len("```output\n\n```\n")
    assert calls[4].appended == "```output\n42\n```\n"  # nothing printed: the last expression's value
    assert [c.execution.status for c in calls] == ["ok", "error", "timeout", "ok", "ok"]


def inserted_spans(sampled_mask: list[bool]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, s in enumerate([*sampled_mask, True]):
        if not s and start is None:
            start = i
        elif s and start is not None:
            spans.append((start, i))
            start = None
    return spans


@needs_bwrap
@pytest.mark.parametrize("engine", ["hf"])  # vLLM's stop-string path: tests/e2e/test_tool_run.py (mismatch < 1e-3)
def test_episodes_on_a_real_engine_keep_the_sampled_ids_and_insert_the_outputs_ids(quick_warm_start, engine):
    """The warm start boxes an answer in most completions; with `\\boxed{` … `}` as the tool's markers each
    boxed answer is a call (its content runs as code), so a real engine calls the tool often. Every episode's
    ids are its sampled segments with each output's own tokenization between them, inserted tokens carry no
    log-prob, the budget holds, and the trainer's log-probs of the whole sequence equal the engine's on every
    sampled token (the engine saw exactly these ids: nothing was decoded and encoded again)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlvr_lightning.data.datamodule import RolloutDataModule
    from rlvr_lightning.environments.episodes import generate_episodes
    from rlvr_lightning.evaluate import model_engine
    from rlvr_lightning.models.forward import sequence_logprobs
    from rlvr_lightning.rollout.settings import RolloutSettings

    _, model_dir = quick_warm_start
    budget = 48
    dm = RolloutDataModule(model_name_or_path=str(model_dir), batch_size=4, rollout=RolloutSettings(engine=engine, max_response_length=budget))
    dm.setup("fit")
    tok = dm.tokenizer
    batch = dm.collate(dm.train_records[:4])
    prompts = [tok(p, add_special_tokens=False).input_ids for p in batch.prompts]
    settings = PythonToolSettings(max_calls=2, code_start="\\boxed{", code_end="}", timeout_s=2.0, sandbox=SandboxSettings(workers=2))
    tool, eng = PythonTool(settings), model_engine(dm)
    try:
        sampling = dm.rollout.sampling(group_size=4, seed=0)
        groups = generate_episodes(eng, tok, prompts, sampling, tool)
    finally:
        tool.close()
        eng.close()
    episodes = [e for g in groups for e in g]
    assert len(groups) == 4 and all(len(g) == 4 for g in groups)
    assert sum(len(e.calls) for e in episodes) >= 4  # the tool was called
    assert {e.stop for e in episodes} <= {"answered", "max_calls", "length"} and all(len(e.calls) <= 2 for e in episodes)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for e in episodes:
        c = e.completion(tool.excluded(e))
        assert len(c.token_ids) <= budget and len(c.token_ids) == len(c.logprobs)
        spans = inserted_spans(c.sampled_mask)
        outputs = [tok(call.appended, add_special_tokens=False).input_ids for call in e.calls]
        assert len(spans) == len(outputs)
        for (a, b), ids in zip(spans, outputs):
            assert c.token_ids[a:b] == ids[: b - a] and (b - a == len(ids) or e.stop == "length")
            assert all(lp == 0.0 for lp in c.logprobs[a:b])
        trainer = sequence_logprobs(policy, e.prompt, c.token_ids)
        sampled = [i for i, s in enumerate(c.sampled_mask) if s]
        assert max(abs(trainer[i] - c.logprobs[i]) for i in sampled) < 2e-3


def test_a_shaper_that_would_weigh_inserted_tokens_is_refused_in_one_line():
    from rlvr_lightning.errors import ConfigError
    from rlvr_lightning.training.checks import check_environment

    check_environment("data.tool", ())
    with pytest.raises(ConfigError, match=r"^data.environment with MyShaper: it does not leave the inserted"):
        check_environment("data.environment", ("MyShaper",))


def test_the_reward_reads_the_models_own_words_not_what_the_tool_printed():
    """A call that prints the boxed answer cannot answer for the model: the verifier scores the model's own text."""
    import torch

    from rlvr_lightning.rewards.settings import RewardSettings, VerifierSettings
    from rlvr_lightning.rollout.types import Completion, PromptBatch, Rollout, SamplingConfig
    from rlvr_lightning.training.scoring import Scoring

    model = "```python\nprint(chr(92) + 'boxed{' + str(6 * 7) + '}')\n```\n"  # the model's own words hold no box
    printed = "```output\n\\boxed{42}\n```\n"
    texts = [model + printed, model + printed + "So \\boxed{42}."]
    own = [model, model + "So \\boxed{42}."]
    rollout = Rollout(
        batch=PromptBatch(["p"], ["6 * 7?"], ["42"]), group_size=2, prompt_ids=[[1]],
        completions=[Completion([1], [0.0], "stop"), Completion([1], [0.0], "stop")],
        sampling=SamplingConfig(group_size=2), policy_version=0, texts=texts, own_texts=own,
    )  # fmt: skip
    scoring = Scoring(RewardSettings(verifier=VerifierSettings(num_workers=1)))
    try:
        scored = scoring.score(rollout)
    finally:
        scoring.close()
    assert torch.equal(scored.correct, torch.tensor([0.0, 1.0]))


HOSTILE_CALLS = [
    "import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('1.1.1.1', 53))",
    "print(open('/etc/shadow').read())",
    "import os\nprint(dict(os.environ))",
    "open('/usr/planted', 'w').write('x')",
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "x = bytearray(8 * 1024 ** 3)",
    "while True:\n    pass",
    "while True:\n    print('x' * 1000)",
    "f = open('/tmp/flood', 'wb')\nwhile True:\n    f.write(b'x' * 65536)",
    "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    "import os\nif os.fork() == 0:\n    os.setsid()\n    import time\n    time.sleep(600)\nprint('left a daemon')",
    "import os\nos.setuid(0)",
]


@needs_bwrap
def test_hostile_calls_in_a_batch_leave_the_tool_serving_and_their_outputs_bounded():
    """What a run's answers would call: each hostile program ends with a bounded output the model reads, and the
    next batch of calls runs as usual (tests/sandbox/test_hostile.py checks each one's containment)."""
    settings = PythonToolSettings(timeout_s=1.0, observation_chars=200, sandbox=SandboxSettings(workers=2, memory_mb=256, tmp_mb=16, processes=32))
    tool = PythonTool(settings)
    try:
        calls = tool.run(HOSTILE_CALLS)
        after = tool.run(["print(6 * 7)", "import sympy\nsympy.isprime(97)"])
    finally:
        tool.close()
    wrap = len(settings.output_start) + len(settings.output_end)
    assert all(len(c.appended) <= 200 + wrap for c in calls)
    assert {c.execution.status for c in calls} <= {"ok", "error", "timeout", "output_limit"}
    assert "SECRET" not in "".join(c.appended for c in calls) and "root:" not in calls[1].appended
    assert [c.appended for c in after] == ["```output\n42\n```\n", "```output\nTrue\n```\n"]


def test_the_stability_guards_leave_their_answers_out_of_the_loss(tiny_policy_dir):
    """Each guard is off by default; on, it excludes its answers (SimpleTIR's void turns, the call limit, a timed-out
    call), and the step's loss mask is zero on every token of an excluded answer and untouched elsewhere."""
    from dataclasses import replace

    from rlvr_lightning.algos import GRPO
    from rlvr_lightning.environments.episodes import Episode
    from rlvr_lightning.environments.python_tool import ToolCall
    from rlvr_lightning.sandbox import Execution
    from tests.support.update_harness import attach, prepared, sample_rollout

    timed_out = ToolCall("while True: pass", Execution("", "", "timeout", None, 1.0), "", False)
    void = Episode([1], state={"void_turns": 1}, stop="answered")
    capped = Episode([1], stop="max_calls")
    slow = Episode([1], calls=[timed_out], stop="answered")
    fine = Episode([1], stop="answered")
    off = PythonTool()
    assert [off.excluded(e) for e in (void, capped, slow, fine)] == ["", "", "", ""]
    on = PythonTool(PythonToolSettings(drop_void_turns=True, drop_max_calls=True, drop_timeouts=True))
    assert [on.excluded(e) for e in (void, capped, slow, fine)] == ["void_turn", "max_calls", "timeout", ""]

    module = attach(GRPO, tiny_policy_dir)
    rollout = sample_rollout(module)
    completions = list(rollout.completions)
    for n in (1, 6):
        completions[n] = replace(completions[n], excluded="void_turn")
    inputs = prepared(module, replace(rollout, completions=completions))
    rows = inputs.loss_mask.sum(1)
    assert rows[1] == 0 and rows[6] == 0
    assert all(rows[n] == len(rollout.completions[n].token_ids) for n in range(8) if n not in (1, 6))


def test_the_tool_writes_nothing_into_the_episodes_its_calls_and_notes_come_back_in_the_replies(monkeypatch):
    """`reply` reads the episodes: a call's record and a void turn's count are returned in the `Reply` for the
    episode loop to keep, not written into the loop's `Episode` (no sandbox: the run is stood in for)."""
    from dataclasses import replace

    from rlvr_lightning.environments.base import Reply
    from rlvr_lightning.environments.episodes import Episode
    from rlvr_lightning.environments.python_tool import ToolCall
    from rlvr_lightning.sandbox import Execution

    tool = PythonTool(PythonToolSettings(max_calls=2))
    ran = ToolCall("print(1)", Execution("1\n", "", "ok", 0, 0.01), "```output\n1\n```\n", False, (10, 12))
    monkeypatch.setattr(tool, "run", lambda codes: [replace(ran, code=code) for code in codes])
    calling = Episode([1], segment="```python\nprint(1)\n```\n", stopped_at="\n```\n", turns=1)
    void = Episode([1], segment="I am not sure.", turns=2, state={"void_turns": 1})
    answered = Episode([1], segment="So \\boxed{3}.", turns=1)
    before = [(e.calls.copy(), dict(e.state)) for e in (calling, void, answered)]
    call, again, answer = tool.reply([calling, void, answered])
    assert [(e.calls, e.state) for e in (calling, void, answered)] == before  # untouched
    assert call.calls == (replace(ran, code="print(1)"),) and call.text == ran.appended and not call.notes
    assert again.text is None and again.notes == {"void_turns": 2} and not again.calls
    assert answer == Reply(None, "answered")
