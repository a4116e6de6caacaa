"""Fake `torch_npu.contrib.transfer_to_npu`: importing it maps cuda -> npu and nccl -> hccl (strict, as the real one
does), or cuda/npu -> cpu and nccl/hccl -> gloo (lenient)."""
import torch_npu as _torch_npu

from mindspeed_flow.emulation import log as _log
from mindspeed_flow.emulation import modes as _modes
from mindspeed_flow.emulation import patching as _patching

if _torch_npu.EMULATION_MODE == _modes.STRICT:
    from mindspeed_flow.emulation import strict as _strict

    _strict.install_transfer_to_npu()
else:
    _patching.install_transfer_to_npu()
_log.record_call("torch_npu.contrib.transfer_to_npu")
