"""The benchmarks behind `mindspeed-flow bench NAME` (one module each), and their shared entry point."""
from __future__ import annotations

import json
from typing import Any, Callable, Sequence


def bench_main(argv: Sequence[str] | None, parse_args: Callable[[Sequence[str]], Any],
               measure: Callable[[Any], dict], table: Callable[[dict, Any], str]) -> int:
    """parse -> measure -> print the report as a table, or as one JSON object with --json."""
    args = parse_args(argv or [])
    report = measure(args)
    print(json.dumps(report) if args.json else table(report, args))
    return 0
