"""`last.json`: what a run's `last.ckpt` holds and its digest, written so that the two never disagree after a kill.

A save writes the checkpoint to `last.ckpt.tmp`, digests it, then replaces `last.json` with a record naming the
new checkpoint (its rollout batch, its SHA-256) and the one it replaces (`previous`), and only then renames the
new checkpoint over `last.ckpt`. Killed before the record is replaced: the old record, the old checkpoint. Killed
between the two renames: the record's `previous` is the checkpoint on disk. So `last.ckpt` always matches the
record's entry or its `previous`, and a checkpoint that matches neither was changed or damaged after it was
written: resuming it is refused in one line (`verify`).

Digesting reads the checkpoint back once per save (a sharded checkpoint's files in parallel threads: hashlib
releases the interpreter lock); at SHA-256's 1-2 GB/s that is seconds for a checkpoint of a few GB.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rlvr_lightning.errors import ConfigError

RECORD = "last.json"
TEMPORARY = ("last.ckpt.tmp", "last.ckpt.old", "last.json.tmp")  # what an interrupted save leaves


def digest(path: str | os.PathLike) -> str:
    """SHA-256 of a checkpoint file, or of a sharded checkpoint directory (each file's name and digest, in order)."""
    where = Path(path)
    if where.is_file():
        return _file_digest(where)
    files = sorted(p for p in where.rglob("*") if p.is_file())
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(_file_digest, files))
    whole = hashlib.sha256()
    for file, file_digest in zip(files, digests, strict=True):
        whole.update(f"{file.relative_to(where)}\0{file_digest}\n".encode())
    return whole.hexdigest()


def _file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read(directory: str | os.PathLike) -> dict | None:
    """The run directory's record, or None when it has none (or one that cannot be read)."""
    try:
        record = json.loads((Path(directory) / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write(directory: Path, entry: dict) -> None:
    """Replace the record with `entry` (the checkpoint about to become `last.ckpt`), keeping the current entry
    as `previous`; call it after the new checkpoint is written and digested, before it is renamed."""
    current = read(directory)
    if current is not None:
        current.pop("previous", None)
    record = {**entry, "previous": current}
    tmp = directory / "last.json.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, directory / RECORD)


def verify(checkpoint: str | os.PathLike) -> dict | None:
    """The record entry `checkpoint` matches (its own or `previous`); None when no record is beside it (a
    checkpoint copied on its own); a ConfigError when it matches neither."""
    where = Path(checkpoint)
    record = read(where.parent)
    if record is None or "sha256" not in record or where.name != Path(record.get("checkpoint", "")).name:
        return None
    found = digest(where)
    for entry in (record, record.get("previous") or {}):
        if entry.get("sha256") == found:
            return entry
    raise ConfigError(
        f"ckpt_path: {checkpoint} does not match its record {where.parent / RECORD} (SHA-256 {found[:12]}…, recorded "
        f"{record['sha256'][:12]}… for rollout batch {record.get('rollout_batches')}): it was changed or damaged "
        "after it was written; resume from a copy you trust"
    )


def tidy(directory: Path) -> list[str]:
    """What an interrupted save left in `directory`, put right (call it holding the run's lock): a sharded
    checkpoint moved aside but not yet replaced is moved back; temporary files are removed. The names handled."""
    import shutil

    handled = []
    old, last = directory / "last.ckpt.old", directory / "last.ckpt"
    if old.exists() and not last.exists():
        os.replace(old, last)
        handled.append(old.name)
    for name in TEMPORARY:
        path = directory / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink(missing_ok=True)
        else:
            continue
        handled.append(name)
    return handled
