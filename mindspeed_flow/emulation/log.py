"""The emulation log: every emulated torch_npu API touched and every missing torch_npu name asked for.

Enabled by MSF_EMULATION_LOG=<path> (each process appends one line per *first* event, prefixed with its rank,
and prints a summary to stderr at exit). A new MindSpeed release that asks for new names shows up here as
`MISSING torch_npu.<name>` lines, each usually one stub away from running.
"""
from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
from typing import Callable

ENV_VAR = "MSF_EMULATION_LOG"

_LOCK = threading.Lock()
_CALLS: collections.Counter[str] = collections.Counter()
_MISSING: collections.Counter[str] = collections.Counter()
_REGISTERED = False
_SUMMARY_LINES: list[Callable[[], str]] = []  # more summary lines (strict mode: the npu's memory peak)


def _rank() -> str:
    return os.environ.get("RANK", "-")


def _append(line: str) -> None:
    path = os.environ.get(ENV_VAR)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(f"rank={_rank()} pid={os.getpid()} {line}\n")


def _register_summary() -> None:
    global _REGISTERED
    if not _REGISTERED and os.environ.get(ENV_VAR):
        atexit.register(_summarise)
        _REGISTERED = True


def record_call(name: str) -> None:
    """Count a call of an emulated API (`name` like `torch_npu.npu_fusion_attention`)."""
    with _LOCK:
        first = name not in _CALLS
        _CALLS[name] += 1
        _register_summary()
    if first:
        _append(f"CALLED {name}")


# Modules that probe every attribute of every loaded module (MindSpeed's patch manager rebinds patched names
# wherever they were imported): their lookups are scans, not requests for a torch_npu feature.
_SCANNERS = ("mindspeed/patch_utils.py",)


def record_missing(name: str, caller_file: str | None = None) -> None:
    """Note a name that code asked the fake package for and that it does not provide (scans excluded)."""
    if caller_file and caller_file.replace("\\", "/").endswith(_SCANNERS):
        return
    with _LOCK:
        first = name not in _MISSING
        _MISSING[name] += 1
        _register_summary()
    if first:
        _append(f"MISSING {name}")


def calls() -> dict[str, int]:
    return dict(_CALLS)


def missing() -> dict[str, int]:
    return dict(_MISSING)


def add_summary_line(line: Callable[[], str]) -> None:
    """Have the exit summary carry one more line, computed at exit."""
    _SUMMARY_LINES.append(line)


def summary() -> str:
    called = ", ".join(f"{n} x{c}" for n, c in sorted(_CALLS.items())) or "none"
    absent = ", ".join(sorted(_MISSING)) or "none"
    lines = [f"called: {called}", f"missing: {absent}"] + [line() for line in _SUMMARY_LINES]
    return "\n".join(f"[msf-emulation rank={_rank()}] {line}" for line in lines)


def _summarise() -> None:
    text = summary()
    _append("SUMMARY " + text.replace("\n", " | "))
    print(text, file=sys.stderr)


def read_log(path: str) -> dict[str, set[str]]:
    """Parse a log file into {'CALLED': {...names}, 'MISSING': {...names}} (all ranks together)."""
    out: dict[str, set[str]] = {"CALLED": set(), "MISSING": set()}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 4 and parts[2] in out:
                out[parts[2]].add(parts[3])
    return out
