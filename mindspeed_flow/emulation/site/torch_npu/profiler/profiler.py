"""Fake `torch_npu.profiler.profiler`: see mindspeed_flow.emulation.profiler."""
from mindspeed_flow.emulation.profiler import (  # noqa: F401
    AiCMetrics, ExportType, ProfilerActivity, ProfilerLevel, _ExperimentalConfig, analyse, profile, schedule,
    supported_activities, tensorboard_trace_handler,
)
