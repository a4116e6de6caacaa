"""Lenient mode's global torch patches behind the fake torch_npu: the "npu" device type, transfer_to_npu run backwards.

(Strict mode, the default, is `strict.py`: a real npu device and the real direction.)

The real `torch_npu.contrib.transfer_to_npu` rewrites cuda devices and nccl to npu and HCCL. In lenient mode
every accelerator is the host CPU, so this does the inverse: cuda/npu devices (and bare integer device ids) map to
cpu, nccl/hccl to gloo, `torch.cuda.*` answers from the emulated device module, and `Tensor.type()` reports CPU
tensors as `torch.cuda.*Tensor` (Megatron's optimizers check `param.type() == 'torch.cuda.FloatTensor'`).

These patches are process-wide and irreversible (the PrivateUse1 rename cannot be undone): only the explicit
emulation entry points call them, in a launched job or a test subprocess, never on import of mindspeed_flow.
"""
from __future__ import annotations

import functools
import types
from typing import Any, Callable

import torch
import torch.distributed as dist

from mindspeed_flow import torch_compat
from mindspeed_flow.emulation import device as npu_device
from mindspeed_flow.emulation import hccl

_ACCEL_TYPES = ("cuda", "npu")
_STATE: dict[str, bool] = {}

_FACTORIES = (
    "empty", "empty_strided", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "range", "linspace",
    "logspace", "eye", "rand", "randn", "randint", "randperm", "normal", "empty_like", "zeros_like", "ones_like",
    "full_like", "rand_like", "randn_like", "randint_like", "load", "frombuffer", "from_numpy", "tril_indices",
    "triu_indices", "scalar_tensor", "sparse_coo_tensor", "empty_permuted",
)
_TENSOR_NEW = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "new_empty_strided")


# ---------------------------------------------------------------- device mapping
def to_cpu_device(dev: Any) -> Any:
    """cuda/npu devices, their strings and bare integer ids -> 'cpu'; anything else unchanged."""
    if isinstance(dev, torch.device):
        return torch.device("cpu") if dev.type in _ACCEL_TYPES else dev
    if isinstance(dev, str):
        return "cpu" if dev.split(":")[0] in _ACCEL_TYPES else dev
    if isinstance(dev, int) and not isinstance(dev, bool):
        return "cpu"
    return dev


def _map_kwargs(kwargs: dict) -> dict:
    if "device" in kwargs:
        kwargs["device"] = to_cpu_device(kwargs["device"])
    if "map_location" in kwargs:
        kwargs["map_location"] = _map_location(kwargs["map_location"])
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    return kwargs


def _map_location(loc: Any) -> Any:
    """torch.load's map_location: a remapping dict becomes 'cpu' (every storage lands on the host)."""
    if isinstance(loc, dict):
        return "cpu"
    if loc is None or callable(loc):
        return loc
    return to_cpu_device(loc)


def _wrap_device_kwargs(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **_map_kwargs(kwargs))

    wrapper._msf_emulated = True  # type: ignore[attr-defined]
    return wrapper


def _wrap_to(fn: Callable) -> Callable:
    """Tensor.to / Module.to: a positional device (str, torch.device or int) is mapped as well."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        args = tuple(to_cpu_device(a) if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool)
                     else a for a in args)
        return fn(self, *args, **_map_kwargs(kwargs))

    return wrapper


def _identity(self: Any, *args: Any, **kwargs: Any) -> Any:
    return self


# ---------------------------------------------------------------- Tensor.type(): CPU tensors claim to be cuda
def _wrap_type(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None:
            name = fn(self)
            return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") and ".cuda." not in name \
                else name
        if isinstance(dtype, str):
            dtype = dtype.replace("torch.cuda.", "torch.").replace("torch.npu.", "torch.")
        return fn(self, dtype, non_blocking, **kwargs)

    return wrapper


# ---------------------------------------------------------------- the npu device type
def install_npu_device(module: types.ModuleType) -> None:
    """Rename PrivateUse1 to "npu", register `module` as torch.npu, add Tensor/Module.npu and Tensor.is_npu."""
    if _STATE.get("npu"):
        return
    torch.utils.rename_privateuse1_backend("npu")
    torch._register_device_module("npu", module)
    # dist.barrier asks torch._C._get_accelerator(), which needs registered hooks once PrivateUse1 is renamed
    # (torch 2.9+ registers Python hooks; torch 2.7 gets Python answers: see torch_compat).
    torch_compat.install_privateuse1_accelerator(module)
    torch.Tensor.npu = _identity
    torch.nn.Module.npu = _identity
    torch.Tensor.is_npu = property(lambda self: True)
    _STATE["npu"] = True


# ---------------------------------------------------------------- distributed: nccl/hccl -> gloo
def _gloo_backend(backend: Any) -> Any:
    if backend is None:
        return backend
    return "gloo" if str(backend).lower() in ("nccl", "hccl", "cuda:nccl", "npu:hccl") else backend


def _patch_distributed() -> None:
    init_pg, new_group = dist.init_process_group, dist.new_group

    @functools.wraps(init_pg)
    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("device_id", None)
        kwargs.pop("pg_options", None)
        return init_pg(_gloo_backend(backend) or "gloo", *args, **kwargs)

    @functools.wraps(new_group)
    def new_group_gloo(ranks: Any = None, timeout: Any = None, backend: Any = None, pg_options: Any = None,
                       *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("device_id", None)
        return new_group(ranks, timeout, _gloo_backend(backend), None, *args, **kwargs)

    dist.init_process_group = init_process_group
    dist.new_group = new_group_gloo
    dist.distributed_c10d.init_process_group = init_process_group
    dist.distributed_c10d.new_group = new_group_gloo
    barrier = dist.barrier

    @functools.wraps(barrier)
    def barrier_cpu(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
        return barrier(group=group, async_op=async_op)

    dist.barrier = barrier_cpu
    hccl.install_backend_lookup()


# ---------------------------------------------------------------- torch.cuda answers from the emulated device
_CUDA_NAMES = (
    "is_available", "device_count", "current_device", "set_device", "synchronize", "empty_cache", "init",
    "_lazy_init", "_lazy_call", "is_initialized", "get_device_name", "get_device_capability",
    "get_device_properties", "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "reset_max_memory_allocated", "reset_peak_memory_stats", "mem_get_info", "memory_stats", "manual_seed",
    "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state", "set_rng_state", "get_rng_state_all",
    "set_rng_state_all", "default_generators", "Stream", "Event", "stream", "current_stream", "default_stream",
    "device", "FloatTensor", "HalfTensor", "BFloat16Tensor", "DoubleTensor", "IntTensor", "LongTensor",
    "ByteTensor", "BoolTensor", "CharTensor", "_is_in_bad_fork",
)


def _patch_cuda() -> None:
    """Patch torch.cuda *in place*: `from torch.cuda import _lazy_call` copies taken later see the fakes."""
    for name in _CUDA_NAMES:
        setattr(torch.cuda, name, getattr(npu_device, name))
    for sub in ("random", "memory"):
        mod = getattr(torch.cuda, sub, None)
        for name in _CUDA_NAMES:
            if mod is not None and hasattr(mod, name):
                setattr(mod, name, getattr(npu_device, name))


def install_transfer_to_npu() -> None:
    """Apply the cuda/npu -> cpu, nccl/hccl -> gloo mapping to torch (idempotent)."""
    if _STATE.get("transfer"):
        return
    for name in _FACTORIES:
        if hasattr(torch, name):
            setattr(torch, name, _wrap_device_kwargs(getattr(torch, name)))
    for name in _TENSOR_NEW:
        setattr(torch.Tensor, name, _wrap_device_kwargs(getattr(torch.Tensor, name)))
    torch.Tensor.to = _wrap_to(torch.Tensor.to)
    torch.nn.Module.to = _wrap_to(torch.nn.Module.to)
    torch.nn.Module.to_empty = _wrap_device_kwargs(torch.nn.Module.to_empty)
    torch.Tensor.cuda = _identity
    torch.nn.Module.cuda = _identity
    torch.Tensor.pin_memory = _identity
    torch.Tensor.type = _wrap_type(torch.Tensor.type)
    _patch_cuda()
    _patch_distributed()
    _STATE["transfer"] = True
