"""Preflight of the dataset, run by the launcher before any worker starts.

Data errors found by workers come back through the elastic agent as pages of traceback from every rank. The
launcher therefore opens the dataset itself first: the paths the recipe names, the file's encoding and JSON, and
its first records. Anything wrong becomes one `DataError` whose message names the file, the line (where there
is one) and the fix; the launcher prints it and exits with code 2. Problems of single records further in stay
bad samples (skipped and counted by `SampleGuard`), so preflight only fails when the file as a whole is unusable.
"""
from __future__ import annotations

import os
from typing import Any

from mindspeed_flow.data.guard import BadSample
from mindspeed_flow.data.records import DataError, load_entries, read_text
from mindspeed_flow.data.shapes import LengthTableError, read_length_table

FIRST_RECORDS = 8  # records checked at preflight; all of them bad means the format, not a record, is wrong


def _record_problem(entry: Any) -> str:
    """Why a ShareGPT record's structure is unusable ('' when it looks right)."""
    if isinstance(entry, BadSample):
        return entry.cause
    if not isinstance(entry, dict):
        return f"a record is a JSON {type(entry).__name__}, not an object"
    conv = entry.get("conversations", entry.get("messages"))
    if not isinstance(conv, list) or not conv:
        return f"record {entry.get('id', '?')!r} has no 'conversations' (or 'messages') list"
    return ""


def preflight(data_cfg: Any, global_batch_size: int) -> None:
    """Open the dataset `data_cfg` names the way the workers will; raise `DataError` (see module docstring)."""
    source = data_cfg.source
    if source == "synthetic_infovqa":
        return
    if source not in ("sharegpt", "length_table"):
        return  # build_dataset names the unknown source
    if not data_cfg.path:
        what = "a ShareGPT/LLaVA .json or .jsonl file" if source == "sharegpt" else "a CSV length table"
        raise DataError(f"data.path is not set; data.source={source} reads {what}: add data.path=/path/to/file")
    path = str(data_cfg.path)
    if source == "length_table":
        read_text(path, "data.path")
        try:
            rows = read_length_table(path)
        except LengthTableError as exc:
            raise DataError(str(exc)) from None
        if len(rows) < global_batch_size:
            raise DataError(f"{path}: {len(rows)} rows, fewer than trainer.global_batch_size={global_batch_size}")
        return
    if data_cfg.image_root and not os.path.isdir(data_cfg.image_root):
        raise DataError(f"data.image_root={data_cfg.image_root!r} is not a directory; fix the path")
    table = getattr(data_cfg, "shape_table", None)
    if table:
        read_text(table, "data.shape_table")
    first = load_entries(path)[:FIRST_RECORDS]
    if not first:
        raise DataError(f"{path} holds no records")
    problems = [_record_problem(e) for e in first]
    if all(problems):
        raise DataError(f"{path}: none of the first {len(first)} records is usable, e.g. {problems[0]}; each "
                        'record needs "conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]')
