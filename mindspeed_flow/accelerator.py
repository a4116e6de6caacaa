"""The one place that decides device type, process-group backend, device module, streams and events, memory
stats and per-device peak FLOPs: npu/hccl (Ascend, torch_npu), cuda/nccl, or cpu/gloo.

torch_npu is imported here only, only when it is installed, and its absence is not an error. Everything else in
mindspeed-flow asks an `Accelerator` instead of touching `torch.cuda` / `torch.npu` directly, so the same code
runs on Ascend, on NVIDIA GPUs and on the CPU (how CI tests it).

`mindspeed-flow doctor` (mindspeed_flow/doctor.py) prints what this machine offers.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional

import torch

from mindspeed_flow.skus import peak_flops

# Ascend's PyTorch adapter: optional, imported only where the device is an NPU (see the module docstring).
NPU_MODULE = "torch_npu"


def _torch_npu_available() -> bool:
    # find_spec does not import: importing torch_npu without CANN breaks `import torch` itself.
    return importlib.util.find_spec(NPU_MODULE) is not None and bool(os.environ.get("ASCEND_HOME_PATH")
                                                                     or os.path.isdir("/usr/local/Ascend"))


@dataclass
class Accelerator:
    """Device + backend abstraction. Construct with `Accelerator.detect()` or `Accelerator.for_type(...)`."""

    device_type: str  # "npu" | "cuda" | "cpu"
    backend: str  # "hccl" | "nccl" | "gloo"
    device_name: str = "cpu"
    capabilities: dict[str, bool] = field(default_factory=dict)

    # --- construction -------------------------------------------------------------------------------------
    @staticmethod
    def detect(prefer: str = "auto") -> "Accelerator":
        """`prefer`: auto | npu | cuda | cpu. auto takes npu, then cuda, then cpu."""
        if prefer in ("auto", "npu") and _torch_npu_available():
            importlib.import_module(NPU_MODULE)
            if torch.npu.is_available():  # type: ignore[attr-defined]
                return Accelerator.for_type("npu")
        if prefer == "npu":
            raise RuntimeError("device=npu requested but torch_npu/CANN is not available on this machine")
        if prefer in ("auto", "cuda") and torch.cuda.is_available():
            return Accelerator.for_type("cuda")
        if prefer == "cuda":
            raise RuntimeError("device=cuda requested but torch.cuda.is_available() is False")
        return Accelerator.for_type("cpu")

    @staticmethod
    def for_type(device_type: str) -> "Accelerator":
        if device_type == "npu":
            name = torch.npu.get_device_name(0)  # type: ignore[attr-defined]
            caps = {"mc2": _has_mc2_ops(), "streams": True, "pinned_memory": True}
            return Accelerator("npu", "hccl", name, caps)
        if device_type == "cuda":
            name = torch.cuda.get_device_name(0)
            return Accelerator("cuda", "nccl", name, {"mc2": False, "streams": True, "pinned_memory": True})
        if device_type == "cpu":
            return Accelerator("cpu", "gloo", f"cpu ({platform.processor() or platform.machine()})",
                               {"mc2": False, "streams": False, "pinned_memory": False})
        raise ValueError(f"device type {device_type!r}: expected npu, cuda or cpu")

    # --- devices, streams, events -----------------------------------------------------------------------
    @property
    def module(self) -> Any:
        """torch.npu / torch.cuda, or None on CPU."""
        return getattr(torch, self.device_type, None) if self.device_type != "cpu" else None

    def device(self, local_rank: int = 0) -> torch.device:
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, local_rank % max(1, self.module.device_count()))

    def set_device(self, local_rank: int) -> torch.device:
        dev = self.device(local_rank)
        if self.module is not None:
            self.module.set_device(dev)
        return dev

    def synchronize(self) -> None:
        if self.module is not None:
            self.module.synchronize()

    @contextlib.contextmanager
    def stream(self, stream: Optional[Any]) -> Iterator[None]:
        if stream is None or self.module is None:
            yield
            return
        with self.module.stream(stream):
            yield

    def event(self) -> Optional[Any]:
        return self.module.Event(enable_timing=False) if self.module is not None else None

    # --- memory ---------------------------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, float]:
        """Allocated / peak bytes on the device; on CPU the process RSS peak (what bounds a CPU job)."""
        if self.module is not None:
            return {"allocated_bytes": float(self.module.memory_allocated()),
                    "peak_bytes": float(self.module.max_memory_allocated())}
        try:
            import resource  # optional: POSIX

            peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return {"allocated_bytes": float("nan"), "peak_bytes": float(peak_kb) * 1024.0}
        except ImportError:  # pragma: no cover - non-POSIX
            return {"allocated_bytes": float("nan"), "peak_bytes": float("nan")}

    def reset_peak_memory(self) -> None:
        if self.module is not None:
            self.module.reset_peak_memory_stats()

    # --- FLOPs ------------------------------------------------------------------------------------------------
    def peak_flops(self, dtype: str) -> Optional[float]:
        """Nominal dense peak of one device (the planner's per-SKU table: 910B SKUs differ, so the name decides).
        On CPU the runtime measures a matmul instead, since the table's CPU entry is only nominal."""
        return peak_flops("cpu" if self.device_type == "cpu" else self.device_name, dtype)

    # --- kernels --------------------------------------------------------------------------------------------
    @property
    def varlen_attention_kernel(self) -> str:
        """The kernel packed microbatches attend with (see `varlen_attention_kernel`)."""
        return varlen_attention_kernel(self.device_type)

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "varlen_attention_kernel": self.varlen_attention_kernel, "torch": torch.__version__, "python": sys.version.split()[0],
                "peak_tflops": {d: self.peak_flops(d) and self.peak_flops(d) / 1e12 for d in ("bf16", "fp32")}}


def detect_type(prefer: str = "auto") -> str:
    """The device type `Accelerator.detect(prefer)` would pick, found without initialising the device runtime:
    a process that forks workers (the local launcher, `bench device`) must not have touched CUDA/NPU first."""
    if prefer in ("npu", "cuda", "cpu"):
        return prefer
    if prefer != "auto":
        raise ValueError(f"device {prefer!r}: expected auto, npu, cuda or cpu")
    if _torch_npu_available():
        return "npu"
    return "cuda" if torch.cuda.is_available() else "cpu"  # is_available() does not initialise CUDA


def varlen_attention_kernel(device_type: str) -> str:
    """Varlen attention kernel by device type (`mindspeed_flow.hosts.torch.attention.KERNELS`).

    npu: `npu_fusion_attention` in the TND layout (sequence boundaries as cumulative lengths). cuda and cpu:
    one causal SDPA call per sequence, which dispatches to the flash / memory-efficient kernels (no mask
    argument), so no backend ever materialises a T x T mask.
    """
    return "npu_fusion_attention" if device_type == "npu" else "sdpa_segments"


def _has_mc2_ops() -> bool:
    try:
        torch_npu = importlib.import_module(NPU_MODULE)
    except ImportError:
        return False
    return all(hasattr(torch_npu, op) for op in ("npu_all_gather_base_mm", "npu_mm_reduce_scatter_base"))

