"""Fake `torch_npu._C._distributed_c10d`: `ProcessGroupHCCL.Options` carries `hccl_config`; gloo ignores it."""


class ProcessGroupHCCL:
    class Options:
        def __init__(self):
            self.hccl_config = {}
            self.is_high_priority_stream = False
            self._timeout = None
