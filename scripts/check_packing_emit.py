#!/usr/bin/env python
"""Check a packing assignment written by `mindspeed-flow bench packing --emit PATH.json`, independently.

    python scripts/check_packing_emit.py PATH.json

The file: {"budget": T, "steps": [[[ids of microbatch 0], [microbatch 1], ...] per DP rank] per step],
"lengths": {"<sample id>": tokens}, "oversize": [[id, tokens], ...] (optional)}.

Rules: every sample in `lengths` is placed exactly once over all steps, unless listed in `oversize` with more
tokens than the budget; no placed id is unknown; no microbatch holds more than `budget` tokens; within a step
every DP rank has the same number of microbatches. Exits 0 and prints a summary when all hold; otherwise exits 1
and prints the first broken rule with the step, rank, microbatch and sample it concerns. Uses only the standard
library and reads nothing from mindspeed_flow, so it checks the packer rather than trusting it.
"""
from __future__ import annotations

import json
import sys
from typing import Any


class EmitError(Exception):
    pass


def load(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise EmitError(f"{path}: cannot read JSON ({exc})") from None
    for key in ("budget", "steps", "lengths"):
        if key not in doc:
            raise EmitError(f"{path}: missing key {key!r}")
    if not isinstance(doc["budget"], int) or doc["budget"] < 1:
        raise EmitError(f"budget {doc['budget']!r} must be a positive integer")
    return doc


def check(doc: dict[str, Any]) -> str:
    budget = doc["budget"]
    lengths = {int(k): int(v) for k, v in doc["lengths"].items()}
    for sid, tokens in lengths.items():
        if tokens < 1:
            raise EmitError(f"sample {sid}: length {tokens} must be >= 1")
    oversize = {int(sid): int(tokens) for sid, tokens in doc.get("oversize", [])}
    for sid, tokens in oversize.items():
        if tokens <= budget:
            raise EmitError(f"sample {sid} is reported oversize with {tokens} tokens, within the budget {budget}")
    placed_at: dict[int, str] = {}
    microbatches = 0
    for s, step in enumerate(doc["steps"]):
        counts = [len(rank) for rank in step]
        if len(set(counts)) > 1:
            raise EmitError(f"step {s}: DP ranks have different microbatch counts {counts}")
        for r, rank in enumerate(step):
            for m, mb in enumerate(rank):
                where = f"step {s} rank {r} microbatch {m}"
                microbatches += 1
                total = 0
                for sid in mb:
                    if sid not in lengths:
                        raise EmitError(f"{where}: sample {sid} is not in lengths")
                    if sid in oversize:
                        raise EmitError(f"{where}: sample {sid} is placed but also reported oversize")
                    if sid in placed_at:
                        raise EmitError(f"{where}: sample {sid} already placed at {placed_at[sid]}")
                    placed_at[sid] = where
                    total += lengths[sid]
                if total > budget:
                    raise EmitError(f"{where}: {total} tokens exceed the budget {budget}")
    missing = sorted(set(lengths) - set(placed_at) - set(oversize))
    if missing:
        raise EmitError(f"{len(missing)} sample(s) never placed, for example {missing[:10]}")
    real = sum(lengths[sid] for sid in placed_at)
    return (f"ok: {len(placed_at)} samples placed exactly once in {len(doc['steps'])} steps, {microbatches} "
            f"microbatches, none over the budget {budget}; fill at budget {real / max(1, microbatches * budget):.4f};"
            f" {len(oversize)} oversize reported")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: check_packing_emit.py PATH.json", file=sys.stderr)
        return 2
    try:
        print(check(load(argv[0])))
    except EmitError as exc:
        print(f"check_packing_emit: FAIL: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
