"""Run a MindSpeed-MM entry script with the mindspeed-flow patch set applied.

    python -m mindspeed_flow_patches.launch pretrain_vlm.py <args...>      (or under torchrun -m ...)

Order matters and follows MindSpeed's own rules:
1. `sys.argv` becomes the script's argv first: `import mindspeed.megatron_adaptor` parses feature flags from it.
2. `import mindspeed.megatron_adaptor` (torch_npu transfer + MindSpeed feature patches).
3. Import `mindspeed_mm` and every patch target module BEFORE `apply_patches()`: a target imported inside the
   patch loop runs MindSpeed-MM's import-time `register_patch` calls while MindSpeed iterates its patch dict
   (`RuntimeError: dictionary changed size during iteration`).
4. Register each patch module's patches, `apply_patches()`, then run the script as `__main__`.
"""
from __future__ import annotations

import importlib
import os
import runpy
import sys
from types import ModuleType

# Patch modules of this package, applied in order; each exposes TARGET_MODULES and register(patch_manager).
PATCH_MODULES: tuple[str, ...] = ("mindspeed_flow_patches.mc2",)
APPLIED_ENV = "MSF_PATCHES_APPLIED"


def _patch_modules() -> list[ModuleType]:
    return [importlib.import_module(name) for name in PATCH_MODULES]


def apply_flow_patches() -> list[str]:
    """Import the targets, register every patch, apply them; returns the applied patch module names."""
    import mindspeed.megatron_adaptor  # noqa: F401  (step 2)
    from mindspeed.patch_utils import MindSpeedPatchesManager

    importlib.import_module("mindspeed_mm")
    modules = _patch_modules()
    for mod in modules:
        for target in mod.TARGET_MODULES:
            importlib.import_module(target)
    for mod in modules:
        mod.register(MindSpeedPatchesManager)
    MindSpeedPatchesManager.apply_patches()
    names = [mod.__name__ for mod in modules]
    os.environ[APPLIED_ENV] = ",".join(names)
    return names


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].endswith(".py"):
        print("usage: python -m mindspeed_flow_patches.launch SCRIPT.py [args...]", file=sys.stderr)
        return 2
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        print(f"mindspeed_flow_patches.launch: script {argv[0]!r} not found (cwd {os.getcwd()})", file=sys.stderr)
        return 2
    sys.argv = [script] + argv[1:]  # step 1
    sys.path.insert(0, os.path.dirname(script))
    names = apply_flow_patches()
    if os.environ.get("RANK", "0") == "0":
        print(f"[mindspeed_flow_patches] applied: {', '.join(names)}", flush=True)
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
