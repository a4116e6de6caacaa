"""Fake `torch_npu._C`: the HCCL process-group options class and a host-cache hook."""
from torch_npu._C import _distributed_c10d  # noqa: F401


def _npu_hostEmptyCache():  # noqa: N802 - the real name
    return None
