"""Fake `torch_npu.contrib.transfer_to_npu`: importing it maps cuda/npu -> cpu and nccl/hccl -> gloo."""
from mindspeed_flow.emulation import log as _log
from mindspeed_flow.emulation import patching as _patching

_patching.install_transfer_to_npu()
_log.record_call("torch_npu.contrib.transfer_to_npu")
