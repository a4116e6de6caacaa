"""Fake `torch_npu.utils.collect_env`."""


def get_cann_version():
    return "emulated"
