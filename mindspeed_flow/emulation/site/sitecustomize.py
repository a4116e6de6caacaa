"""Start-up hook of every interpreter that runs under emulation (this folder is first on its PYTHONPATH).

The PyPI torchvision wheel next to CPU torch dies on import (`operator torchvision::nms does not exist`);
`mindspeed_flow.utils.torchvision_compat.install()` fixes that, and here it runs automatically, just before
the first `import torchvision`, whoever imports it first (MindSpeed-MM, transformers, a data worker, a user's
helper). Likewise, right after `triton.runtime.driver` is imported, triton's active driver becomes the emulated
NPU (`mindspeed_flow.emulation.triton_npu`: device queries answered, kernels refused). Nothing is imported at start-up (not even torch), so interpreters that never touch torchvision pay
nothing. A `sitecustomize` further down sys.path, which this file shadows, still runs.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

from mindspeed_flow.utils.import_hooks import after_import


class _TorchvisionCompatOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the first lookup of `torchvision` it installs the compat layer, then leaves."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            from mindspeed_flow.utils import torchvision_compat

            torchvision_compat.install()
        return None


if "torchvision" not in sys.modules and not any(type(f).__name__ == _TorchvisionCompatOnImport.__name__
                                                for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionCompatOnImport())


def _emulated_triton_driver(module) -> None:
    from mindspeed_flow.emulation import triton_npu

    triton_npu.install(module)


after_import("triton.runtime.driver", _emulated_triton_driver)


def _chain_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None and spec.origin != os.path.abspath(__file__):
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_chain_shadowed_sitecustomize()
