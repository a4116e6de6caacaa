"""The torch host's process groups, built from a `Layout` (step/layout.py): every part's DP/TP/PP groups, the
bridges' pool groups, and this rank's place in them.

One explicit object (`Topology`) holds the groups the step uses; nothing lives in module globals (nanotron's
ParallelContext, Megatron MIMO's per-module grids).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch.distributed as dist

from mindspeed_flow.step.layout import BACKBONE, COUPLED, ENCODER, Bridge, Layout, PartLayout, bridges_of


@dataclass
class Topology:
    """Every process group one rank uses, built by `Topology.build` on all ranks in the same order."""

    layout: Layout
    rank: int
    world_size: int
    part: str
    part_ranks: list[int]
    part_group: Optional[dist.ProcessGroup]
    dp_group: Optional[dist.ProcessGroup]
    pp_group: Optional[dist.ProcessGroup]
    tp_group: Optional[dist.ProcessGroup]
    dp_rank: int
    pp_rank: int
    tp_rank: int
    dp_ranks: list[int]
    pp_ranks: list[int]
    bridge: Optional[Bridge]
    # The embedding pool's groups (decoupled jobs): headers and credits on gloo over every rank; payloads on two
    # groups of the job's device backend (embeddings, gradients: one per direction), None on a CPU/gloo job.
    pool_group: Optional[dist.ProcessGroup] = None
    pool_data_groups: Optional[tuple[dist.ProcessGroup, dist.ProcessGroup]] = None
    tp_ranks: list[int] = field(default_factory=list)  # this rank's TP group, TP rank 0 (the leader) first
    bridges: dict[str, Bridge] = field(default_factory=dict)  # encoder part -> its bridge to the backbone

    @property
    def tp_leader(self) -> int:
        """The global rank of TP rank 0 of this rank's TP group: the one that talks to the pool."""
        return self.tp_ranks[0] if self.tp_ranks else self.rank

    @property
    def part_layout(self) -> PartLayout:
        return self.layout.part(self.part)

    @property
    def is_encoder(self) -> bool:
        """Any encoder part (the one "encoder" of a VLM, or one of several: "audio", "vision", ...)."""
        return self.part not in (BACKBONE, COUPLED)

    @property
    def is_backbone(self) -> bool:
        return self.part == BACKBONE

    @property
    def is_coupled(self) -> bool:
        return self.part == COUPLED

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @staticmethod
    def build(layout: Layout, *, rank: Optional[int] = None, world_size: Optional[int] = None,
              backend: Optional[str] = None) -> "Topology":
        """Create every group of every part on every rank (torch requires all ranks to call new_group for each
        group, in the same order) and keep the ones this rank belongs to."""
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
        layout.validate(world_size=world_size)
        mine: dict[str, object] = {}
        for p in layout.parts:
            ranks = layout.part_ranks(p.name)
            base = ranks[0]
            part_group = _new_group(ranks, backend)
            dp_groups = _axis_groups(p, base, "dp")
            pp_groups = _axis_groups(p, base, "pp")
            tp_groups = _axis_groups(p, base, "tp")
            handles = {}
            for axis, groups in (("dp", dp_groups), ("pp", pp_groups), ("tp", tp_groups)):
                for g in groups:
                    handle = _new_group(g, backend)
                    if rank in g:
                        handles[axis] = (handle, g)
            if rank in ranks:
                c = p.coords(rank - base)
                mine = dict(part=p.name, part_ranks=ranks, part_group=part_group, coords=c, **handles)
        bridges = bridges_of(layout)
        bridge = bridges.get(ENCODER)
        pool_group, pool_data_groups = _pool_groups(world_size, backend) if bridges else (None, None)
        c = mine["coords"]
        return Topology(
            layout=layout, rank=rank, world_size=world_size, part=mine["part"], part_ranks=mine["part_ranks"],
            part_group=mine["part_group"], dp_group=mine["dp"][0], pp_group=mine["pp"][0],
            tp_group=mine["tp"][0], dp_rank=c["dp"], pp_rank=c["pp"], tp_rank=c["tp"], dp_ranks=mine["dp"][1],
            pp_ranks=mine["pp"][1], bridge=bridge, pool_group=pool_group, pool_data_groups=pool_data_groups,
            tp_ranks=mine["tp"][1], bridges=bridges,
        )

    def backbone_rank(self, *, dp: int, pp: int, tp: int = 0) -> int:
        return self.layout.part_ranks(BACKBONE)[0] + self.layout.part(BACKBONE).local_rank_of(dp=dp, pp=pp, tp=tp)

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} part={self.part} dp={self.dp_rank}/{self.part_layout.dp} "
                f"pp={self.pp_rank}/{self.part_layout.pp} tp={self.tp_rank}/{self.part_layout.tp}")


def _axis_groups(p: PartLayout, base: int, axis: str) -> list[list[int]]:
    """All groups along one axis of a part, as global ranks, in a deterministic order."""
    sizes = {"tp": p.tp, "cp": p.cp, "dp": p.dp, "pp": p.pp}
    others = [a for a in ("tp", "cp", "dp", "pp") if a != axis]
    groups = []
    for o0 in range(sizes[others[0]]):
        for o1 in range(sizes[others[1]]):
            for o2 in range(sizes[others[2]]):
                fixed = dict(zip(others, (o0, o1, o2)))
                groups.append([base + p.local_rank_of(**{**fixed, axis: i}) for i in range(sizes[axis])])
    return groups


def _pool_groups(world_size: int, backend: Optional[str]
                 ) -> tuple[dist.ProcessGroup, Optional[tuple[dist.ProcessGroup, dist.ProcessGroup]]]:
    """The pool's gloo group and, when the job runs a device backend, its two payload groups (every rank)."""
    ranks = list(range(world_size))
    device_backend = str(backend or dist.get_backend()).lower()
    control = dist.new_group(ranks=ranks, backend="gloo")
    if device_backend == "gloo":
        return control, None
    return control, (_new_group(ranks, backend), _new_group(ranks, backend))


def _new_group(ranks: Iterable[int], backend: Optional[str]) -> dist.ProcessGroup:
    ranks = list(ranks)
    return dist.new_group(ranks=ranks, backend=backend) if backend else dist.new_group(ranks=ranks)
