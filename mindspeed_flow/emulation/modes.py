"""Which emulated NPU a process gets: strict (the default) or lenient.

- strict: "npu" is a real PrivateUse1 device (a C++ extension over host memory, see `npu_ext`), HCCL is a real
  process-group backend for npu tensors, and transfer_to_npu maps cuda to npu as the real one does. What a real
  Ascend device refuses (host and device tensors in one op, a host tensor in an HCCL collective, npu:0 with
  npu:1) is refused here too.
- lenient: an "npu" tensor is a host CPU tensor (cuda/npu devices map to cpu, nccl/hccl to gloo); fast, and forgiving
  of exactly the mistakes strict mode exists to catch.

The mode comes from `activate(mode=...)`, else from $MSF_EMULATION_MODE, else strict. Activation writes it back into
the environment, so the processes a job starts (ranks, data-loader workers, subprocesses) run in the same mode.
"""
from __future__ import annotations

import os

ENV_VAR = "MSF_EMULATION_MODE"
STRICT = "strict"
LENIENT = "lenient"
MODES = (STRICT, LENIENT)


def resolve(mode: str | None = None) -> str:
    """`mode`, else $MSF_EMULATION_MODE, else strict; anything else is an error naming the choices."""
    value = (mode if mode is not None else os.environ.get(ENV_VAR) or STRICT).strip().lower()
    if value not in MODES:
        raise ValueError(f"emulation mode {value!r} (from {'the argument' if mode is not None else ENV_VAR}) is "
                         f"not one of {', '.join(MODES)}")
    return value
