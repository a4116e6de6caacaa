"""HCCL under emulation: the "hccl" process-group backend, communicator names, and torch_npu's batch_isend_irecv.

Strict mode registers "hccl" as a real c10d backend for device type npu only, as torch_npu does
(`Backend.register_backend("hccl", ..., extended_api=True, devices=["npu"])` in torch_npu/__init__.py): a C++
backend (`csrc/npu_hccl.cpp`) that runs each collective and p2p op on a gloo group of the same ranks (over a
PrefixStore of the group's store), on zero-copy host aliases of the npu tensors. Host tensors given to an hccl group
are refused by torch's ProcessGroup (no backend for device type cpu); `new_group(..., backend="gloo")` still gives a
gloo group for them. `batch_isend_irecv` is replaced by torch_npu's contract (one work per batch of npu tensors).
Lenient mode maps hccl to gloo instead, and `FakeHcclBackend` stands in for the npu backend of a gloo group.

On Ascend, MC2 ops take the HCCL communicator name of a group (`group._get_backend(torch.device("npu"))
.get_hccl_comm_name(global_rank)`). Under emulation each group gets a stable name `fakehccl_<n>`, kept in a
per-process registry, so the emulated MC2 ops can find the group to run their collectives on.
"""
from __future__ import annotations

import datetime
import itertools
import weakref
from typing import Any

import torch
import torch.distributed as dist

_COUNTER = itertools.count()
_NAME_OF: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_GROUP_OF: dict[str, Any] = {}
_STRICT_BACKEND: list[type] = []  # the extension's HcclBackend class, once strict mode registered it


def comm_name(group: dist.ProcessGroup | None = None) -> str:
    """The fake HCCL communicator name of `group` (the default group when None), created on first use."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        return _NAME_OF[group]
    except KeyError:
        name = f"fakehccl_{next(_COUNTER)}"
        _NAME_OF[group] = name
        _GROUP_OF[name] = group
        return name


def group_from_comm_name(name: str) -> dist.ProcessGroup:
    """The gloo group registered under `name`; a clear error for names this process never handed out."""
    try:
        return _GROUP_OF[name]
    except KeyError:
        known = ", ".join(sorted(_GROUP_OF)) or "none"
        raise KeyError(f"unknown HCCL communicator name {name!r} (emulated names in this process: {known}); "
                       "get it from group._get_backend(torch.device('npu')).get_hccl_comm_name(rank)") from None


class FakeHcclBackend:
    """What `ProcessGroup._get_backend(torch.device('npu'))` returns under emulation."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def get_hccl_comm_name(self, rank_id: int, init_comm: bool = True) -> str:
        try:
            dist.get_group_rank(self._group, rank_id)
        except (ValueError, RuntimeError) as err:
            raise ValueError(f"get_hccl_comm_name: global rank {rank_id} is not a member of this group") from err
        return comm_name(self._group)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group._get_backend(torch.device("cpu")), name)


def install_backend_lookup() -> None:
    """Make `ProcessGroup._get_backend` answer npu devices with the fake HCCL backend (cpu/cuda unchanged)."""
    pg_cls = dist.ProcessGroup
    original = pg_cls._get_backend
    if getattr(original, "_msf_emulated", False):
        return

    def _get_backend(self: dist.ProcessGroup, device: torch.device) -> Any:
        if torch.device(device).type == "npu":
            return FakeHcclBackend(self)
        return original(self, device)

    _get_backend._msf_emulated = True  # type: ignore[attr-defined]
    pg_cls._get_backend = _get_backend


# ---------------------------------------------------------------- strict mode: a real backend for npu tensors
def _group_named(name: str) -> dist.ProcessGroup:
    for group, group_name in dist.distributed_c10d._world.pg_names.items():
        if group_name == name:
            return group
    raise KeyError(f"no process group named {name!r} in this process")


def _get_hccl_comm_name(self: Any, rank_id: int, init_comm: bool = True) -> str:
    """ProcessGroupHCCL.get_hccl_comm_name(global rank): the group's emulated communicator name."""
    group = _group_named(self.group_name)
    try:
        dist.get_group_rank(group, rank_id)
    except (ValueError, RuntimeError) as err:
        raise ValueError(f"get_hccl_comm_name: global rank {rank_id} is not a member of this group") from err
    return comm_name(group)


def register_backend(ext: Any) -> None:
    """Register "hccl" for npu tensors (the backend class comes from the npu extension `ext`) and torch_npu's
    batch_isend_irecv."""

    def create(opts: Any, pg_options: Any) -> Any:
        # pg_options (ProcessGroupHCCL.Options: hccl_config, ...) tune real HCCL; gloo has no use for them.
        timeout = opts.timeout if opts.timeout is not None else datetime.timedelta(minutes=30)
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("hccl-gloo/", opts.store), opts.group_rank, opts.group_size,
                                     timeout)
        return ext.make_hccl_backend(gloo, opts.group_rank, opts.group_size, opts.group_id)

    dist.Backend.register_backend("hccl", create, extended_api=True, devices=["npu"])
    ext.HcclBackend.get_hccl_comm_name = _get_hccl_comm_name
    _STRICT_BACKEND[:] = [ext.HcclBackend]
    dist.is_hccl_available = lambda: True
    original = dist.batch_isend_irecv
    if getattr(original, "_msf_emulated", False):
        return

    def batch_isend_irecv(p2p_op_list: list) -> list:
        """torch_npu's batch_isend_irecv (torch_npu/distributed/distributed_c10d.py `_batch_isend_irecv`): a batch
        whose first tensor is on the npu runs as ONE hccl work (returned as a one-element list) and refuses a
        non-npu tensor; any other batch keeps torch's behaviour (one work per op on gloo)."""
        first = p2p_op_list[0]
        if first.tensor.device.type != "npu":
            return original(p2p_op_list)
        group = first.group if first.group is not None else dist.distributed_c10d._get_default_group()
        backend = group._get_backend(first.tensor.device)
        op_type, tensors, peers = [], [], []
        for op in p2p_op_list:
            if op.tensor.device.type != "npu":
                raise RuntimeError(f"No backend type associated with device type {op.tensor.device.type}")
            op_type.append(op.op.__name__)
            tensors.append(op.tensor)
            group_peer = getattr(op, "group_peer", None)
            peers.append(group_peer if group_peer is not None else dist.get_group_rank(group, op.peer))
        return [backend.batch_isend_irecv(op_type, tensors, peers)]

    batch_isend_irecv._msf_emulated = True  # type: ignore[attr-defined]
    dist.batch_isend_irecv = batch_isend_irecv
    dist.distributed_c10d.batch_isend_irecv = batch_isend_irecv
