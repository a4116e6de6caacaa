"""The emulated `torch.npu` / `torch_npu.npu` device module: one "NPU" that is the host CPU.

Everything here is a CPU-backed stand-in with the real names and signatures: device queries, no-op streams and
events, memory statistics (zeros), and RNG functions that act on the CPU default generator (so the "device" RNG
Megatron's tracker saves and restores is the CPU one). `install_npu_device()` registers this module as
`torch.npu` after renaming the PrivateUse1 backend to "npu", so `torch.device("npu")` parses.
"""
from __future__ import annotations

import contextlib
import os
import types
from typing import Any, Callable, Iterator

import torch

DEVICE_NAME = "Emulated Ascend NPU (host CPU)"
_TOTAL_MEMORY = 64 * 1024**3


# ---------------------------------------------------------------- device queries
def is_available() -> bool:
    return True


def device_count() -> int:
    """One emulated device per local rank, so `rank % device_count()` is always a valid id."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def current_device() -> int:
    return 0


def set_device(device: Any) -> None:
    """Devices are all the host CPU; selecting one is a no-op."""


def init() -> None:
    pass


def _lazy_init() -> None:
    pass


def is_initialized() -> bool:
    return True


def _lazy_call(fn: Callable[[], Any], **_: Any) -> None:
    """The real one defers `fn` until the device is initialised; the emulated device always is."""
    fn()


def _is_in_bad_fork() -> bool:
    return False


def synchronize(device: Any = None) -> None:
    pass


def empty_cache() -> None:
    pass


def set_compile_mode(jit_compile: bool = False) -> None:
    pass


def set_option(option: dict | None = None) -> None:
    pass


def stop_device(device: Any = None) -> int:
    return 0


def restart_device(device: Any = None, rebuild_all_resources: bool = False) -> None:
    pass


def get_device_name(device: Any = None) -> str:
    return DEVICE_NAME


def get_device_capability(device: Any = None) -> tuple[int, int]:
    return (8, 0)


def get_device_properties(device: Any = None) -> types.SimpleNamespace:
    return types.SimpleNamespace(name=DEVICE_NAME, total_memory=_TOTAL_MEMORY, major=8, minor=0,
                                 multi_processor_count=os.cpu_count() or 1, cube_core_num=0, vector_core_num=0)


# ---------------------------------------------------------------- memory statistics (host memory is untracked)
def _zero(device: Any = None) -> int:
    return 0


memory_allocated = max_memory_allocated = memory_reserved = max_memory_reserved = _zero
memory_cached = max_memory_cached = _zero


def reset_max_memory_allocated(device: Any = None) -> None:
    pass


reset_peak_memory_stats = reset_max_memory_cached = reset_accumulated_memory_stats = reset_max_memory_allocated


def mem_get_info(device: Any = None) -> tuple[int, int]:
    return (_TOTAL_MEMORY, _TOTAL_MEMORY)


def memory_stats(device: Any = None) -> dict[str, int]:
    return {}


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    return "emulated NPU: host memory is not tracked"


class NPUPluggableAllocator:
    def __init__(self, path_to_so_file: str = "", alloc_fn_name: str = "", free_fn_name: str = "") -> None:
        self.path = path_to_so_file


memory = types.SimpleNamespace(
    _record_memory_history=lambda *a, **k: None,
    _dump_snapshot=lambda *a, **k: None,
    _snapshot=lambda *a, **k: {"segments": [], "device_traces": []},
    change_current_allocator=lambda *a, **k: None,
    NPUPluggableAllocator=NPUPluggableAllocator,
    memory_allocated=_zero, max_memory_allocated=_zero, memory_reserved=_zero, max_memory_reserved=_zero,
    empty_cache=empty_cache, mem_get_info=mem_get_info, memory_stats=memory_stats,
)


# ---------------------------------------------------------------- RNG: the device generator is the CPU one
default_generators = (torch.default_generator,)


def manual_seed(seed: int) -> None:
    # torch.manual_seed itself calls the device seeding hooks; seeding the CPU generator directly avoids recursion.
    torch.default_generator.manual_seed(int(seed))


manual_seed_all = manual_seed


def seed() -> None:
    torch.default_generator.seed()


seed_all = seed


def initial_seed() -> int:
    return torch.default_generator.initial_seed()


def get_rng_state(device: Any = None) -> torch.Tensor:
    return torch.default_generator.get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
    torch.default_generator.set_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state()]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    set_rng_state(new_states[0])


# ---------------------------------------------------------------- streams and events: all work is synchronous
class Stream:
    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_stream(self, stream: "Stream") -> None:
        pass

    def wait_event(self, event: "Event") -> None:
        pass

    def record_event(self, event: "Event | None" = None) -> "Event":
        return event if event is not None else Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream)

    def __hash__(self) -> int:
        return 0


SyncLaunchStream = Stream


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._time = 0.0

    def record(self, stream: Stream | None = None) -> None:
        import time

        self._time = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: "Event") -> float:
        return (end_event._time - self._time) * 1000.0


_DEFAULT_STREAM = Stream()


def current_stream(device: Any = None) -> Stream:
    return _DEFAULT_STREAM


def default_stream(device: Any = None) -> Stream:
    return _DEFAULT_STREAM


@contextlib.contextmanager
def stream(stream: Stream | None = None) -> Iterator[None]:  # noqa: A001 - the real name
    yield


class device:  # noqa: N801 - torch.cuda.device spelling
    """Context manager selecting a device: a no-op, there is one."""

    def __init__(self, device: Any = None) -> None:
        self.idx = 0

    def __enter__(self) -> "device":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


device_of = device

# ---------------------------------------------------------------- misc namespaces and legacy tensor types
config = types.SimpleNamespace(allow_internal_format=False)
aclnn = types.SimpleNamespace(allow_hf32=False)
matmul = types.SimpleNamespace(allow_hf32=False)
conv = types.SimpleNamespace(allow_hf32=False)
amp = torch.amp
FloatTensor, HalfTensor, BFloat16Tensor = torch.FloatTensor, torch.HalfTensor, torch.BFloat16Tensor
DoubleTensor, IntTensor, LongTensor = torch.DoubleTensor, torch.IntTensor, torch.LongTensor
ByteTensor, BoolTensor, CharTensor = torch.ByteTensor, torch.BoolTensor, torch.CharTensor
