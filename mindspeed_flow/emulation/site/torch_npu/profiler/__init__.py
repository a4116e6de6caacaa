"""Fake `torch_npu.profiler`: torch.profiler on CPU with torch_npu's configuration classes accepted."""
from torch_npu.profiler import dynamic_profile, profiler  # noqa: F401
from torch_npu.profiler.profiler import (  # noqa: F401
    AiCMetrics, ExportType, ProfilerActivity, ProfilerLevel, _ExperimentalConfig, analyse, profile, schedule,
    supported_activities, tensorboard_trace_handler,
)
