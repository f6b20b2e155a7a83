"""A benchmark read with a limit and a prompt-length bound (`make eval --limit N`): the first N problems whose prompt
fits, however many before them are too long, reading the source no further than they take."""

from __future__ import annotations

import json

import pytest

from rlvr_lightning.data.datamodule import RolloutDataModule


@pytest.fixture
def dm(tiny_policy_dir, tmp_path):
    dm = RolloutDataModule(model_name_or_path=str(tiny_policy_dir), train_data="embedded", val_data=None, batch_size=2)
    dm.setup("validate")
    return dm


def write(path, problems: list[str]) -> str:
    path.write_text("".join(json.dumps({"problem": p, "answer": "1"}) + "\n" for p in problems))
    return str(path)


def test_the_limit_counts_problems_that_fit_not_problems_read(dm, tmp_path, caplog):
    long, short = "x " * 300, "1+0?"
    source = write(tmp_path / "bench.jsonl", [long] * 5 + [f"{short} {i}" for i in range(4)] + [long, "9+0?"])
    room = len(dm.prompt_ids(short + " 0")) + 2
    kept = dm.load_records(source, max_prompt_tokens=room, limit=3)
    assert [r.problem for r in kept] == [f"{short} {i}" for i in range(3)]
    assert "dropped 5 of 8 problems" in caplog.text  # those before the last one kept
    assert len(dm.load_records(source, max_prompt_tokens=room, limit=20)) == 5  # all that fit: the source ran out
    assert len(dm.load_records(source, max_prompt_tokens=room)) == 5
    assert dm.load_records(source, max_prompt_tokens=room, limit=0) == []
    assert [r.problem for r in dm.load_records(source, limit=2)] == [long, long]  # no bound: the first two read
