"""Build, cache and load the C++ extension behind the strict emulated npu (`csrc/`).

The extension registers a real PrivateUse1 device (allocator, device guard, hooks, kernels, a boxed CPU fallback)
and the HCCL backend class, so it must be loaded before any npu tensor exists: `strict.install()` calls `load()`
at activation. It is compiled once per (torch build, Python, source hash) with `torch.utils.cpp_extension` into

    $MSF_EMULATION_BUILD_DIR/<key>/      or      ~/.cache/mindspeed-flow/npu-ext/<key>/

under a file lock, so the ranks of a job that start together build it once (the others wait, then import the
finished library directly, without running the build tool again). A build prints one line on stderr.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import time
import types
from pathlib import Path
from typing import Iterator

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("npu_runtime.cpp", "npu_kernels.cpp", "npu_autocast.cpp", "npu_hccl.cpp", "npu_module.cpp")
HEADERS = ("npu_runtime.h", "npu_hccl.h")
CFLAGS = ("-O2",)
ENV_BUILD_DIR = "MSF_EMULATION_BUILD_DIR"

_MODULE: types.ModuleType | None = None


def cache_root() -> Path:
    """Where built extensions are kept ($MSF_EMULATION_BUILD_DIR, else ~/.cache/mindspeed-flow/npu-ext)."""
    env = os.environ.get(ENV_BUILD_DIR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mindspeed-flow" / "npu-ext"


def build_key() -> str:
    """torch version + Python version + a hash of the sources, flags and torch build (a new torch rebuilds)."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(str(torch.version.git_version).encode())
    torch_tag = torch.__version__.replace("+", "_")
    return f"torch{torch_tag}-py{sys.version_info[0]}{sys.version_info[1]}-{digest.hexdigest()[:12]}"


def module_name(key: str) -> str:
    return "msf_npu_" + key.rsplit("-", 1)[-1]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _import_built(name: str, library: Path) -> types.ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    spec = importlib.util.spec_from_file_location(name, str(library), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[name] = module
    return module


def _build(name: str, folder: Path) -> types.ModuleType:
    from torch.utils import cpp_extension  # optional: setuptools

    folder.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    print(f"[msf-emulation] building the emulated npu extension for torch {torch.__version__} "
          f"(python {sys.version_info[0]}.{sys.version_info[1]}) in {folder}", file=sys.stderr, flush=True)
    module = cpp_extension.load(name=name, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=list(CFLAGS),
                                extra_include_paths=[str(CSRC)], build_directory=str(folder), verbose=False)
    (folder / "build_seconds").write_text(f"{time.monotonic() - start:.1f}\n")
    return module


def load() -> types.ModuleType:
    """The extension module (built on first use, then cached on disk and in this process)."""
    global _MODULE
    if _MODULE is not None:
        return _MODULE
    key = build_key()
    name = module_name(key)
    folder = cache_root() / key
    library = folder / f"{name}.so"
    if not library.is_file():
        with _locked(cache_root() / f"{key}.lock"):
            if not library.is_file():
                _MODULE = _build(name, folder)
                return _MODULE
    _MODULE = _import_built(name, library)
    return _MODULE


def loaded() -> types.ModuleType:
    """The extension, which `load()` must have brought in (strict activation does)."""
    if _MODULE is None:
        raise RuntimeError("the emulated npu extension is not loaded: activate the strict emulation first")
    return _MODULE


def host_alias(tensor: torch.Tensor) -> torch.Tensor:
    """npu tensor -> CPU tensor over the same memory (writes through; keeps the npu memory alive)."""
    return loaded().host_alias(tensor)


def device_alias(tensor: torch.Tensor, index: int = 0) -> torch.Tensor:
    """CPU tensor -> npu tensor on npu:`index` over the same memory (not counted as an npu allocation)."""
    return loaded().device_alias(tensor, index)


HOST_SYNC_KINDS = ("copies to host", "scalar reads", "data-dependent shapes")


def host_syncs() -> dict[str, int]:
    """What made this process's host wait for the (emulated) device so far, by kind: blocking device-to-host
    copies, scalar reads (`.item()`), ops whose output size depends on the data (`nonzero`, ...)."""
    return dict(zip(HOST_SYNC_KINDS, loaded().host_syncs()))
