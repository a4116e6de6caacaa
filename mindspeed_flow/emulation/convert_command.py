"""The `mindspeed-flow convert-checkpoint` entry: the converter (`hosts/mindspeed_mm/convert.py`), run where
Megatron is importable.

The saved args of a Megatron checkpoint are unpickled, so Megatron must import. On an Ascend node it does; on a
machine without it, MINDSPEED_MM_HOME, MINDSPEED_HOME and MEGATRON_HOME name the sources and the CPU emulation
stands in for torch_npu during the imports. The converter itself knows nothing of the emulation.
"""
from __future__ import annotations

import sys

from mindspeed_flow import emulation
from mindspeed_flow.emulation.sources import SourceError, find_sources
from mindspeed_flow.hosts.mindspeed_mm import convert


def ensure_megatron_importable() -> None:
    try:
        import megatron  # optional: megatron  # noqa: F401  (only: is it importable?)
        return
    except ImportError:
        pass
    try:
        sources = find_sources()
    except SourceError as err:
        raise SystemExit(f"mindspeed-flow convert-checkpoint: Megatron is not importable and {err}")
    emulation.activate()
    sys.path[:0] = sources.pythonpath()


def main(argv: list[str]) -> int:
    return convert.main(argv, prepare=ensure_megatron_importable)
