"""Fake `torch_npu` (mindspeed-flow emulation): the Ascend adapter's Python surface, backed by the host CPU.

Only on sys.path when `mindspeed_flow.emulation.activate()` (or `mindspeed-flow emulate`) put it there. Importing
it registers the "npu" device type in the mode $MSF_EMULATION_MODE names (`EMULATION_MODE`): strict (default) builds
or loads the C++ npu device and registers the HCCL backend, as the real torch_npu does; lenient makes "npu" the host
CPU. `torch_npu.contrib.transfer_to_npu` then maps cuda to npu and nccl to hccl (strict), or cuda/npu to cpu and
nccl/hccl to gloo (lenient). Ops are the references of `mindspeed_flow.emulation.ops`; every call and every name
asked for but absent is logged (MSF_EMULATION_LOG).
"""
import functools as _functools
import sys as _sys

import torch as _torch

from mindspeed_flow.emulation import log as _log
from mindspeed_flow.emulation import mindspeed_ops as _mindspeed_ops
from mindspeed_flow.emulation import modes as _modes
from mindspeed_flow.emulation import ops as _ops
from mindspeed_flow.emulation import patching as _patching
from mindspeed_flow.utils import torchvision_compat as _tv_compat

__version__ = "2.7.1+msf.emulated"
EMULATED = True
EMULATION_MODE = _modes.resolve()

if EMULATION_MODE == _modes.STRICT:
    from mindspeed_flow.emulation import strict as _strict

    _strict.prepare()  # the C++ device first: the device module's names below depend on it

from torch_npu import npu  # noqa: E402  (the device module; must exist before install)

if EMULATION_MODE == _modes.STRICT:
    _strict.install_npu_device(npu)
else:
    _patching.install_npu_device(npu)
_tv_compat.install()
_ops.moe_ops.install_integer_histc(npu_only=EMULATION_MODE == _modes.STRICT)
_mindspeed_ops.install()  # MindSpeed's JIT-built grouped matmul (mindspeed.ops.gmm) answered by the emulator

# The real package imports these at top level; code reaches them as attributes (torch_npu._C._distributed_c10d...).
from torch_npu import _C, contrib, profiler, utils  # noqa: E402,F401


def _logged(name, fn):
    @_functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _log.record_call(f"torch_npu.{name}")
        return fn(*args, **kwargs)

    return wrapper


for _name, _fn in _ops.OPS.items():
    globals()[_name] = _logged(_name, _fn)

# dtypes torch_npu adds; torch supplies most of them natively, the rest are distinct placeholders.
float8_e4m3fn = getattr(_torch, "float8_e4m3fn", "torch_npu.float8_e4m3fn")
float8_e5m2 = getattr(_torch, "float8_e5m2", "torch_npu.float8_e5m2")
float8_e8m0fnu = getattr(_torch, "float8_e8m0fnu", "torch_npu.float8_e8m0fnu")
float4_e2m1fn_x2 = getattr(_torch, "float4_e2m1fn_x2", "torch_npu.float4_e2m1fn_x2")
float4_e1m2fn_x2 = "torch_npu.float4_e1m2fn_x2"
hifloat8 = "torch_npu.hifloat8"
# dtypes HCCL cannot send; MindSpeed's dist-train sync tool reads this list.
unsupported_dtype = []


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    _log.record_missing(f"torch_npu.{name}", _sys._getframe(1).f_code.co_filename)
    raise AttributeError(f"module 'torch_npu' has no attribute {name!r} (not emulated by mindspeed-flow; "
                         "see the MSF_EMULATION_LOG summary)")
