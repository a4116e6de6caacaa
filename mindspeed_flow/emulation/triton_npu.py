"""Triton's active driver under emulation: an Ascend NPU that answers device queries and launches nothing.

On Ascend, MindSpeed-MM's Triton kernels (the gated delta rule of Qwen3.5 / Qwen3-Next, `mindspeed_mm/fsdp/ops/gdn/`)
run through triton-ascend, and some of their modules query the NPU when they are imported, e.g.
`CUBE_CORE_NUM = driver.active.utils.get_device_properties(torch.npu.current_device())['num_aicore']`. Those modules
are imported by jobs that never run the kernels: `pretrain_transformers.py` with HF weights imports MindSpeed-MM's
checkpoint bridge for every model family, and the bridge imports them. On the host CPU triton's default driver is
CUDA's, which fails at the first query ("libcuda.so cannot found"). Under emulation the active driver is this one:
device properties of an Ascend 910B2 (the figures below, with their source), the target's backend "npu", and a
clear error if a kernel is actually launched (the emulator does not run Triton kernels).

Installed lazily by the emulation's `sitecustomize` right after `triton.runtime.driver` is imported, so jobs that
never import triton pay nothing.
"""
from __future__ import annotations

from typing import Any

# Ascend 910B2 (CANN platform file Ascend910B2.ini: ai_core_cnt=24, vector_core_cnt=48, ub_size=196608): the
# cube-core count, the vector-core count (two per AI core) and the unified buffer, which triton-ascend reports as
# `num_aicore`, `num_vectorcore` and `max_shared_mem`.
DEVICE_PROPERTIES: dict[str, int] = {"num_aicore": 24, "num_vectorcore": 48, "max_shared_mem": 196608}
BACKEND = "npu"


class KernelLaunchUnderEmulation(RuntimeError):
    """A Triton kernel was about to run on the emulated NPU."""


class _Utils:
    def get_device_properties(self, device: Any) -> dict[str, int]:
        return dict(DEVICE_PROPERTIES)

    def __getattr__(self, name: str) -> Any:
        raise KernelLaunchUnderEmulation(
            f"triton driver utils.{name}: Triton kernels do not run under mindspeed-flow emulate (device queries do)")


class _Target:
    def __init__(self) -> None:
        self.backend, self.arch, self.warp_size = BACKEND, "Ascend910B2", 0


class EmulatedNpuDriver:
    """The object `triton.runtime.driver.active` names under emulation."""

    utils = _Utils()

    @staticmethod
    def is_active() -> bool:
        return True

    def get_current_target(self) -> _Target:
        return _Target()

    def get_current_device(self) -> int:
        import torch  # lazy: only when asked

        return torch.npu.current_device() if hasattr(torch, "npu") else 0

    def get_benchmarker(self) -> Any:  # asked for when @triton.autotune decorates a kernel; used only to run it
        def benchmark(*_: Any, **__: Any) -> Any:
            raise KernelLaunchUnderEmulation("triton autotuning: Triton kernels do not run under mindspeed-flow emulate")

        return benchmark

    def __getattr__(self, name: str) -> Any:
        raise KernelLaunchUnderEmulation(
            f"triton driver .{name}: Triton kernels do not run under mindspeed-flow emulate (device queries do)")


def install(driver_module: Any) -> None:
    """Make the emulated NPU the active driver of `triton.runtime.driver` (the module just imported)."""
    driver_module.driver.set_active(EmulatedNpuDriver())
