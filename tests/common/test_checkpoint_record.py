"""`last.json` and `last.ckpt` never disagree after a kill, and a checkpoint changed after it was written is refused
(`checkpoint_record.py`): every point a save can be killed at, on real files."""

from __future__ import annotations

import os

import pytest

from rlvr_lightning import checkpoint_record as record
from rlvr_lightning.errors import ConfigError


def save(directory, batch: int, content: bytes, stop_after: str | None = None) -> None:
    """The save's order (`ResumableCheckpoint.save`), stopping where a kill would."""
    tmp, last = directory / "last.ckpt.tmp", directory / "last.ckpt"
    tmp.write_bytes(content)
    if stop_after == "write":
        return
    record.write(directory, {"rollout_batches": batch, "checkpoint": str(last), "sha256": record.digest(tmp)})
    if stop_after == "record":
        return
    os.replace(tmp, last)


@pytest.mark.parametrize("killed_after", ["write", "record"])
def test_a_save_killed_at_any_point_leaves_a_checkpoint_its_record_vouches_for(tmp_path, killed_after):
    save(tmp_path, 2, b"weights at batch 2")
    save(tmp_path, 4, b"weights at batch 4", stop_after=killed_after)
    assert record.verify(tmp_path / "last.ckpt")["rollout_batches"] == 2  # the old checkpoint, as its record says
    assert record.tidy(tmp_path) == ["last.ckpt.tmp"] and not (tmp_path / "last.ckpt.tmp").exists()
    save(tmp_path, 6, b"weights at batch 6")
    assert record.verify(tmp_path / "last.ckpt")["rollout_batches"] == 6


def test_a_checkpoint_changed_after_it_was_written_is_refused_in_one_line(tmp_path):
    save(tmp_path, 2, b"weights at batch 2")
    save(tmp_path, 4, b"weights at batch 4")
    (tmp_path / "last.ckpt").write_bytes(b"weights at batch 4, one bit flipped")
    with pytest.raises(ConfigError, match=r"does not match its record .*for rollout batch 4\)") as refused:
        record.verify(tmp_path / "last.ckpt")
    assert "\n" not in str(refused.value)
    (tmp_path / "last.ckpt").write_bytes(b"weights at batch 2")  # the one before: a kill between the renames
    assert record.verify(tmp_path / "last.ckpt")["rollout_batches"] == 2


def test_a_sharded_checkpoint_is_digested_whole_and_one_moved_aside_is_put_back(tmp_path):
    shards = tmp_path / "last.ckpt.tmp"
    shards.mkdir()
    for rank in range(2):
        (shards / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 1000)
    (shards / ".metadata").write_bytes(b"meta")
    record.write(
        tmp_path, {"rollout_batches": 2, "checkpoint": str(tmp_path / "last.ckpt"), "sha256": record.digest(shards)}
    )
    os.replace(shards, tmp_path / "last.ckpt.old")  # killed between moving the old one aside and renaming the new
    assert record.tidy(tmp_path) == ["last.ckpt.old"]
    assert record.verify(tmp_path / "last.ckpt")["rollout_batches"] == 2
    (tmp_path / "last.ckpt" / "__1_0.distcp").write_bytes(b"\1" * 999)
    with pytest.raises(ConfigError, match="does not match its record"):
        record.verify(tmp_path / "last.ckpt")


def test_a_checkpoint_without_a_record_is_not_judged(tmp_path):
    (tmp_path / "copied.ckpt").write_bytes(b"weights")
    assert record.verify(tmp_path / "copied.ckpt") is None
