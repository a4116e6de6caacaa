"""Fake `torch_npu.contrib`."""
