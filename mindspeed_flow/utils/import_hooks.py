"""Run a hook right after a module is first imported, whoever imports it (start-up hooks use it: they may import
nothing heavy themselves, and the module may never be imported at all)."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any, Callable


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds `fullname` as the other finders would and calls `hook(module)` once it ran; leaves after one lookup."""

    def __init__(self, fullname: str, hook: Callable[[Any], None]) -> None:
        self.fullname, self.hook = fullname, hook

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.fullname:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            self.hook(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def after_import(fullname: str, hook: Callable[[Any], None]) -> None:
    """Call `hook(module)` right after `fullname` is first imported; nothing when it already was, or when a hook
    for it is already waiting (a start-up file run twice installs one)."""
    if fullname in sys.modules or any(isinstance(f, _AfterImport) and f.fullname == fullname for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _AfterImport(fullname, hook))
