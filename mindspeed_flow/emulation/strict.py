"""Strict emulation: "npu" is a real device over host memory, and transfer_to_npu runs in the real direction.

What `import torch_npu` does on an Ascend machine, done here with the C++ extension of `npu_ext` (a PrivateUse1
device whose kernels are the CPU ones on zero-copy host aliases, and which refuses host tensors in device ops):

- `prepare()`: build/load the extension and point the device module (`device.py`) at it; the fake torch_npu calls
  it before importing the module's names;
- `install_npu_device(module)`: rename PrivateUse1 to "npu", register `torch.npu`, generate `Tensor.npu()` /
  `is_npu` / `Module.npu()` / `UntypedStorage.npu()`, make gradient checkpointing default to "npu", register the
  HCCL backend for npu tensors and torch_npu's `batch_isend_irecv` (torch_npu/__init__.py does all of these);
- `install_transfer_to_npu()`: cuda devices, `.cuda()`, `torch.cuda.*` and nccl become npu, `torch.npu.*` and
  hccl, as torch_npu/contrib/transfer_to_npu.py does.

Process-wide and irreversible, like the real adapter: only the emulation entry points call these.
"""
from __future__ import annotations

import functools
import types
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.utils._device
from torch.nn.parameter import UninitializedTensorMixin
from torch.utils.checkpoint import DefaultDeviceType

from mindspeed_flow.emulation import device as npu_device
from mindspeed_flow.emulation import hccl, log, npu_ext

_STATE: dict[str, bool] = {}

# torch_npu passes these to generate_methods_for_privateuse1_backend: storages of them cannot move to the npu.
_UNSUPPORTED_DTYPES = [torch.quint8, torch.quint4x2, torch.quint2x4, torch.qint32, torch.qint8]

# transfer_to_npu's lists (torch_npu v2.7.1-7.2.0, torch_npu/contrib/transfer_to_npu.py): the torch functions,
# Tensor / Module methods and torch.cuda functions whose device arguments it rewrites, and the keywords it rewrites.
_TORCH_FNS = (
    "logspace", "randint", "hann_window", "rand", "full_like", "ones_like", "rand_like", "randperm", "arange",
    "frombuffer", "normal", "_empty_per_channel_affine_quantized", "empty_strided", "empty_like", "scalar_tensor",
    "tril_indices", "bartlett_window", "ones", "sparse_coo_tensor", "randn", "kaiser_window", "tensor",
    "triu_indices", "as_tensor", "zeros", "randint_like", "full", "eye", "_sparse_csr_tensor_unsafe", "empty",
    "_sparse_coo_tensor_unsafe", "blackman_window", "zeros_like", "range", "sparse_csr_tensor", "randn_like",
    "from_file", "_cudnn_init_dropout_state", "_empty_affine_quantized", "linspace", "hamming_window",
    "empty_quantized", "_pin_memory", "load", "set_default_device", "get_device_module", "sparse_compressed_tensor",
)
_TENSOR_FNS = ("new_empty", "new_empty_strided", "new_full", "new_ones", "new_tensor", "new_zeros", "to", "pin_memory")
_MODULE_FNS = ("to", "to_empty")
_CUDA_FNS = (
    "get_device_properties", "get_device_name", "get_device_capability", "list_gpu_processes", "set_device",
    "synchronize", "mem_get_info", "memory_stats", "memory_summary", "memory_allocated", "max_memory_allocated",
    "reset_max_memory_allocated", "memory_reserved", "max_memory_reserved", "reset_max_memory_cached",
    "reset_peak_memory_stats", "default_stream", "can_device_access_peer", "current_stream", "utilization",
    "set_per_process_memory_fraction", "caching_allocator_alloc",
)
_DEVICE_KWARGS = ("device", "device_type", "map_location", "device_id")
# torch.cuda names answered by the emulated torch.npu (the real transfer copies every torch_npu.npu name).
_CUDA_NAMES = (
    "is_available", "device_count", "current_device", "set_device", "synchronize", "empty_cache", "init",
    "_lazy_init", "_lazy_call", "is_initialized", "get_device_name", "get_device_capability",
    "get_device_properties", "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "reset_max_memory_allocated", "reset_peak_memory_stats", "mem_get_info", "memory_stats", "memory_summary",
    "manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state", "set_rng_state",
    "get_rng_state_all", "set_rng_state_all", "default_generators", "Stream", "Event", "stream", "current_stream",
    "default_stream", "device", "device_of", "FloatTensor", "HalfTensor", "BFloat16Tensor", "IntTensor", "LongTensor",
    "ByteTensor", "BoolTensor", "CharTensor", "ShortTensor", "_is_in_bad_fork", "is_current_stream_capturing",
    "get_amp_supported_dtype", "is_bf16_supported", "memory_cached", "max_memory_cached", "reset_max_memory_cached",
    "set_stream", "can_device_access_peer", "utilization", "set_per_process_memory_fraction",
)


def prepare() -> types.ModuleType:
    """Load the npu extension (built on first use) and make the device module answer from it."""
    ext = npu_ext.load()
    npu_device.use_extension(ext)
    return ext


# ---------------------------------------------------------------- import torch_npu
def _legacy_type_name(spec: Any) -> str | None:
    """'torch.npu.HalfTensor' (or our npu legacy class) -> 'HalfTensor'; None for anything else."""
    if isinstance(spec, str) and spec.startswith("torch.npu."):
        return spec[len("torch.npu."):]
    if isinstance(spec, type) and getattr(spec, "__module__", None) == "torch.npu":
        return spec.__name__
    return None


def _wrap_type(fn: Callable) -> Callable:
    """`Tensor.type("torch.npu.HalfTensor")`: torch_npu registers npu legacy tensor types, plain torch does not."""

    @functools.wraps(fn)
    def wrapper(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        name = _legacy_type_name(dtype)
        if name is None:
            return fn(self, dtype, non_blocking, **kwargs) if dtype is not None else fn(self)
        device = self.device if self.device.type == "npu" else torch.device("npu", npu_device.current_device())
        return self.to(device=device, dtype=getattr(torch, name).dtype, non_blocking=non_blocking)

    return wrapper


def install_npu_device(module: types.ModuleType) -> None:
    """What `import torch_npu` sets up (torch_npu/__init__.py): the device, its methods, HCCL (idempotent)."""
    if _STATE.get("npu"):
        return
    torch.utils.rename_privateuse1_backend("npu")
    torch._register_device_module("npu", module)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True,
                                                         unsupported_dtype=_UNSUPPORTED_DTYPES)
    torch.Tensor.type = _wrap_type(torch.Tensor.type)
    DefaultDeviceType.set_device_type("npu")
    hccl.register_backend(npu_ext.loaded())
    _register_shallow_copy_compat()
    _ensure_autograd_reaches_npu()
    log.add_summary_line(lambda: f"npu (strict): npu:{npu_device.current_device()} peak "
                                 f"{npu_device.max_memory_allocated()} bytes, "
                                 f"{npu_device.memory_allocated()} still allocated")
    log.add_summary_line(lambda: "host syncs: " + ", ".join(f"{k} {v}" for k, v in npu_ext.host_syncs().items()))
    _STATE["npu"] = True


_LIBS: list[torch.library.Library] = []  # registrations live as long as their Library object


def _has_compatible_shallow_copy_type(self: torch.Tensor, other: torch.Tensor) -> bool:
    """torch_npu's rule: equal key sets, or both dense on CPU / the npu (PrivateUse1)."""
    dense = ("CPU", "PrivateUse1")
    a, b = torch._C._dispatch_keys(self), torch._C._dispatch_keys(other)
    return a == b or (any(a.has(getattr(torch._C.DispatchKey, k)) for k in dense)
                      and any(b.has(getattr(torch._C.DispatchKey, k)) for k in dense))


def _register_shallow_copy_compat() -> None:
    """`variable.data = npu_tensor` on a host variable (and the reverse) works, as with torch_npu.

    torch's own `_has_compatible_shallow_copy_type` counts only CPU, CUDA, MPS, HIP, XPU and HPU as dense backends,
    so `set_data` refuses to swap a host tensor's data for an npu one ("incompatible tensor type"). FSDP2's
    `fully_shard` does exactly that for every parameter and buffer not on the mesh's device
    (`_fsdp_init._move_states_to_device`: `tensor.data = tensor.to(device)`). torch_npu registers its own kernel
    for the op (torch_npu/csrc/aten/ops/HasCompatibleShallowCopyType.cpp, v2.7.1-7.3.0: key sets equal, or both
    holding the CPU or PrivateUse1 key); this is the same rule, registered from Python.
    """
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": replacing it is the point
        warnings.simplefilter("ignore", UserWarning)
        lib.impl("_has_compatible_shallow_copy_type", _has_compatible_shallow_copy_type,
                 "CompositeImplicitAutograd")
    _LIBS.append(lib)


def _ensure_autograd_reaches_npu() -> None:
    """Make sure backward passes through npu tensors can run in this process.

    torch's autograd engine sizes its per-device worker queues once, at the first backward of the process, from
    the device guards registered then. A process forked after a CPU backward (a test rank forked from pytest)
    inherits an engine sized without the npu, and any npu backward then trips an internal assert. A real job
    imports torch_npu before any backward, as torchrun ranks here do, and is unaffected. Where the probe shows the
    engine cannot reach the npu, this thread runs its backward passes on the calling thread instead (autograd's
    own "multithreading disabled" mode), which computes the same gradients.
    """
    probe = torch.ones(1, device="npu", requires_grad=True)
    try:
        probe.sum().backward()
    except RuntimeError as err:
        if "device_ready_queues_" not in str(err):
            raise
        torch._C._set_multithreading_enabled(False)
        _STATE["autograd_on_calling_thread"] = True


# ---------------------------------------------------------------- transfer_to_npu
def _to_npu(value: Any, replace_int: bool) -> Any:
    """One device-like argument with cuda rewritten to npu (strings, torch.device, dicts; ints for to/to_empty)."""
    if isinstance(value, str) and "cuda" in value:
        return value.replace("cuda", "npu")
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("npu", value.index) if value.index is not None else torch.device("npu")
    if replace_int and isinstance(value, int) and not isinstance(value, bool):
        return f"npu:{value}"
    if isinstance(value, dict):
        return {(k.replace("cuda", "npu") if isinstance(k, str) else k): (v.replace("cuda", "npu") if
                isinstance(v, str) else v) for k, v in value.items()}
    return value


def _wrap_cuda(fn: Callable) -> Callable:
    replace_int = getattr(fn, "__name__", "") in ("to", "to_empty")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args = tuple(_to_npu(a, replace_int) for a in args)
        for key in _DEVICE_KWARGS:
            if kwargs.get(key) is not None:
                kwargs[key] = _to_npu(kwargs[key], isinstance(kwargs[key], int))
        if isinstance(kwargs.get("device_ids"), list):
            kwargs["device_ids"] = [_to_npu(d, replace_int) for d in kwargs["device_ids"]]
        return fn(*args, **kwargs)

    wrapper._msf_emulated = True  # type: ignore[attr-defined]
    return wrapper


def _wrap_all(owner: Any, names: tuple[str, ...]) -> None:
    for name in names:
        fn = getattr(owner, name, None)
        if fn is not None:
            setattr(owner, name, _wrap_cuda(fn))


def _wrap_hccl(fn: Callable) -> Callable:
    """A `backend` argument (positional or keyword) naming nccl names hccl instead."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args = tuple(a.replace("nccl", "hccl") if isinstance(a, str) else a for a in args)
        if isinstance(kwargs.get("backend"), str):
            kwargs["backend"] = kwargs["backend"].replace("nccl", "hccl")
        return fn(*args, **kwargs)

    wrapper._msf_emulated = True  # type: ignore[attr-defined]
    return wrapper


class _GeneratorProxy(torch.Generator):
    """torch.Generator(device="cuda") makes an npu generator (transfer_to_npu's _GeneratorProxy)."""

    def __new__(cls, device: Any = "cpu") -> "_GeneratorProxy":
        return super().__new__(cls, _to_npu(device, False))


class _EventProxy(torch.Event):
    """torch.Event(device="cuda") makes an npu event (transfer_to_npu's _EventProxy)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "_EventProxy":
        args = tuple(_to_npu(a, False) for a in args)
        if kwargs.get("device") is not None:
            kwargs["device"] = _to_npu(kwargs["device"], False)
        return super().__new__(cls, *args, **kwargs)


def _patch_distributed() -> None:
    # init_process_group, and every new_group (through _new_group_with_tag): nccl -> hccl. init_process_group's
    # device_id also goes cuda -> npu, as in torch_npu v2.7.1-7.3.0 (`_compose_wrappers(_wrapper_cuda,
    # _wrapper_hccl)`; 7.2.0 left it alone), the adapter MindSpeed-MM's FSDP2 examples name: its trainer asks for
    # `device_id=cuda:<rank>` (mindspeed_mm/fsdp/utils/device.py picks "cuda" once transfer_to_npu answers
    # torch.cuda.is_available()), and a default group bound to a cuda device sends every barrier to CUDA.
    dist.init_process_group = _wrap_cuda(_wrap_hccl(dist.init_process_group))
    c10d = dist.distributed_c10d
    c10d._new_group_with_tag = _wrap_hccl(c10d._new_group_with_tag)
    dist.is_nccl_available = dist.is_hccl_available
    dist.ProcessGroup._get_backend = _wrap_cuda(dist.ProcessGroup._get_backend)
    # A default group made without a backend gets gloo for cpu and hccl for npu, no nccl for cuda.
    dist.Backend.default_device_backend_map.pop("cuda", None)
    import torch.distributed.device_mesh as device_mesh  # lazy: after the rename
    import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp  # lazy: after the rename

    device_mesh.init_device_mesh = _wrap_cuda(device_mesh.init_device_mesh)
    device_mesh.DeviceMesh.__init__ = _wrap_cuda(device_mesh.DeviceMesh.__init__)
    fsdp.FullyShardedDataParallel.__init__ = _wrap_cuda(fsdp.FullyShardedDataParallel.__init__)
    torch.nn.parallel.DistributedDataParallel.__init__ = _wrap_cuda(torch.nn.parallel.DistributedDataParallel.__init__)
    try:
        import torch.distributed.pipelining.stage as stage  # optional: pipelining
    except ImportError:  # pragma: no cover - a torch without pipelining
        return
    stage.PipelineStage.__init__ = _wrap_cuda(stage.PipelineStage.__init__)
    _wrap_all(stage, ("build_stage",))


def _patch_cuda() -> None:
    """torch.cuda answers from the emulated torch.npu, patched in place so earlier `from torch.cuda import x`
    copies of the module still reach the npu (the real transfer copies torch_npu.npu's names the same way)."""
    for mod in (torch.cuda, getattr(torch.cuda, "random", None), getattr(torch.cuda, "memory", None)):
        if mod is None:
            continue
        for name in _CUDA_NAMES:
            if mod is torch.cuda or hasattr(mod, name):
                setattr(mod, name, getattr(npu_device, name))
    _wrap_all(torch.cuda, _CUDA_FNS)
    torch.cuda.device.__init__ = _wrap_cuda(torch.cuda.device.__init__)
    torch.cuda.memory._record_memory_history = npu_device.memory._record_memory_history
    torch.cuda.memory._snapshot = npu_device.memory._snapshot
    torch.cuda.DoubleTensor = npu_device.FloatTensor  # the real transfer: "double is not supported"


def install_transfer_to_npu() -> None:
    """torch_npu.contrib.transfer_to_npu in the real direction (idempotent)."""
    if _STATE.get("transfer"):
        return
    _patch_cuda()
    _wrap_all(torch, _TORCH_FNS)
    torch.UntypedStorage.__new__ = _wrap_cuda(torch.UntypedStorage.__new__)
    torch.Generator = _GeneratorProxy
    torch.Event = _EventProxy
    torch.amp.autocast_mode.autocast.__init__ = _wrap_cuda(torch.amp.autocast_mode.autocast.__init__)
    _wrap_all(torch.Tensor, _TENSOR_FNS)
    torch.Tensor.cuda = torch.Tensor.npu
    torch.Tensor.is_cuda = torch.Tensor.is_npu
    _wrap_all(torch.nn.Module, _MODULE_FNS)
    torch.nn.Module.cuda = torch.nn.Module.npu
    _wrap_all(torch.fft, ("fftfreq", "rfftfreq"))
    _patch_distributed()
    torch.utils._device.DeviceContext.__init__ = _wrap_cuda(torch.utils._device.DeviceContext.__init__)
    # transfer_to_npu turns TorchScript off ("not supported"): scripted functions run as plain Python.
    torch.jit.script = lambda obj, *args, **kwargs: obj
    torch.jit.script_method = lambda fn: fn
    torch._utils._get_available_device_type = lambda: "npu"
    # Uninitialized parameters allow the original Tensor.to; they must allow the rewritten one.
    allowed = UninitializedTensorMixin._allowed_methods
    for i, method in enumerate(allowed):
        if getattr(method, "__name__", "") == "to":
            allowed[i] = torch.Tensor.to
    _STATE["transfer"] = True
