"""Reading a data file as records: the one place that opens a ShareGPT/LLaVA .json or .jsonl file.

A file that is unusable as a whole (missing, a directory, not UTF-8, not JSON, not a list) raises `DataError`,
whose message names the file, the line and column where there is one, and the fix; the launcher's preflight turns
it into one line and exit code 2. A single malformed .jsonl line is only a bad record: it becomes a `BadSample`
that the sample guard skips and counts.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

from mindspeed_flow.data.guard import BadSample


class DataError(ValueError):
    """The dataset cannot be used at all; the message names the file (and line) and the fix."""


def _line_of(raw: bytes, offset: int) -> tuple[int, int]:
    line = raw.count(b"\n", 0, offset) + 1
    return line, offset - (raw.rfind(b"\n", 0, offset) + 1) + 1


def read_text(path: str, field: str) -> tuple[bytes, str]:
    """The file's bytes and UTF-8 text; a missing, unreadable or non-UTF-8 file is a `DataError`."""
    if not os.path.exists(path):
        raise DataError(f"{field}={path!r} does not exist; fix the path (relative paths are from the directory "
                        f"you launch in: {os.getcwd()})")
    if os.path.isdir(path):
        raise DataError(f"{field}={path!r} is a directory; it must name the file itself")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise DataError(f"{field}={path!r} cannot be read: {exc.strerror}") from None
    try:
        return raw, raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, col = _line_of(raw, exc.start)
        raise DataError(f"{path}, line {line} column {col}: byte 0x{raw[exc.start]:02x} is not UTF-8; re-encode "
                        "the file as UTF-8 (for example `iconv -f GB18030 -t UTF-8`)") from None


_ID_FIELD = re.compile(r'"id"\s*:\s*("(?:[^"\\]|\\.)*"|-?\d+)')


def _salvage_id(line: str) -> Any:
    """The "id" a malformed .jsonl line still shows (the error is usually further on), or None."""
    m = _ID_FIELD.search(line)
    if m is None:
        return None
    try:
        return json.loads(m.group(1))
    except ValueError:
        return None


def load_entries(path: str) -> list[Any]:
    """The raw entries of a .json (a list) or .jsonl file; a malformed .jsonl line becomes a `BadSample`. A
    missing, non-UTF-8 or malformed file raises `DataError` naming the file and line ."""
    _, text = read_text(path, "data.path")
    if path.endswith(".jsonl"):
        entries: list[Any] = []
        for line_no, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError as exc:
                bad = BadSample(len(entries), f"line {line_no} of {path} is not valid JSON: {exc}")
                bad.record_id = _salvage_id(line)  # type: ignore[attr-defined]
                entries.append(bad)
        return entries
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}, line {exc.lineno} column {exc.colno}: invalid JSON ({exc.msg}); fix the file "
                        "there (a missing comma, bracket or quote), or use .jsonl with one record per line") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: the top level is a JSON {type(data).__name__}; it must be a list of records "
                        '[{"id": ..., "image": ..., "conversations": [...]}, ...]')
    return data
