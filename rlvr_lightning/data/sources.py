"""Load math problem datasets (local files or Hugging Face datasets) into uniform `ProblemRecord`s.

Every mistake a user can make (wrong path, malformed line, missing column, unreachable hub) raises
`DataSourceError` with a one-line message naming the file, the line or row, and the field, so a bad
dataset is reported before any training starts instead of as a traceback from inside a library.

Locations in messages: JSONL content is reported by 1-based line number (what an editor shows);
JSON lists, parquet and HF datasets by 0-based row index (the same index used in default ids).
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from rlvr_lightning.models.hub import hub_problem, looks_like_path
from rlvr_lightning.models.tasks import EMBEDDED_TASKS
from rlvr_lightning.rewards.extraction import normalize_gold

SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet")
PROBLEM_FIELDS = ("problem", "question", "prompt", "query", "input")
ANSWER_FIELDS = ("answer", "final_answer", "solution", "target", "output")
ID_FIELDS = ("id", "unique_id", "idx", "problem_id")


@dataclass(frozen=True)
class ProblemRecord:
    id: str  # stable id: the id field if present (str()), else f"{source_name}:{row_index}"
    problem: str  # question text, exactly as stored
    answer: str  # gold final answer, normalised by `gold_from_field`


def embedded_records(part: str, task: str = "embedded") -> list[ProblemRecord]:
    """An embedded task's `train` or `test` problems (any other part: test); `task`: a name in `EMBEDDED_TASKS`."""
    train, test = EMBEDDED_TASKS[task](seed=0)
    return [ProblemRecord(p.id, p.prompt(), str(p.value)) for p in (train if part == "train" else test)]


class DataSourceError(ValueError):
    """A dataset could not be loaded because of its contents, its location, or the options given."""


# --------------------------------------------------------------------------- gold normalisation


def gold_from_field(value: Any, where: str = "gold answer") -> str:
    """The gold answer stored in a dataset field, normalised by `rewards.extraction.normalize_gold` (the one
    normaliser, shared with the verifier); its errors become `DataSourceError`s prefixed with `where`
    (file, line, field). A list (OlympiadBench's `final_answer`) is one answer, or several as one
    unordered set "a, b" that a completion must give whole."""
    try:
        return normalize_gold(value)
    except ValueError as err:
        raise DataSourceError(f"{where}: {err}") from None


# --------------------------------------------------------------------------- public entry point


def load_problems(
    source: str | os.PathLike[str],
    split: str = "train",
    problem_field: str | None = None,
    answer_field: str | None = None,
    id_field: str | None = None,
    limit: int | None = None,
    hf_config: str | None = None,
) -> list[ProblemRecord]:
    """Load problems from a .jsonl/.json/.parquet file, an HF-style directory, or an HF dataset name.

    Field options left as None are auto-detected from the first record (PROBLEM_FIELDS, ANSWER_FIELDS,
    ID_FIELDS, first match wins). Without an id field, ids are "<file stem or dataset/split>:<row>".
    `id_field=""` forces those row-index ids. `split` and `hf_config` only apply to HF datasets and
    HF-style directories. `limit` keeps the first `limit` records (and stops reading there).
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise DataSourceError(f"limit must be None or an integer >= 0, got {limit!r}")
    source = os.fspath(source)
    path = Path(source).expanduser()

    if path.is_dir():
        rows, source_name = _iter_hf(str(path), split, hf_config, limit, is_dir=True), f"{path.resolve().name}/{split}"
    elif path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            rows = _iter_jsonl(path)
        elif suffix == ".json":
            rows = _iter_json(path)
        elif suffix == ".parquet":
            rows = _iter_parquet(path)
        else:
            raise DataSourceError(unsupported_file(path))
        source_name = path.stem
    elif looks_like_path(source):
        raise DataSourceError(f"data file not found: {source}")
    else:
        rows, source_name = _iter_hf(source, split, hf_config, limit, is_dir=False), f"{source}/{split}"

    if limit == 0:  # the source was found and its type checked; nothing is read
        return []
    if limit is not None:
        rows = islice(rows, limit)  # lazy: a JSONL file is not parsed past the limit
    return _to_records(rows, source_name, problem_field, answer_field, id_field, source)


# --------------------------------------------------------------------------- readers
# Each reader yields (where, row): `where` locates the row for error messages ("file, line 3").


def unsupported_file(path: Path) -> str:
    suffix = path.suffix.lower()
    return (f"unsupported data file type {suffix or '(no extension)'!r}: {path}; "
            f"supported: {', '.join(SUPPORTED_EXTENSIONS)} or a Hugging Face dataset name")  # fmt: skip


def check_source(source: str | os.PathLike[str] | None, option: str) -> None:
    """Before any work, one line for a data source `load_problems` could not read: a file that does not exist or
    whose type it does not read, or a hub dataset name on a machine that is offline without a cached copy. An
    embedded task, a directory and a hub name the machine can reach pass (their contents are read later)."""
    if source is None or str(source) in EMBEDDED_TASKS:
        return
    source = os.fspath(source)
    path = Path(source).expanduser()
    if path.is_dir():
        return
    if path.is_file():
        if path.suffix.lower() not in SUPPORTED_EXTENSIONS:
            raise DataSourceError(f"{option}: {unsupported_file(path)}")
        return
    if looks_like_path(source):
        raise DataSourceError(f"{option}: data file not found: {source}")
    problem = hub_problem(source, "dataset")
    if problem is not None:
        raise DataSourceError(f"{option}: {problem}")


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8-sig")  # -sig: tolerate a byte-order mark written by some editors
    except UnicodeDecodeError as err:
        raise DataSourceError(f"{where}: not valid UTF-8 text ({err})") from None


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    # Read line by line ourselves so errors can name the 1-based line an editor would show.
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}, line {lineno}"
            line = _decode(raw, where)
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) are not records
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataSourceError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(row, dict):
                raise DataSourceError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield where, row


def _iter_json(path: Path) -> Iterator[tuple[str, Any]]:
    text = _decode(path.read_bytes(), str(path))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        # JSON-lines content saved as .json: the first record parses on its own line.
        first = next((line for line in text.splitlines() if line.strip()), "")
        if _is_json_object(first):
            yield from _iter_jsonl(path)
            return
        raise DataSourceError(f"{path}: invalid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]  # {"data": [...]} wrapper
    elif isinstance(data, dict):
        data = [data]  # a one-record JSON-lines file parses as a single object
    if not isinstance(data, list):
        raise DataSourceError(f'{path}: expected a list of objects or {{"data": [...]}}, got {type(data).__name__}')
    for i, row in enumerate(data):
        where = f"{path}, row {i}"
        if not isinstance(row, dict):
            raise DataSourceError(f"{where}: expected a JSON object, got {type(row).__name__}")
        yield where, row


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq  # noqa: PLC0415 (only needed for parquet)

    try:
        parquet = pq.ParquetFile(path)
        batches = parquet.iter_batches(batch_size=1024)  # batches: stop reading early under a limit
        i = 0
        for batch in batches:
            for row in batch.to_pylist():
                yield f"{path}, row {i}", row
                i += 1
    except DataSourceError:
        raise
    except Exception as err:  # pyarrow raises several types (ArrowInvalid, OSError) for bad files
        raise DataSourceError(f"{path}: cannot read parquet file ({_one_line(err)})") from None


def _iter_hf(source: str, split: str, hf_config: str | None, limit: int | None, is_dir: bool) -> Iterator[tuple[str, Any]]:
    kind = "directory" if is_dir else "HF dataset"
    label = f"{kind} {source!r} (config={hf_config!r}, split={split!r})"
    try:
        import datasets  # noqa: PLC0415 (slow import, only needed for HF sources)

        if is_dir and ((Path(source) / "state.json").exists() or (Path(source) / "dataset_dict.json").exists()):
            ds = datasets.load_from_disk(source)  # written by Dataset.save_to_disk
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
        else:
            ds = datasets.load_dataset(source, hf_config, split=split)
        if limit is not None:
            ds = ds.select(range(min(limit, len(ds))))
    except Exception as err:  # offline, unknown name, gated repo, missing split: all one message
        hint = "" if is_dir else (
            f"; hint: no local file {source!r} exists, and a local .jsonl/.json/.parquet path works offline"
        )
        raise DataSourceError(f"could not load {label}: {_one_line(err).rstrip('.')}{hint}") from None
    for i, row in enumerate(ds):
        yield f"{label}, row {i}", row


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: " + " ".join(str(err).split())


# --------------------------------------------------------------------------- rows -> records


def _to_records(
    rows: Iterator[tuple[str, Any]],
    source_name: str,
    problem_field: str | None,
    answer_field: str | None,
    id_field: str | None,
    source: str,
) -> list[ProblemRecord]:
    records: list[ProblemRecord] = []
    seen_ids: dict[str, str] = {}
    fields: tuple[str, str, str | None] | None = None
    for index, (where, row) in enumerate(rows):
        if fields is None:  # fields are resolved once, from the first record's columns
            fields = (
                _resolve("problem", problem_field, PROBLEM_FIELDS, row, where, "problem_field"),
                _resolve("answer", answer_field, ANSWER_FIELDS, row, where, "answer_field"),
                None if id_field == "" else _resolve("id", id_field, ID_FIELDS, row, where, "id_field", required=False),
            )
        pf, af, idf = fields
        for field, option in ((pf, "problem_field"), (af, "answer_field")):
            if field not in row:
                raise DataSourceError(
                    f"{where}: field {field!r} is missing; columns found: {_columns(row)} "
                    f"(set {option}= to choose another column)"
                )
        problem = row[pf]
        if not isinstance(problem, str) or not problem.strip():
            raise DataSourceError(f"{where}, field {pf!r}: problem text is empty or not a string ({problem!r:.60})")
        answer = gold_from_field(row[af], where=f"{where}, field {af!r}")
        raw_id = row.get(idf) if idf is not None else None
        if raw_id is None:
            rid = f"{source_name}:{index}"
        elif isinstance(raw_id, numbers.Real) and not isinstance(raw_id, bool) and float(raw_id).is_integer():
            rid = str(int(raw_id))  # ids stored as floats (parquet with nulls) stay "7", not "7.0"
        else:
            rid = str(raw_id)
        if rid in seen_ids:  # downstream code groups rollouts and logs results by id
            raise DataSourceError(
                f"{where}: duplicate id {rid!r} (first seen at {seen_ids[rid]}); set id_field= to a unique "
                f'column, or id_field="" to use row-index ids'
            )
        seen_ids[rid] = where
        records.append(ProblemRecord(id=rid, problem=problem, answer=answer))
    if not records:
        raise DataSourceError(f"{source}: no records found")
    return records


def _resolve(
    kind: str,
    explicit: str | None,
    candidates: tuple[str, ...],
    row: dict[str, Any],
    where: str,
    option: str,
    required: bool = True,
) -> str | None:
    if explicit is not None:
        if explicit in row:
            return explicit
        raise DataSourceError(
            f"{where}: {option}={explicit!r} is not a column of this data; columns found: {_columns(row)}"
        )
    for name in candidates:
        if name in row:
            return name
    if not required:
        return None
    raise DataSourceError(
        f"{where}: no {kind} field found (looked for {', '.join(candidates)}); columns found: {_columns(row)}. "
        f"Set {option}= to the column that holds the {kind}"
    )


def _columns(row: dict[str, Any]) -> str:
    return ", ".join(map(str, row)) or "(none)"
