"""Prompt/answer examples from a local data file: JSON lines, Parquet or CSV, with named fields.

Read with the standard library (JSONL, CSV) and pyarrow (Parquet), not the `datasets` library: these
three formats need nothing more, and `datasets` would add the Hub client, fsspec, pandas and a cache of
converted Arrow files for no gain here (it reads Parquet with pyarrow itself). CSV fields stay the text
as written (an answer "007" or "1/2" is not turned into a number). Every row is checked when the file is
loaded; an error names the file, the line or row, and the field.
"""

import csv
import dataclasses
import json
from pathlib import Path

FORMATS = {".jsonl": "jsonl", ".parquet": "parquet", ".csv": "csv"}


@dataclasses.dataclass(frozen=True)
class Example:
    prompt: str
    answer: str = ""
    source: str = ""  # where it came from, for errors: "file:line" for a data file


def read_jsonl(path) -> list[tuple[int, dict]]:
    """(1-based line number, object) for each non-blank line of a UTF-8 JSONL file. Lines are split on
    "\n" only (JSON strings may hold U+2028 and other characters str.splitlines breaks at); a bad file
    or line raises a one-line ValueError naming the file and the line."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the data file ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ValueError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); expected JSON lines"
        ) from None
    rows = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise ValueError(f"{path}:{number}: JSON nested too deeply") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        rows.append((number, row))
    return rows


def _read_csv(path) -> list[tuple[str, dict]]:
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            reader = csv.DictReader(f)
            return [(f"{path}:{reader.line_num}", row) for row in reader]
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except csv.Error as e:
        raise ValueError(f"{path}: not valid CSV ({e})") from None


def _read_parquet(path, fields) -> list[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
        missing = [f for f in fields if f not in names]
        if missing:
            raise ValueError(f"{path}: no column {missing[0]!r} (columns: {', '.join(names)})")
        rows = pq.read_table(path, columns=list(fields)).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: cannot read it as Parquet ({e})") from None
    return [(f"{path}:row {i}", row) for i, row in enumerate(rows, 1)]


def read_rows(path, fields=()) -> list[tuple[str, dict]]:
    """(source, row) for each row of a .jsonl, .parquet or .csv file; `fields` limits Parquet's columns."""
    kind = FORMATS.get(Path(path).suffix.lower())
    if kind is None:
        raise ValueError(f"{path}: unknown data format; name a {', '.join(FORMATS)} file")
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such file")
    if kind == "jsonl":
        return [(f"{path}:{number}", row) for number, row in read_jsonl(path)]
    return _read_csv(path) if kind == "csv" else _read_parquet(path, fields)


def _text(value, source, field, available) -> str:
    """A prompt or answer as text: strings as they are, numbers as Python writes them."""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if value is None:
        raise ValueError(f"{source}: no {field!r} field (fields here: {', '.join(sorted(available))})")
    raise ValueError(f"{source}: {field!r} must be text or a number, got {type(value).__name__}")


def load_examples(path, prompt_field: str = "prompt", answer_field: str = "answer") -> list[Example]:
    """Every row's prompt and answer; an empty prompt or answer, or a file with no rows, is an error."""
    examples = []
    for source, row in read_rows(path, (prompt_field, answer_field)):
        prompt = _text(row.get(prompt_field), source, prompt_field, row)
        answer = _text(row.get(answer_field), source, answer_field, row)
        for field, value in ((prompt_field, prompt), (answer_field, answer)):
            if not value.strip():
                raise ValueError(f"{source}: {field!r} is empty")
        examples.append(Example(prompt, answer, source))
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples
