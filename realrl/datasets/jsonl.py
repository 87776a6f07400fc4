"""Reading and writing JSON-lines files with line-precise error reports.

A dataset mistake should cost the user one run, not one run per mistake: ``read_jsonl``
checks every line, collects up to ``max_problems`` problems, and raises one
``DatasetError`` listing each as ``file:line: problem``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from realrl.api.errors import UserFacingError

logger = logging.getLogger(__name__)

TypeSpec = type | tuple[type, ...]


class DatasetError(UserFacingError, ValueError):
    """A dataset file that cannot be used; the message names the file and 1-based lines."""


def _type_name(spec: TypeSpec) -> str:
    if isinstance(spec, tuple):
        return " or ".join(t.__name__ for t in spec)
    return spec.__name__


def _is_instance(value: Any, spec: TypeSpec) -> bool:
    # JSON true/false must not pass as numbers.
    if isinstance(value, bool):
        types = spec if isinstance(spec, tuple) else (spec,)
        return bool in types
    return isinstance(value, spec)


def check_fields(
    record: dict[str, Any],
    required: dict[str, TypeSpec],
    optional: dict[str, TypeSpec],
    non_empty: Iterable[str],
) -> list[str]:
    """Problems with one record's keys and types (an empty list when it is valid)."""
    problems = []
    for key, spec in required.items():
        if key not in record:
            problems.append(f"missing required key {key!r} (required: {', '.join(required)})")
        elif not _is_instance(record[key], spec):
            problems.append(
                f"key {key!r} must be {_type_name(spec)}, got {type(record[key]).__name__}"
            )
    for key, spec in optional.items():
        if key in record and record[key] is not None and not _is_instance(record[key], spec):
            problems.append(
                f"key {key!r} must be {_type_name(spec)}, got {type(record[key]).__name__}"
            )
    for key in non_empty:
        value = record.get(key)
        if isinstance(value, str) and not value.strip():
            problems.append(f"key {key!r} is empty")
    return problems


def read_jsonl(
    path: str | Path,
    required: dict[str, TypeSpec],
    optional: dict[str, TypeSpec] | None = None,
    check: Callable[[dict[str, Any]], list[str]] | None = None,
    non_empty: Iterable[str] = ("prompt",),
    max_problems: int = 10,
) -> list[dict[str, Any]]:
    """Read and validate a JSONL file; one JSON object per line, blank lines skipped.

    ``required``/``optional`` map keys to the type(s) their values must have (optional keys may
    be absent or null); ``non_empty`` string keys may not be blank; ``check`` returns extra
    problems for a record whose keys and types are fine. Each returned record gets
    ``"_line"``, its 1-based line number, for later messages.
    """
    return list(iter_jsonl(path, required, optional, check, non_empty, max_problems))


def iter_jsonl(
    path: str | Path,
    required: dict[str, TypeSpec],
    optional: dict[str, TypeSpec] | None = None,
    check: Callable[[dict[str, Any]], list[str]] | None = None,
    non_empty: Iterable[str] = ("prompt",),
    max_problems: int = 10,
) -> Iterator[dict[str, Any]]:
    """`read_jsonl` one record at a time, so that a multi-GB file is validated in constant
    memory (the launcher counts records this way). The `DatasetError` listing every problem
    is raised once the file is read (or after ``max_problems``); records are yielded as they
    are found valid, so a caller sees the error only after the last one."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file {path} does not exist or is not a file")
    optional = optional or {}
    non_empty = tuple(non_empty)
    problems: list[str] = []
    found_any = False
    for line_number, line, problem in _decoded_lines(path):
        if problem is None:
            if not line.strip():
                continue
            line_problems, record = _parse_line(line, required, optional, check, non_empty)
        else:
            line_problems, record = [problem], None
        problems.extend(f"{path}:{line_number}: {problem}" for problem in line_problems)
        if record is not None and not line_problems:
            record["_line"] = line_number
            found_any = True
            yield record
        if len(problems) >= max_problems:
            problems.append(f"{path}: stopped after {max_problems} problems")
            break
    if len(problems) == 1:
        raise DatasetError(f"invalid dataset: {problems[0]}")
    if problems:
        raise DatasetError(f"invalid dataset {path}:\n  " + "\n  ".join(problems))
    if not found_any:
        raise DatasetError(f"dataset file {path} holds no records (every line is blank)")


def _decoded_lines(path: Path) -> Iterator[tuple[int, str, str | None]]:
    """(1-based line number, text, problem) for each line; a line that is not UTF-8 comes
    with a problem naming the bad byte and its offset in the line and in the file."""
    offset = 0
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            try:
                yield line_number, raw.decode("utf-8"), None
            except UnicodeDecodeError as error:
                bad = raw[error.start:error.start + 1].hex()
                yield line_number, "", (
                    f"not UTF-8: byte 0x{bad} at column {error.start + 1} (byte offset "
                    f"{offset + error.start} of the file); save the file as UTF-8"
                )
            offset += len(raw)


def _parse_line(
    line: str,
    required: dict[str, TypeSpec],
    optional: dict[str, TypeSpec],
    check: Callable[[dict[str, Any]], list[str]] | None,
    non_empty: tuple[str, ...],
) -> tuple[list[str], dict[str, Any] | None]:
    try:
        record = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as error:
        return [f"bad JSON ({error.msg} at column {error.colno})"], None
    if not isinstance(record, dict):
        return [f"expected a JSON object, got {type(record).__name__}"], None
    problems = check_fields(record, required, optional, non_empty)
    if not problems and check is not None:
        problems = check(record)
    return problems, record


def write_jsonl(records: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Write one JSON object per line (UTF-8); creates parent directories. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for record in records:
            clean = {k: v for k, v in record.items() if k != "_line"}
            handle.write(json.dumps(clean, ensure_ascii=False) + "\n")
    return path
