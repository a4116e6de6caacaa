"""MindSpeed's JIT-built custom ops answered by the emulator: `mindspeed.ops.gmm` (Megatron's `--moe-grouped-gemm`).

MindSpeed loads each custom op by compiling C++ against CANN at first use (`mindspeed/op_builder/builder.py`
`MindSpeedOpBuilder.load`), which cannot work without an Ascend toolkit. Once the fake `torch_npu` is imported,
`install()` makes `load()` of the builders named in `EMULATED_BUILDERS` return a module of emulated functions
instead; every other builder still tries to compile, as before. Written against the pinned MindSpeed 028de58c.

The grouped GEMM builders (`GMMOpBuilder` "grouped_matmul", `GMMV2OpBuilder` "grouped_matmul_v2") are what
`mindspeed.ops.gmm.GMMFunction` loads for MindSpeed's Megatron MoE experts (`core/transformer/moe/
grouped_gemm_util.py` Ops.gmm, the fb_overlap experts). Their kernels (`mindspeed/ops/csrc/cann/gmm.cpp`) are
aclnnGroupedMatmul with split_item 3: npu_gmm(x, weight, bias, group_list, group_type, group_list_type) -> [y];
npu_gmm_backward(grad, x, weight, group_list, group_list_type) -> (dx = gmm(grad, weight^T, group_type 0),
dw = gmm(x^T, grad, group_type 2) in weight's shape, dbias = []). They run on `moe_ops.npu_grouped_matmul`,
which checks each call. `npu_gmm_backward_fusion` (`--gemm-gradient-accumulation-fusion`, which also needs the
JIT-built groupmatmul_add op) is refused.

`torch.ops.mindspeed.npu_gmm` is registered by MindSpeed for the PrivateUse1 key only, so this path runs in
strict mode (npu tensors); in lenient mode npu tensors are host tensors and MindSpeed's op has no CPU kernel.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Sequence

import torch

from mindspeed_flow.emulation import log, moe_ops

_BUILDER_PACKAGE = "mindspeed.op_builder"
_BUILDER_MODULE = "mindspeed.op_builder.builder"


def _gmm(x: Sequence[torch.Tensor], weight: Sequence[torch.Tensor], bias: Sequence[torch.Tensor],
         group_list: Sequence[int] | torch.Tensor | None, group_type: int | None,
         group_list_type: int | None) -> list[torch.Tensor]:
    """gmm.cpp npu_gmm: one grouped matmul with split_item 3 (a single output tensor)."""
    return moe_ops.npu_grouped_matmul(list(x), list(weight), bias=list(bias) or None, group_list=group_list,
                                      split_item=3, group_type=group_type,
                                      group_list_type=0 if group_list_type is None else group_list_type)


def _gmm_backward(grad: Sequence[torch.Tensor], x: Sequence[torch.Tensor], weight: Sequence[torch.Tensor],
                  group_list: Sequence[int] | torch.Tensor | None,
                  group_list_type: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """gmm.cpp npu_gmm_backward: dx by splitting M on the transposed weights, dw by splitting K."""
    dx = _gmm(grad, [w.transpose(-1, -2) for w in weight], [], group_list, 0, group_list_type)
    dw = _gmm([t.transpose(-1, -2) for t in x], grad, [], group_list, 2, group_list_type)
    return dx, [d.reshape(w.shape) for d, w in zip(dw, weight)], []


def _gmm_backward_fusion(*_: Any, **__: Any) -> Any:
    """gmm.cpp npu_gmm_backward_fusion: the weight gradient accumulated in place into main_grad."""
    raise NotImplementedError("mindspeed.ops.gmm: gemm_fusion (--gemm-gradient-accumulation-fusion) is not "
                              "emulated; run without it")


def _gmm_module(name: str) -> types.ModuleType:
    """The functions a loaded grouped-matmul extension module exposes."""
    module = types.ModuleType(f"msf_emulated_{name}")
    module.npu_gmm = _gmm
    module.npu_gmm_backward = _gmm_backward
    module.npu_gmm_backward_fusion = _gmm_backward_fusion
    return module


EMULATED_BUILDERS: dict[str, types.ModuleType] = {name: _gmm_module(name)
                                                  for name in ("grouped_matmul", "grouped_matmul_v2")}


def _patch_loaded_builder() -> None:
    """Answer MindSpeedOpBuilder.load() from EMULATED_BUILDERS once MindSpeed's builder class exists (idempotent).

    The method is replaced, not the JIT `load` it calls: it reads the CANN include paths ($ASCEND_HOME_PATH)
    before compiling, which fail first on a machine without the toolkit.
    """
    cls = getattr(sys.modules.get(_BUILDER_MODULE), "MindSpeedOpBuilder", None)
    if cls is None or getattr(cls.load, "_msf_emulated", False):
        return
    original = cls.load

    def load(self: Any, verbose: bool = True) -> Any:
        """The emulated module of this builder's op, else MindSpeed's own JIT build."""
        emulated = EMULATED_BUILDERS.get(self.name)
        if emulated is None:
            return original(self, verbose)
        log.record_call(f"mindspeed.op_builder:{self.name}")
        return emulated

    load._msf_emulated = True  # type: ignore[attr-defined]
    cls.load = load


class _PatchBuilderOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: each module of MindSpeed's op_builder package is found by the finder that owns it and,
    once executed, the builder class is patched if it exists by then. Watching the whole package covers the case
    where the fake torch_npu is first imported by builder.py itself (it imports torch_npu before defining the
    class): the package's next module, or the end of its __init__, patches it.
    """

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        """The owning finder's spec of an op_builder module, executing into a patch check; None otherwise."""
        if fullname != _BUILDER_PACKAGE and not fullname.startswith(_BUILDER_PACKAGE + "."):
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: types.ModuleType) -> None:
            exec_module(module)
            _patch_loaded_builder()

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Patch MindSpeed's op builder now if it is imported, and whenever its package imports a module (idempotent)."""
    _patch_loaded_builder()
    if not any(isinstance(f, _PatchBuilderOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchBuilderOnImport())
