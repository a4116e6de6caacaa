"""The emulated `torch.npu` / `torch_npu.npu` device module, for both emulation modes.

It has the real names and signatures: device queries and selection, no-op streams and events (all npu work is
synchronous), memory statistics, legacy tensor types, and RNG functions that act on the CPU default generator (so
the "device" RNG Megatron's tracker saves and restores is the CPU one, which npu random ops draw from).

Lenient mode: one "NPU" that is the host CPU; selection is a no-op and memory statistics are zeros. Strict mode
(`use_extension`, called before the fake torch_npu imports this module's names): the device index is the calling
thread's (C++ device guard), memory statistics are the npu allocator's live and peak bytes, streams are real
`torch.Stream`s of the npu (so `Tensor.record_stream` takes them), and `FloatTensor` & co. build npu tensors.
`install_npu_device()` (patching / strict) registers this module as `torch.npu` after renaming PrivateUse1 to "npu".
"""
from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time
import types
from typing import Any, Callable, Iterator

import torch

from mindspeed_flow.skus import EMULATED_NPU_NAME as DEVICE_NAME

_TOTAL_MEMORY = 64 * 1024**3

# The strict npu extension (npu_ext), once `use_extension` installed it; None in lenient mode.
_EXT: Any = None


def _index(device: Any = None) -> int:
    """A device argument (None, int, "npu:1", torch.device) as an index; None and index-less mean the current."""
    if device is None:
        return current_device()
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    dev = torch.device(device)
    return current_device() if dev.index is None else dev.index


# ---------------------------------------------------------------- device queries
def is_available() -> bool:
    return True


def device_count() -> int:
    """One emulated device per local rank, so `rank % device_count()` is always a valid id."""
    if _EXT is not None:
        return _EXT.device_count()
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def current_device() -> int:
    return _EXT.current_device() if _EXT is not None else 0


def set_device(device: Any) -> None:
    """Strict: select the calling thread's device (an index outside the device count is refused, as on NPU).
    Lenient: devices are all the host CPU, selecting one is a no-op."""
    if _EXT is not None:
        _EXT.set_device(_index(device))


def _get_device_index(device: Any, optional: bool = False, allow_cpu: bool = False) -> int:
    """torch_npu.npu._utils._get_device_index (torch.load asks for it to place npu storages)."""
    if device is None and not optional:
        raise ValueError("Expected an npu device, but got: None")
    return _index(device)


_utils = types.SimpleNamespace(_get_device_index=_get_device_index)


def init() -> None:
    pass


def _lazy_init() -> None:
    pass


def is_initialized() -> bool:
    return True


# torch_npu/npu/__init__.py keeps this flag (False until `_lazy_init` ran, v2.7.1-7.3.0); the emulated device is
# initialised from the start, as `is_initialized()` says. MindSpeed-MM's FSDP2 job asks for it (a MISSING line of
# the emulation log before it was here).
_initialized = True


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


def is_current_stream_capturing() -> bool:
    """No graph capture on the emulated npu (optimizers ask before each step)."""
    return False


def get_amp_supported_dtype() -> list[torch.dtype]:
    """torch.autocast asks a PrivateUse1 device module for it (checkpoint recomputation enters autocast)."""
    return [torch.float16, torch.bfloat16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_device_properties(device: Any = None) -> types.SimpleNamespace:
    return types.SimpleNamespace(name=DEVICE_NAME, total_memory=_TOTAL_MEMORY, major=8, minor=0,
                                 multi_processor_count=os.cpu_count() or 1, cube_core_num=0, vector_core_num=0)


# ---------------------------------------------------------------- memory statistics
# Strict: the npu allocator's counters (kernel outputs adopted from the CPU kernels included). There is no caching
# allocator, so "reserved" equals "allocated". Lenient: host memory is untracked, every figure is 0.
def _counters(device: Any = None) -> list[int]:
    """[allocated bytes, peak bytes, allocations, frees] of one device (zeros in lenient mode)."""
    return _EXT.memory_stats(_index(device)) if _EXT is not None else [0, 0, 0, 0]


def memory_allocated(device: Any = None) -> int:
    return _counters(device)[0]


def max_memory_allocated(device: Any = None) -> int:
    return _counters(device)[1]


memory_reserved, max_memory_reserved = memory_allocated, max_memory_allocated
memory_cached, max_memory_cached = memory_allocated, max_memory_allocated


def reset_peak_memory_stats(device: Any = None) -> None:
    if _EXT is not None:
        _EXT.reset_peak(_index(device))


reset_max_memory_allocated = reset_max_memory_cached = reset_accumulated_memory_stats = reset_peak_memory_stats


def mem_get_info(device: Any = None) -> tuple[int, int]:
    return (_TOTAL_MEMORY - memory_allocated(device), _TOTAL_MEMORY)


def memory_stats(device: Any = None) -> dict[str, int]:
    if _EXT is None:
        return {}
    allocated, peak, allocations, frees = _counters(device)
    return {"allocated_bytes.all.current": allocated, "allocated_bytes.all.peak": peak,
            "reserved_bytes.all.current": allocated, "reserved_bytes.all.peak": peak,
            "allocation.all.allocated": allocations, "allocation.all.freed": frees,
            "allocation.all.current": allocations - frees, "num_alloc_retries": 0, "num_ooms": 0}


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    if _EXT is None:
        return "emulated NPU: host memory is not tracked"
    allocated, peak, _, _ = _counters(device)
    return f"emulated NPU npu:{_index(device)}: {allocated} bytes allocated, peak {peak} bytes"


class NPUPluggableAllocator:
    def __init__(self, path_to_so_file: str = "", alloc_fn_name: str = "", free_fn_name: str = "") -> None:
        self.path = path_to_so_file


memory = types.SimpleNamespace(
    _record_memory_history=lambda *a, **k: None,
    _dump_snapshot=lambda *a, **k: None,
    _snapshot=lambda *a, **k: {"segments": [], "device_traces": []},
    change_current_allocator=lambda *a, **k: None,
    NPUPluggableAllocator=NPUPluggableAllocator,
    memory_allocated=memory_allocated, max_memory_allocated=max_memory_allocated, memory_reserved=memory_reserved,
    max_memory_reserved=max_memory_reserved, reset_peak_memory_stats=reset_peak_memory_stats,
    empty_cache=empty_cache, mem_get_info=mem_get_info, memory_stats=memory_stats,
)


# ---------------------------------------------------------------- RNG: the device generator is the CPU one
# npu random ops draw from the CPU default generator, and each rank uses one device.
#
# The npu's RNG state as torch_npu hands it out: 16 bytes, a uint64 seed then an int64 Philox offset
# (torch_npu/csrc/aten/NPUGeneratorImpl.cpp, v2.7.1-7.3.0, get_state / set_state; set_state also takes the seed
# alone, 8 bytes). Callers read that layout: DTensor's OffsetBasedRNGTracker (torch/distributed/tensor/_random.py)
# reads the offset at byte 8 and writes its own, and FSDP2 model initialisation on a mesh runs through it. The
# numbers still come from the CPU generator: a (seed, offset) state seeds it with `_mix(seed, offset)` (the seed
# itself at offset 0, so `torch.manual_seed(s)` draws what CPU torch draws). Philox advances its offset with each
# draw; here `get_rng_state` notices draws (the CPU generator moved since the last seeding), moves the offset on by
# `_OFFSET_STRIDE` and reseeds, so that restoring the state it returned replays what follows, as on the device.
# Megatron and MindSpeed restore the device RNG through `default_generators[i].set_state(...)` (and read it with
# `graphsafe_get_state` / `clone_state`), so in this layout `default_generators` are `_DeviceGenerator`s that speak it.
#
# Used by the jobs that initialise weights on a DTensor mesh: MindSpeed-MM's FSDP2 trainer (its launch scripts
# export NON_MEGATRON=true) and `pretrain_transformers.py` (Megatron's loop over MindSpeed's torch FSDP2); set
# MSF_EMULATE_RNG=device or =cpu to choose. The other Megatron-path jobs (`pretrain_vlm.py`) keep the CPU
# generator's own full state in both directions, the one knowing departure from torch_npu's layout (listed in the
# emulation README): their random streams, hence their tested figures, stay those they were measured with.
_SEED_BYTES = 8
_OFFSET_STRIDE = 1 << 40  # far above the offsets DTensor sets (element counts of one tensor)
_DEVICE_LAYOUT_SCRIPTS = ("pretrain_transformers.py",)


def _uses_device_layout(environ: dict[str, str] | Any = os.environ, argv: list[str] | None = None) -> bool:
    """Whether this process hands out the device's 16-byte RNG state (see above)."""
    chosen = environ.get("MSF_EMULATE_RNG", "").strip().lower()
    if chosen in ("device", "cpu"):
        return chosen == "device"
    if chosen:
        raise ValueError(f"MSF_EMULATE_RNG={chosen!r}: expected 'device' or 'cpu'")
    if environ.get("NON_MEGATRON", "").strip().lower() in ("1", "true", "yes"):
        return True
    # The script: argv[0] under torchrun, or one of the patch launcher's first arguments.
    argv = sys.argv if argv is None else argv
    return any(os.path.basename(arg) in _DEVICE_LAYOUT_SCRIPTS for arg in argv[:8])


_DEVICE_LAYOUT = _uses_device_layout()
_rng: dict[str, Any] = {"seed": None, "offset": 0, "cpu_state": None}


def _mix(seed: int, offset: int) -> int:
    """A 64-bit CPU seed for one (seed, offset) pair; distinct offsets give unrelated streams."""
    if offset == 0:
        return seed
    return (seed ^ ((offset * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) ^ 0x5851F42D4C957F2D) & 0xFFFFFFFFFFFFFFFF


def _seed_cpu(seed: int, offset: int) -> None:
    torch.default_generator.manual_seed(_mix(seed, offset))
    _rng.update(seed=seed, offset=offset, cpu_state=torch.default_generator.get_state())


def manual_seed(seed: int) -> None:
    # torch.manual_seed itself calls the device seeding hooks; seeding the CPU generator directly avoids recursion.
    _seed_cpu(int(seed) & 0xFFFFFFFFFFFFFFFF, 0)


manual_seed_all = manual_seed


def seed() -> None:
    torch.default_generator.seed()
    _seed_cpu(torch.default_generator.initial_seed(), 0)


seed_all = seed


def initial_seed() -> int:
    return _rng["seed"] if _rng["seed"] is not None else torch.default_generator.initial_seed()


def get_rng_state(device: Any = None) -> torch.Tensor:
    """The (seed, offset) state, 16 CPU bytes; a state taken after draws stands for what follows them (the CPU
    generator's own state on the Megatron path, see `_DEVICE_LAYOUT`)."""
    if not _DEVICE_LAYOUT:
        return torch.default_generator.get_state()
    if _rng["seed"] is None:
        _seed_cpu(torch.default_generator.initial_seed(), _OFFSET_STRIDE)
    elif not torch.equal(torch.default_generator.get_state(), _rng["cpu_state"]):
        _seed_cpu(_rng["seed"], _rng["offset"] + _OFFSET_STRIDE)
    # int64 words (the uint64 seed as its two's complement), viewed as the 16 bytes the device hands out.
    signed = [w - (1 << 64) if w >= (1 << 63) else w for w in (_rng["seed"], _rng["offset"])]
    return torch.tensor(signed, dtype=torch.int64).view(torch.uint8).clone()


def set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
    """Take a state `get_rng_state` gave (or the seed alone, 8 bytes), refusing other sizes as torch_npu does."""
    if not _DEVICE_LAYOUT:
        torch.default_generator.set_state(new_state)
        return
    if new_state.dtype != torch.uint8 or new_state.device.type != "cpu":
        raise RuntimeError("RNG state must be a torch.ByteTensor")
    if new_state.numel() not in (_SEED_BYTES, 2 * _SEED_BYTES):
        raise RuntimeError("RNG state is wrong size")
    words = new_state.contiguous().view(torch.int64).tolist()
    seed_ = words[0] & 0xFFFFFFFFFFFFFFFF
    offset = words[1] if len(words) > 1 else 0
    _seed_cpu(seed_, offset)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state()] * len(default_generators)


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    set_rng_state(new_states[current_device()])


class _DeviceGenerator:
    """`torch.npu.default_generators[i]` in the device layout: the calls Megatron and MindSpeed make on it
    (`set_state`, `graphsafe_set_state`, `get_state`, `graphsafe_get_state`, `clone_state`, seeding), over the
    module's RNG functions; not a `torch.Generator`, so an op given it as `generator=` fails loudly."""

    def __init__(self, index: int, state: torch.Tensor | None = None) -> None:
        self._index, self._state = index, state

    @property
    def device(self) -> torch.device:  # "npu" exists once install_npu_device renamed PrivateUse1
        return torch.device("npu", self._index) if _EXT is not None else torch.device("cpu")

    def get_state(self) -> torch.Tensor:
        return get_rng_state()

    def set_state(self, new_state: "torch.Tensor | _DeviceGenerator") -> "_DeviceGenerator":
        # graphsafe_set_state takes what graphsafe_get_state gave: a generator holding a state
        set_rng_state(new_state._state if isinstance(new_state, _DeviceGenerator) else new_state)
        return self

    graphsafe_set_state = set_state

    def graphsafe_get_state(self) -> "_DeviceGenerator":
        return _DeviceGenerator(self._index, get_rng_state())

    clone_state = graphsafe_get_state

    def manual_seed(self, seed_: int) -> "_DeviceGenerator":
        manual_seed(seed_)
        return self

    def seed(self) -> int:
        seed()
        return initial_seed()

    def initial_seed(self) -> int:
        return initial_seed()


def _default_generators(count: int) -> tuple[Any, ...]:
    if _DEVICE_LAYOUT:
        return tuple(_DeviceGenerator(i) for i in range(count))
    return (torch.default_generator,) * count


default_generators = _default_generators(1)


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


def set_stream(stream: Any) -> None:
    """Selecting a current stream changes nothing: every kernel runs synchronously."""


def can_device_access_peer(device: Any, peer_device: Any) -> bool:
    return True  # one host memory


def utilization(device: Any = None) -> int:
    return 0


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    pass


class device:  # noqa: N801 - torch.cuda.device spelling
    """Context manager selecting a device for the calling thread (lenient: a no-op, there is one)."""

    def __init__(self, device: Any = None) -> None:
        self.idx = -1 if device is None else _index(device)
        self._previous = -1

    def __enter__(self) -> "device":
        if _EXT is not None and self.idx >= 0:
            self._previous = current_device()
            set_device(self.idx)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous >= 0:
            set_device(self._previous)
        return None


class device_of(device):  # noqa: N801 - torch.cuda.device_of spelling
    """Context manager selecting the device of a tensor (a no-op for a host tensor)."""

    def __init__(self, obj: Any) -> None:
        on_npu = isinstance(obj, torch.Tensor) and obj.device.type == "npu"
        super().__init__(obj.device if on_npu else None)

# ---------------------------------------------------------------- misc namespaces and legacy tensor types
config = types.SimpleNamespace(allow_internal_format=False)
aclnn = types.SimpleNamespace(allow_hf32=False)
matmul = types.SimpleNamespace(allow_hf32=False)
conv = types.SimpleNamespace(allow_hf32=False)
amp = torch.amp
FloatTensor, HalfTensor, BFloat16Tensor = torch.FloatTensor, torch.HalfTensor, torch.BFloat16Tensor
DoubleTensor, IntTensor, LongTensor = torch.DoubleTensor, torch.IntTensor, torch.LongTensor
ByteTensor, BoolTensor, CharTensor = torch.ByteTensor, torch.BoolTensor, torch.CharTensor
_LEGACY_NAMES = ("FloatTensor", "HalfTensor", "BFloat16Tensor", "DoubleTensor", "IntTensor", "LongTensor",
                 "ByteTensor", "BoolTensor", "CharTensor", "ShortTensor")


# ---------------------------------------------------------------- strict mode: the npu extension behind the names
class _StrictStream(torch.Stream):
    """A stream of the emulated npu: a real `torch.Stream` (so `Tensor.record_stream` accepts it), with nothing to
    order because every npu kernel runs synchronously on the calling thread."""

    def __new__(cls, device: Any = None, priority: int = 0, stream_id: int | None = None, **_: Any) -> "_StrictStream":
        sid = next(_STREAM_IDS) if stream_id is None else stream_id
        return super().__new__(cls, stream_id=sid, device_index=_index(device), device_type=_EXT.device_type())

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        event = event if event is not None else _StrictEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_STREAM_IDS = itertools.count(1)  # 0 is each device's default stream


class _StrictEvent(torch.Event):
    """An event of the emulated npu: a real `torch.Event` on the npu (the extension's device guard records it with a
    timestamp; it is complete once recorded). It has to be one: torch code mixes `torch.npu.Event` with the
    generic `torch.Stream` of `torch.accelerator.current_stream()`, e.g. FSDP2's `finalize_backward`
    (`torch.accelerator.current_stream().wait_event(all_gather_event)`, the event from `Stream.record_event`),
    and `torch.Stream.wait_event` reads a `torch.Event`'s C++ state (a Python look-alike fails with "Unknown
    device"). torch_npu's Event signature: `Event(enable_timing=False, blocking=False, interprocess=False)`
    (torch_npu/npu/streams.py, v2.7.1-7.3.0)."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                **_: Any) -> "_StrictEvent":
        return super().__new__(cls, device=torch.device("npu", current_device()), enable_timing=enable_timing,
                               blocking=blocking, interprocess=interprocess)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class _LegacyNpuType(type):
    """`torch.npu.FloatTensor` & co.: isinstance checks device and dtype (as torch's legacy types check the dispatch
    key), calling builds the host tensor the CPU type would and moves it to the current npu."""

    dtype: torch.dtype

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor) and obj.device.type == "npu" and obj.dtype == cls.dtype

    def __call__(cls, *args: Any, **kwargs: Any) -> torch.Tensor:
        return getattr(torch, cls.__name__)(*args, **kwargs).to(torch.device("npu", current_device()))


def _strict_legacy_types() -> dict[str, type]:
    return {name: _LegacyNpuType(name, (), {"dtype": getattr(torch, name).dtype, "__module__": "torch.npu"})
            for name in _LEGACY_NAMES}


def _strict_current_stream(device: Any = None) -> _StrictStream:
    return _StrictStream(device, stream_id=0)


def use_extension(ext: Any) -> None:
    """Strict mode: answer from the npu extension (`npu_ext.load()`). Must run before the fake `torch_npu.npu`
    copies this module's names, which it does (the fake torch_npu calls it first)."""
    global _EXT, Stream, SyncLaunchStream, Event, current_stream, default_stream, default_generators
    _EXT = ext
    default_generators = _default_generators(ext.device_count())
    Stream = SyncLaunchStream = _StrictStream
    Event = _StrictEvent
    current_stream = default_stream = _strict_current_stream
    globals().update(_strict_legacy_types())
