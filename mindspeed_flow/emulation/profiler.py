"""torch_npu.profiler stand-ins: torch.profiler on CPU, accepting torch_npu's extra configuration objects.

MindSpeed-MM builds its profiler even when profiling is off, so the constructors must accept the real keyword
arguments (`experimental_config`, `analyse_flag`, ...) and drop what torch.profiler does not know.
"""
from __future__ import annotations

import enum
from typing import Any, Callable

import torch.profiler as _tp

schedule = _tp.schedule


class ProfilerActivity(enum.Enum):
    CPU = "CPU"
    NPU = "NPU"


class ProfilerLevel:
    Level_none = "Level_none"
    Level0 = "Level0"
    Level1 = "Level1"
    Level2 = "Level2"


class AiCMetrics:
    PipeUtilization = "PipeUtilization"
    ArithmeticUtilization = "ArithmeticUtilization"
    Memory = "Memory"
    MemoryL0 = "MemoryL0"
    MemoryUB = "MemoryUB"
    ResourceConflictRatio = "ResourceConflictRatio"
    L2Cache = "L2Cache"
    AiCoreNone = "AiCoreNone"


class ExportType:
    Text = "text"
    Db = "db"


class _ExperimentalConfig:
    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


def supported_activities() -> set[ProfilerActivity]:
    return {ProfilerActivity.CPU}


def tensorboard_trace_handler(dir_name: str | None = None, worker_name: str | None = None,
                              analyse_flag: bool = True, async_mode: bool = False, **_: Any) -> Callable:
    return _tp.tensorboard_trace_handler(dir_name or "./profiling", worker_name)


def analyse(profiler_path: str, max_process_number: int = 1, **_: Any) -> None:
    """Offline NPU trace analysis: nothing to analyse for a CPU trace."""


def profile(activities: Any = None, schedule: Any = None, on_trace_ready: Any = None,  # noqa: A002
            record_shapes: bool = False, profile_memory: bool = False, with_stack: bool = False,
            with_flops: bool = False, with_modules: bool = False, experimental_config: Any = None,
            **_: Any) -> _tp.profile:
    """A CPU-only torch.profiler.profile with the torch_npu signature."""
    return _tp.profile(activities=[_tp.ProfilerActivity.CPU], schedule=schedule, on_trace_ready=on_trace_ready,
                       record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack,
                       with_flops=with_flops, with_modules=with_modules)
