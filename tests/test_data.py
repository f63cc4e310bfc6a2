"""Prompt/answer examples from local JSONL, Parquet (a real file written with pyarrow) and CSV files,
with named fields; errors name the file, the line or row, and the field."""

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlkjax.rl.data import load_examples

ROWS = [
    {"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "solution": "\\frac{3}{4}", "extra": 1},
    {"problem": "Compute 6 * 7.", "solution": "42", "extra": 2},
    {"problem": "Simplify 10/4.", "solution": "5/2", "extra": 3},
]


def write_all_formats(directory, rows):
    jsonl, parquet, csv_path = directory / "d.jsonl", directory / "d.parquet", directory / "d.csv"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return jsonl, parquet, csv_path


def test_jsonl_parquet_and_csv_read_alike(tmp_path):
    """The same rows written as JSONL, a real Parquet file and CSV load to the same examples, with
    sources that name the file and line (row for Parquet)."""
    files = write_all_formats(tmp_path, ROWS)
    loaded = [load_examples(f, "problem", "solution") for f in files]
    for examples in loaded:
        assert [(e.prompt, e.answer) for e in examples] == [(r["problem"], r["solution"]) for r in ROWS]
    assert [e.source for e in loaded[0]] == [f"{files[0]}:{n}" for n in (1, 2, 3)]
    assert [e.source for e in loaded[1]] == [f"{files[1]}:row {n}" for n in (1, 2, 3)]
    assert [e.source for e in loaded[2]] == [f"{files[2]}:{n}" for n in (2, 3, 4)]  # line 1 is the header


def test_numeric_parquet_answers_become_text(tmp_path):
    path = tmp_path / "n.parquet"
    pq.write_table(pa.table({"q": ["1+1?", "6*7?"], "a": [2, 42], "f": [0.5, 2.5]}), path)
    assert [e.answer for e in load_examples(path, "q", "a")] == ["2", "42"]
    assert [e.answer for e in load_examples(path, "q", "f")] == ["0.5", "2.5"]


def test_data_errors_name_the_file_row_and_field(tmp_path):
    jsonl, parquet, csv_path = write_all_formats(tmp_path, ROWS)
    with pytest.raises(ValueError, match=r"d\.jsonl:1: no 'question' field \(fields here: extra, problem"):
        load_examples(jsonl, "question", "solution")
    with pytest.raises(ValueError, match=r"d\.parquet: no column 'answer' \(columns: problem, solution, extra\)"):
        load_examples(parquet, "problem", "answer")
    with pytest.raises(ValueError, match="unknown data format"):
        load_examples(tmp_path / "d.txt")
    (tmp_path / "e.csv").write_text('problem,solution\n"",1\n')
    with pytest.raises(ValueError, match=r"e\.csv:2: 'problem' is empty"):
        load_examples(tmp_path / "e.csv", "problem", "solution")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="cannot read it as Parquet"):
        load_examples(tmp_path / "bad.parquet")
