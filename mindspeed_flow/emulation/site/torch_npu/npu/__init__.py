"""Fake `torch_npu.npu` (also registered as `torch.npu`): see mindspeed_flow.emulation.device."""
import sys as _sys

from mindspeed_flow.emulation import log as _log
from mindspeed_flow.emulation.device import *  # noqa: F401,F403
from mindspeed_flow.emulation.device import (  # noqa: F401  (underscore names are skipped by *)
    _get_device_index, _initialized, _is_in_bad_fork, _lazy_call, _lazy_init, _utils,
)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    _log.record_missing(f"torch_npu.npu.{name}", _sys._getframe(1).f_code.co_filename)
    raise AttributeError(f"module 'torch_npu.npu' has no attribute {name!r} (not emulated by mindspeed-flow)")
