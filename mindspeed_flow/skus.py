"""The device SKU table: dense peaks per dtype, memory and the source of every figure, and the lookup by device name.

`SKUS` holds, per device SKU, nominal dense peaks (TFLOP/s, no sparsity) per dtype, memory and the source of the
figures. Cluster presets name their `sku` and take these figures from it; the runtime's MFU reads the device name
(`torch_npu.npu.get_device_name()` gives e.g. "Ascend910B3") and looks it up with `peak_flops`. Figures are
vendor-nominal; MFU computed against them is only as good as the SKU match, so every report prints the peak it used.
Pure data and string matching: nothing here imports torch or the rest of the package.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# The name `mindspeed-flow emulate`'s npu reports: an NPU over host memory, no SKU of its own (MFU measures the host
# CPU's peak on it instead of looking one up).
EMULATED_NPU_NAME = "Emulated Ascend NPU (host CPU)"


@dataclass(frozen=True)
class Sku:
    """One device as the runtime schedules it (an A3 die, not the two-die 910C package): dense peaks, memory, source."""

    peak_tflops: dict[str, float]  # TFLOP/s, dense (no sparsity), per dtype
    hbm_gb: float
    hbm_tbps: float
    source: str  # where the figures come from; "not confirmed" says so


# The one peak table: cluster presets (recipes/cluster/*.yaml) take peak_tflops / hbm from their `sku`, and the
# runtime's MFU (mindspeed_flow.accelerator) looks the device name up here, so both use the same figures.
SKUS: dict[str, Sku] = {
    # Atlas 900 A3: the 910C package (~752 TFLOPS bf16, 128 GB, 3.2 TB/s) is two dies; the runtime schedules
    # each die as one device (16 per node), so the device is half a package.
    "ascend910c_die": Sku({"bf16": 376.0, "fp16": 376.0}, 64.0, 1.6,
                          "CloudMatrix384, arXiv 2506.12708 (package: 752 TFLOPS bf16, 128 GB, 3.2 TB/s); one die = "
                          "half; die-level scheduling: MindCluster guide (hiascend.com), MindSpeed-MM A3 scripts "
                          "NPUS_PER_NODE=16"),
    # 910B2: 24 AI cores at 1.8 GHz, 8192 fp16 FLOP/cycle/core -> 353.9 TFLOPS.
    "ascend910b2": Sku({"bf16": 353.9, "fp16": 353.9}, 64.0, 1.6,
                       "CANN platform config Ascend910B2C.ini: 24 AI cores x 1.8 GHz x 8192 FLOP/cycle; HBM 64 GB"),
    # 910B3: 20 AI cores; the usual 313 TFLOPS figure implies ~1.91 GHz, which no public config confirms.
    "ascend910b3": Sku({"bf16": 313.0, "fp16": 313.0}, 64.0, 1.6,
                       "20 AI cores (HAMi ascend-device-configmap.yaml); 313 TFLOPS is the common vendor figure, "
                       "clock not confirmed"),
    "ascend910b1": Sku({"bf16": 376.0, "fp16": 376.0}, 64.0, 1.6, "vendor figure, not confirmed"),
    "ascend910b4": Sku({"bf16": 280.0, "fp16": 280.0}, 32.0, 0.8, "vendor figure, not confirmed"),
    "h100_sxm": Sku({"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}, 80.0, 3.35,
                    "NVIDIA H100 Tensor Core GPU datasheet (SXM, dense)"),
    "h200": Sku({"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}, 141.0, 4.8,
                "NVIDIA H200 Tensor Core GPU datasheet (SXM, dense)"),
    "a100": Sku({"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}, 80.0, 2.0,
                "NVIDIA A100 Tensor Core GPU datasheet (SXM 80 GB, dense)"),
    # nominal: a CPU-emulated cluster is calibrated by `mindspeed-flow profile`
    "cpu": Sku({"bf16": 0.1, "fp16": 0.1, "fp32": 0.1}, 8.0, 0.02, "nominal; calibrate with mindspeed-flow profile"),
}
PEAK_TFLOPS: dict[str, dict[str, float]] = {k: v.peak_tflops for k, v in SKUS.items()}

# Device-name regexes (searched case-insensitively, first match wins) -> SKU key. torch_npu names an A3 die
# "Ascend910_93xx": one die, so the die's peak (reading the package's would halve MFU).
_SKU_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"910_?93|910c", "ascend910c_die"),
    (r"910b1", "ascend910b1"),
    (r"910b2", "ascend910b2"),  # also 910B2C
    (r"910b3", "ascend910b3"),
    (r"910b4", "ascend910b4"),
    (r"h200", "h200"),
    (r"h100|h800", "h100_sxm"),
    (r"a100|a800", "a100"),
    (r"^cpu$", "cpu"),
)
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def normalize_dtype(dtype: str) -> str:
    d = str(dtype).lower().replace("torch.", "")
    return _DTYPE_ALIASES.get(d, d)


def sku_of(device_name: str) -> str | None:
    """SKU key of a device name ("Ascend910B3", "NVIDIA H100 80GB HBM3", "cpu"), or None if unknown."""
    name = device_name.strip().lower()
    if name in PEAK_TFLOPS:
        return name
    for pattern, sku in _SKU_PATTERNS:
        if re.search(pattern, name):
            return sku
    return None


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak in FLOP/s (not TFLOP/s) of one device for `dtype`, or None when the SKU or dtype is unknown."""
    sku = sku_of(device_name)
    if sku is None:
        return None
    tflops = PEAK_TFLOPS[sku].get(normalize_dtype(dtype))
    return None if tflops is None else tflops * 1e12
