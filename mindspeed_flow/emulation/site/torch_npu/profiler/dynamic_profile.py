"""Fake `torch_npu.profiler.dynamic_profile`: dynamic profiling is a no-op under emulation."""


def init(path, *args, **kwargs):
    return None


def step(*args, **kwargs):
    return None
