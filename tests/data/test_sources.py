"""Tests for rlvr_lightning.data.sources: real benchmark files, local formats, and error messages."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rlvr_lightning.data.sources import (
    DataSourceError,
    ProblemRecord,
    gold_from_field,
    load_problems,
)
from tests.conftest import BENCHMARKS, needs_benchmarks


def write_jsonl(path: Path, rows: list[dict] | list[str]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --------------------------------------------------------------------------- real benchmark files


@needs_benchmarks
@pytest.mark.parametrize(
    ("name", "count", "first_id", "first_answer"),
    [
        ("math500.jsonl", 500, "test/precalculus/807.json", r"\left( 3, \frac{\pi}{2} \right)"),
        ("gsm8k.jsonl", 1319, "gsm8k:0", "18"),  # no id column: "<stem>:<row>"
        ("aime24.jsonl", 30, "60", "204"),  # ids are ints starting at 60
        ("amc23.jsonl", 40, "0", "27"),  # answers stored as floats (27.0)
    ],
)
def test_benchmark_loads_by_path(name: str, count: int, first_id: str, first_answer: str) -> None:
    records = load_problems(str(BENCHMARKS / name))
    assert len(records) == count
    assert all(isinstance(r, ProblemRecord) for r in records)
    assert records[0].id == first_id
    assert records[0].answer == first_answer
    assert len({r.id for r in records}) == count
    assert all(r.problem.strip() and r.answer for r in records)


@needs_benchmarks
def test_benchmark_gold_spot_checks() -> None:
    gsm = load_problems(BENCHMARKS / "gsm8k.jsonl")  # a Path works too
    assert [r.answer for r in gsm[:4]] == ["18", "3", "70000", "540"]
    assert gsm[0].problem.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert all("," not in r.answer and "####" not in r.answer for r in gsm)  # "1,450,000" -> "1450000"

    amc = load_problems(BENCHMARKS / "amc23.jsonl")
    assert [r.answer for r in amc[:4]] == ["27", "36", "45", "3159"]
    assert all(not r.answer.endswith(".0") for r in amc)
    assert amc[0].problem.startswith("Cities $A$ and $B$")  # "problem" preferred over identical "question"

    aime = load_problems(BENCHMARKS / "aime24.jsonl")
    assert aime[7].answer == "25"  # stored zero-padded as "025"

    math500 = load_problems(BENCHMARKS / "math500.jsonl")
    raw = [json.loads(line) for line in (BENCHMARKS / "math500.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r.answer for r in math500] == [row["answer"].strip() for row in raw]
    # The last \boxed{} of each MATH solution agrees with its answer column.
    from_solution = load_problems(BENCHMARKS / "math500.jsonl", answer_field="solution")
    assert [r.answer for r in from_solution] == [r.answer for r in math500]


@needs_benchmarks
def test_limit_on_benchmark() -> None:
    records = load_problems(BENCHMARKS / "gsm8k.jsonl", limit=5)
    assert [r.id for r in records] == [f"gsm8k:{i}" for i in range(5)]
    assert load_problems(BENCHMARKS / "gsm8k.jsonl", limit=0) == []
    assert len(load_problems(BENCHMARKS / "aime24.jsonl", limit=1000)) == 30


# --------------------------------------------------------------------------- gold normalisation


@pytest.mark.parametrize(
    ("value", "gold"),
    [
        (27.0, "27"),
        (27, "27"),
        (-1.0, "-1"),
        (0.5, "0.5"),
        ("  \\frac{1}{2} ", "\\frac{1}{2}"),
        ("He makes $18.\n#### 18", "18"),
        ("so 1,450,000 total\n#### 1,450,000", "1450000"),
        ("#### (1,2)", "(1,2)"),  # not a thousands separator
        ("a #### b #### 7", "7"),  # last marker wins
        ("first \\boxed{1}, then \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("025", "25"),
        ("p - q", "p - q"),
        ("$\\frac{1}{2}$", "\\frac{1}{2}"),  # a whole answer in math delimiters
        ("\\$36", "\\$36"),  # an escaped dollar is not one
        # Lists (OlympiadBench's final_answer): one item is that answer, several an unordered set "a, b".
        (["$2$"], "2"),
        (["$025$"], "25"),
        ([27.0], "27"),
        (["$x=1$", "$x=2$"], "x=1, x=2"),
        (["$(1,2)$", "$(3,4)$"], "(1,2), (3,4)"),
        (("1", "2", "1"), "1, 2"),  # a set: a repeated answer is one answer
    ],
)
def test_gold_from_field(value: object, gold: str) -> None:
    assert gold_from_field(value) == gold


@pytest.mark.parametrize(
    "value", [None, "", "   ", "#### ", "\\boxed{ }", float("nan"), True, {"a": 1}, [], [["1"]], ["1", None], ["$$"]]
)
def test_gold_from_field_rejects(value: object) -> None:
    with pytest.raises(DataSourceError, match="here"):
        gold_from_field(value, where="here")


def test_gold_from_field_errors_name_where() -> None:
    with pytest.raises(DataSourceError, match=r"^here: gold answer has a \\boxed\{ with unbalanced braces$"):
        gold_from_field("\\boxed{3", where="here")
    with pytest.raises(DataSourceError, match=r"^here: gold answer is a boolean \(True\), expected text or a number$"):
        gold_from_field(True, where="here")


def test_olympiadbench_lines_with_list_golds_load(tmp_path: Path) -> None:
    # OlympiadBench's fields: the problem in `question`, `solution` and `final_answer` as lists of LaTeX.
    common = {"context": None, "modality": "Text-only", "is_multiple_answer": False, "unit": None, "error": None,
              "question_type": "Open-ended", "subfield": "Algebra", "subject": "Math", "language": "English"}  # fmt: skip
    rows = [
        {"id": 1606, "question": "Find $a$.", "solution": ["So $a=2$."], "final_answer": ["$2$"], **common},
        {**common, "id": 1607, "question": "Solve $x^2-3x+2=0$.", "solution": ["..."],
         "final_answer": ["$x=1$", "$x=2$"], "is_multiple_answer": True},
        {**common, "id": 1608, "question": "Find all pairs.", "solution": ["..."],
         "final_answer": ["$(1,2)$", "$(3,4)$"], "is_multiple_answer": True},
    ]  # fmt: skip
    records = load_problems(write_jsonl(tmp_path / "OE_TO_maths_en_COMP.jsonl", rows))
    assert records == [
        ProblemRecord("1606", "Find $a$.", "2"),
        ProblemRecord("1607", "Solve $x^2-3x+2=0$.", "x=1, x=2"),
        ProblemRecord("1608", "Find all pairs.", "(1,2), (3,4)"),
    ]


# --------------------------------------------------------------------------- local formats


def test_explicit_field_mapping(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "custom.jsonl", [{"q": "1+1?", "gold": 2, "key": "a"}, {"q": "2+2?", "gold": 4, "key": "b"}])
    records = load_problems(path, problem_field="q", answer_field="gold", id_field="key")
    assert records == [ProblemRecord("a", "1+1?", "2"), ProblemRecord("b", "2+2?", "4")]
    # id_field="" forces row-index ids even when an id column exists
    assert [r.id for r in load_problems(path, problem_field="q", answer_field="gold", id_field="")] == ["custom:0", "custom:1"]


def test_jsonl_skips_blank_lines_and_numbers_rows_by_record(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ["", json.dumps({"question": "a", "answer": "1"}), "  ", json.dumps({"question": "b", "answer": "2"})])
    assert load_problems(path) == [ProblemRecord("d:0", "a", "1"), ProblemRecord("d:1", "b", "2")]


def test_json_list_wrapper_and_jsonl_content(tmp_path: Path) -> None:
    rows = [{"problem": "p1", "final_answer": "1", "idx": 7}, {"problem": "p2", "final_answer": "2", "idx": 8}]
    expected = [ProblemRecord("7", "p1", "1"), ProblemRecord("8", "p2", "2")]
    (tmp_path / "list.json").write_text(json.dumps(rows, indent=2))
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": rows}))
    write_jsonl(tmp_path / "lines.json", rows)
    for name in ("list.json", "wrapped.json", "lines.json"):
        assert load_problems(tmp_path / name) == expected, name


def test_json_syntax_error_names_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"problem": "p", "answer": "1"},\n  {"problem": "q" "answer": "2"}\n]\n')
    with pytest.raises(DataSourceError, match=r"bad\.json: invalid JSON .*line 3"):
        load_problems(path)


def test_parquet_round_trip(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"question": ["1+1?", "2+3?", "big?"], "answer": [2.0, 5.0, 0.25], "problem_id": [10, 11, 12]})
    path = tmp_path / "small.parquet"
    pq.write_table(table, path)
    assert load_problems(path) == [
        ProblemRecord("10", "1+1?", "2"),
        ProblemRecord("11", "2+3?", "5"),
        ProblemRecord("12", "big?", "0.25"),
    ]
    assert len(load_problems(path, limit=2)) == 2
    with pytest.raises(DataSourceError, match=r"small\.parquet.*'solution'.*question, answer, problem_id"):
        load_problems(path, answer_field="solution")


def test_parquet_corrupt_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not a parquet file")
    with pytest.raises(DataSourceError, match=r"broken\.parquet: cannot read parquet file"):
        load_problems(path)


def test_hf_style_save_to_disk_directory(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.DatasetDict({"test": datasets.Dataset.from_dict({"problem": ["p"], "answer": ["\\boxed{3}"]})})
    ds.save_to_disk(str(tmp_path / "saved"))
    assert load_problems(tmp_path / "saved", split="test") == [ProblemRecord("saved/test:0", "p", "3")]
    with pytest.raises(DataSourceError, match=r"split='train'"):
        load_problems(tmp_path / "saved", split="train")


# --------------------------------------------------------------------------- error messages


def test_malformed_json_line_names_file_and_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "broken.jsonl", [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": "2"}, '{"problem": "c", "answer": '])
    with pytest.raises(DataSourceError, match=r"broken\.jsonl, line 3: invalid JSON \(Expecting value"):
        load_problems(path)
    assert len(load_problems(path, limit=2)) == 2  # lines past the limit are never parsed


def test_jsonl_line_not_an_object(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "arr.jsonl", [{"problem": "a", "answer": "1"}, "[1, 2]"])
    with pytest.raises(DataSourceError, match=r"arr\.jsonl, line 2: expected a JSON object, got list"):
        load_problems(path)


def test_missing_answer_field_lists_columns(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "noans.jsonl", [{"problem": "a", "gold": "1", "meta": 0}])
    with pytest.raises(DataSourceError) as info:
        load_problems(path)
    msg = str(info.value)
    assert "noans.jsonl, line 1" in msg
    assert "no answer field found" in msg
    assert "columns found: problem, gold, meta" in msg
    assert "answer_field=" in msg


def test_missing_problem_field_suggests_option(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "noprob.jsonl", [{"text": "a", "answer": "1"}])
    with pytest.raises(DataSourceError, match=r"no problem field found.*columns found: text, answer.*problem_field="):
        load_problems(path)


def test_field_missing_in_later_row(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "ragged.jsonl", [{"problem": "a", "answer": "1"}, {"problem": "b", "extra": "2"}])
    with pytest.raises(DataSourceError, match=r"ragged\.jsonl, line 2: field 'answer' is missing; columns found: problem, extra"):
        load_problems(path)


def test_explicit_unknown_field(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "a", "answer": "1"}])
    with pytest.raises(DataSourceError, match=r"d\.jsonl, line 1: problem_field='prompt_text' is not a column.*columns found: problem, answer"):
        load_problems(path, problem_field="prompt_text")
    with pytest.raises(DataSourceError, match=r"id_field='uid'"):
        load_problems(path, id_field="uid")


def test_empty_gold_names_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": "  "}])
    with pytest.raises(DataSourceError, match=r"d\.jsonl, line 2, field 'answer': gold answer is empty"):
        load_problems(path)


def test_duplicate_ids_rejected(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "dup.jsonl", [{"id": 1, "problem": "a", "answer": "1"}, {"id": 1, "problem": "b", "answer": "2"}])
    with pytest.raises(DataSourceError, match=r"line 2: duplicate id '1' \(first seen at .*line 1\)"):
        load_problems(path)


def test_empty_file(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "empty.jsonl", [""])
    with pytest.raises(DataSourceError, match="no records found"):
        load_problems(path)


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataSourceError, match=f"data file not found: {missing}"):
        load_problems(str(missing))


@pytest.mark.parametrize("source", ["data/train.jsonl", "nope.parquet", "./x", "a/b/c", "/abs/dir", "~/data.json"])
def test_path_like_strings_never_reach_the_hub(source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    datasets = pytest.importorskip("datasets")

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{source!r} was sent to the HF hub")

    monkeypatch.setattr(datasets, "load_dataset", fail)
    monkeypatch.setattr(datasets, "load_from_disk", fail)
    with pytest.raises(DataSourceError, match="data file not found"):
        load_problems(source)


def test_unsupported_extension(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("problem,answer\na,1\n")
    with pytest.raises(DataSourceError, match=r"unsupported data file type '\.csv'.*\.jsonl, \.json, \.parquet"):
        load_problems(path)


def test_bad_limit(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "a", "answer": "1"}])
    with pytest.raises(DataSourceError, match="limit"):
        load_problems(path, limit=-1)


def test_hf_name_offline_fails_fast_with_hint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    datasets = pytest.importorskip("datasets")
    # The env vars are read at import time; if another test imported datasets first, patch the flags too.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True, raising=False)

    start = time.monotonic()
    with pytest.raises(DataSourceError) as info:
        load_problems("rlvr-lightning-tests/no-such-dataset", split="test")
    assert time.monotonic() - start < 30
    msg = str(info.value)
    assert "\n" not in msg
    assert "'rlvr-lightning-tests/no-such-dataset'" in msg
    assert "split='test'" in msg
    assert "hint: no local file" in msg and "local .jsonl/.json/.parquet path works offline" in msg
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no library traceback chained
