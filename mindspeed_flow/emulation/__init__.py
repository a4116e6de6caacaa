"""Ascend emulation: run MindSpeed / MindSpeed-MM code paths on CPU with a fake `torch_npu` and `torchair`.

Nothing here is loaded by `import mindspeed_flow`, and importing this package has no side effects: the fake
packages live in `site/`, which only `activate()` (in-process) or `site_env()` (for a launched job) puts on the
import path. On a real Ascend machine the real torch_npu is therefore the only one ever imported.

    from mindspeed_flow import emulation
    emulation.activate()                    # sys.path gains site/; torch_npu + transfer_to_npu are imported
    import torch_npu                        # the fake: a strict npu device over host memory, HCCL over gloo

Two modes (`modes.py`): strict, the default, emulates a real device (npu tensors are a PrivateUse1 device that
refuses host tensors in device ops, HCCL takes only npu tensors, cuda maps to npu); lenient
(`activate(mode="lenient")` or MSF_EMULATION_MODE=lenient) makes every npu tensor a host CPU tensor.

`activate()` patches torch process-wide and irreversibly (like the real transfer_to_npu): call it in a job, a
subprocess or a forked rank, never in a long-lived process that must keep plain torch.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from mindspeed_flow.emulation import modes

SITE_DIR = Path(__file__).resolve().parent / "site"
REPO_ROOT = Path(__file__).resolve().parents[2]


def site_dir() -> str:
    """The folder holding the fake `torch_npu` and `torchair` packages."""
    return str(SITE_DIR)


def _real_torch_npu_loaded() -> bool:
    mod = sys.modules.get("torch_npu")
    return mod is not None and not getattr(mod, "EMULATED", False)


def activate(transfer: bool = True, mode: str | None = None) -> str:
    """Put the fake packages first on sys.path and import them (with transfer_to_npu unless `transfer=False`).

    `mode` is "strict" or "lenient" (default: $MSF_EMULATION_MODE, else strict); it is written to the environment
    so child processes match. Returns the mode. Raises if a real torch_npu is already imported (mixing the two
    would silently run half the job on CPU) or if the emulation is already active in the other mode.
    """
    if _real_torch_npu_loaded():
        raise RuntimeError("mindspeed_flow.emulation.activate(): a real torch_npu is already imported in this "
                           "process; emulation is for machines without Ascend devices")
    chosen = modes.resolve(mode)
    if is_active() and sys.modules["torch_npu"].EMULATION_MODE != chosen:
        raise RuntimeError(f"mindspeed_flow.emulation.activate(mode={chosen!r}): this process already runs the "
                           f"{sys.modules['torch_npu'].EMULATION_MODE} emulation, which cannot be undone")
    os.environ[modes.ENV_VAR] = chosen
    if site_dir() not in sys.path:
        sys.path.insert(0, site_dir())
    import torch_npu  # lazy: after sys.path  # noqa: F401

    if transfer:
        from torch_npu.contrib import transfer_to_npu  # lazy: after sys.path  # noqa: F401
    return chosen


def is_active() -> bool:
    """True when this process imported the fake torch_npu."""
    mod = sys.modules.get("torch_npu")
    return bool(mod is not None and getattr(mod, "EMULATED", False))


def site_env(base: dict[str, str] | None = None, mode: str | None = None) -> dict[str, str]:
    """An environment for a child process that sees the fake packages (and this repo) first on PYTHONPATH.

    With `mode`, the child runs that emulation mode; without, it runs the mode `base` names in
    MSF_EMULATION_MODE, else strict (the fake torch_npu's default).
    """
    env = dict(os.environ if base is None else base)
    parts = [site_dir(), str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    if mode is not None:
        env[modes.ENV_VAR] = modes.resolve(mode)
    return env
