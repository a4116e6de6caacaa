"""Make the PyPI torchvision wheel importable next to CPU torch (not NPU-related: MindSpeed-MM and transformers'
vision models import torchvision). `train` applies `allow_missing_ops()` (from `mindspeed_flow.hosts.torch`), the
emulation the whole of `install()` (from its start-up hook), so both run in the `emulate` extra's environment.

PyPI ships only CUDA builds of torchvision for Linux; with CPU torch its compiled ops are missing and
`import torchvision` dies registering fake kernels (`operator torchvision::nms does not exist`). Registering a
fake kernel for a missing torchvision op becomes a no-op here. torchvision >= 0.26 also moved its video I/O to an
internal package, while MindSpeed-MM imports the private `_video_opt`/`_read_from_stream`: a stub module keeps
the import working, and video decoding raises a clear error (only the image path is supported under emulation).
"""
from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable

import torch
import torch.library

_VIDEO_NAMES = ("_align_audio_frames", "_check_av_available", "_read_from_stream", "read_video",
                "read_video_timestamps", "write_video")


def _tolerant_register_fake(original: Callable) -> Callable:
    @functools.wraps(original)
    def register_fake(op: Any, func: Any = None, /, *args: Any, **kwargs: Any) -> Any:
        if not (isinstance(op, str) and op.startswith("torchvision::")):
            return original(op, func, *args, **kwargs)

        def apply(fn: Callable) -> Callable:
            try:
                return original(op, fn, *args, **kwargs)
            except RuntimeError as err:
                if "does not exist" not in str(err):
                    raise
                return fn

        return apply if func is None else apply(func)

    register_fake._msf_emulated = True  # type: ignore[attr-defined]
    return register_fake


def _unsupported_video(name: str) -> Callable:
    def fn(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"torchvision.io.video.{name}: video decoding is not available under the mindspeed-flow "
                           "CPU emulation (the PyPI torchvision wheel has no video I/O); use image datasets")

    return fn


def _video_stub() -> types.ModuleType:
    mod = types.ModuleType("torchvision.io.video", "mindspeed-flow emulation stub: video I/O unavailable")
    for name in _VIDEO_NAMES:
        setattr(mod, name, _unsupported_video(name))
    mod._av_available = False
    mod.av = None
    mod._video_opt = types.SimpleNamespace(default_timebase=None, _read_video=_unsupported_video("_read_video"))
    return mod


def allow_missing_ops() -> None:
    """Let `import torchvision` (and transformers' vision models, which import it) succeed when the wheel's
    compiled ops do not load: registering a fake kernel for a missing torchvision op becomes a no-op. Harmless
    where the ops load (nothing else changes). Idempotent; `mindspeed-flow train` calls it through
    `mindspeed_flow.hosts.torch`, the emulation through `install()`."""
    if not getattr(torch.library.register_fake, "_msf_emulated", False):
        torch.library.register_fake = _tolerant_register_fake(torch.library.register_fake)


def install() -> None:
    """allow_missing_ops() and the video I/O stub MindSpeed-MM needs. Idempotent; only acts if torchvision has
    not been imported yet."""
    if "torchvision" in sys.modules:
        return
    allow_missing_ops()
    sys.modules.setdefault("torchvision.io.video", _video_stub())
