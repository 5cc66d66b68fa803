"""Records of local ``.jsonl`` / ``.json`` / ``.parquet`` files, each with where it came from.

* ``.jsonl``: one JSON object a line, parsed line by line with the standard library's ``json`` so that an
  error names the line (``file:line``); blank lines are skipped.
* ``.json``: a JSON array of objects (the ``alpaca_data.json`` / LLaMA-Factory layout), or JSON lines under
  a ``.json`` name (``pandas.DataFrame.to_json(lines=True)``); an error names the line.
* ``.parquet``: read with ``pyarrow.parquet`` (only the wanted columns; ``pyarrow`` is the Arrow engine that
  Hugging Face ``datasets`` itself reads parquet with). Record ``i`` is named ``file:row i`` (1-based).

Offline only: nothing is downloaded, and nothing is cached or written (unlike ``datasets.load_dataset``,
which writes an Arrow cache under ``~/.cache/huggingface``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from fp8kit.base.errors import DataError

#: suffixes read as records (everything else in data.paths is plain text or .bin tokens)
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")


def read_text(path: Path) -> str:
    """The file's text (UTF-8, undecodable bytes replaced). Raises DataError when it cannot be read."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise DataError(f"data file {str(path)!r} cannot be read: {e}") from None


def iter_jsonl(path: Path) -> Iterator[tuple[str, int, object]]:
    """``(where, line number, parsed value)`` for every non-blank line of a JSON-lines file.

    Raises:
        DataError: ``file:line: invalid JSON (...)`` for the first line that does not parse.
    """
    for lineno, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
        yield f"{path}:{lineno}", lineno, obj


def _json_records(path: Path) -> list[tuple[str, object]]:
    text = read_text(path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg != "Extra data":
            raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
        return [(where, obj) for where, _, obj in iter_jsonl(path)]  # JSON lines under a .json name
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise DataError(f"{path}: expected a JSON array of objects, got {type(value).__name__}")
    return [(f"{path}[{i}]", obj) for i, obj in enumerate(value)]


def parquet_columns(path: Path) -> list[str]:
    """The column names of a parquet file (its schema only). Raises DataError when it is not parquet."""
    import pyarrow.parquet as pq

    try:
        return list(pq.read_schema(path).names)
    except (OSError, ValueError) as e:  # pyarrow.lib.ArrowInvalid is a ValueError
        raise DataError(f"data file {str(path)!r} is not a readable parquet file: {e}") from None


def read_records(path: Path, pick_columns: Callable[[list[str]], list[str]]) -> list[tuple[str, dict]]:
    """All records of one ``.jsonl`` / ``.json`` / ``.parquet`` file as ``(where, dict)``.

    Args:
        path: the file.
        pick_columns: for parquet, the columns to read given the file's column names; it raises
            :class:`DataError` (naming ``path``) when a needed column is missing. Not used for JSON.

    Raises:
        DataError: the file cannot be read, a JSON line/array is invalid, or a record is not an object.
    """
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        columns = pick_columns(parquet_columns(path))
        try:
            rows = pq.read_table(path, columns=columns).to_pylist()
        except (OSError, ValueError) as e:
            raise DataError(f"data file {str(path)!r} cannot be read as parquet: {e}") from None
        return [(f"{path}:row {i}", row) for i, row in enumerate(rows, start=1)]
    if path.suffix == ".jsonl":
        records = [(where, obj) for where, _, obj in iter_jsonl(path)]
    else:
        records = _json_records(path)
    for where, obj in records:
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return records
