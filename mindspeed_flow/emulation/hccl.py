"""Fake HCCL communicator names that resolve back to the gloo groups behind them.

On Ascend, MC2 ops take the HCCL communicator name of a group (`group._get_backend(torch.device("npu"))
.get_hccl_comm_name(global_rank)`). Under emulation each gloo group gets a stable name `fakehccl_<n>`, kept in a
per-process registry, so the emulated MC2 ops can find the group to run their collectives on.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
import torch.distributed as dist

_COUNTER = itertools.count()
_NAME_OF: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_GROUP_OF: dict[str, Any] = {}


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
