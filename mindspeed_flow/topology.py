"""The world split into part groups: the encoder part(s) and the backbone, each with its own DP/TP/PP (CP accepted,
must be 1 on the torch host), plus each encoder part's bridge to the backbone's first-stage ranks.

One explicit object (`Topology`) holds every process group a rank uses; nothing lives in module globals
(nanotron's ParallelContext, Megatron MIMO's per-module grids). Layouts are validated *before* any group is
built (`Layout.validate`), so a wrong recipe fails fast with the field and the rule, not inside gloo.

Rank order: parts take contiguous blocks of global ranks in list order (encoder first). Inside a part the order
is Megatron's tp-cp-dp-pp: rank = tp + TP*(cp + CP*(dp + DP*pp)), so TP neighbours are adjacent (one node)
and a pipeline stage is a contiguous block.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch.distributed as dist

ENCODER = "encoder"
AUDIO = "audio"  # the Qwen2.5-Omni thinker's audio encoder part
BACKBONE = "backbone"
COUPLED = "coupled"


class LayoutError(ValueError):
    """A parallel layout that cannot work; the message names the recipe field and the rule it breaks."""


@dataclass(frozen=True)
class PartLayout:
    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    # LLM layers per pipeline stage (None: an even split); checked against the model in Layout.validate
    layer_split: Optional[tuple[int, ...]] = None

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def coords(self, local_rank: int) -> dict[str, int]:
        """(tp, cp, dp, pp) coordinates of a rank inside the part (Megatron's tp-cp-dp-pp order)."""
        r = local_rank
        tp, r = r % self.tp, r // self.tp
        cp, r = r % self.cp, r // self.cp
        dp, pp = r % self.dp, r // self.dp
        return {"tp": tp, "cp": cp, "dp": dp, "pp": pp}

    def local_rank_of(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))


@dataclass(frozen=True)
class ModelLimits:
    """What the layout is checked against: the model's layer and head counts."""

    llm_layers: int
    llm_heads: int
    llm_kv_heads: int
    vit_heads: int
    vit_layers: int
    audio_heads: int = 0  # the audio encoder part's attention heads (0: the model has no audio part)


@dataclass(frozen=True)
class Layout:
    parts: tuple[PartLayout, ...]
    mode: str = "decoupled"

    @staticmethod
    def from_config(parallel_cfg, mode: str) -> "Layout":
        """From the `parallel` recipe group. Coupled mode puts every rank in one DP group running the whole model
        on the same number of ranks the decoupled layout would use, so the two compare on equal hardware (or on
        `parallel.world_size` ranks when that is set)."""
        if getattr(parallel_cfg.encoder, "layer_split", None) is not None:
            raise LayoutError(f"parallel.encoder.layer_split={list(parallel_cfg.encoder.layer_split)}: the encoder "
                              "part is not pipelined (leave it null)")
        encoders = _encoder_part_layouts(parallel_cfg)
        bb = PartLayout(BACKBONE, parallel_cfg.backbone.dp, parallel_cfg.backbone.tp, parallel_cfg.backbone.pp,
                        parallel_cfg.backbone.cp,
                        _split(getattr(parallel_cfg.backbone, "layer_split", None), "parallel.backbone.layer_split"))
        if mode == "decoupled":
            return Layout((*encoders, bb), "decoupled")
        if mode == "coupled":
            # `parallel.world_size`, when set, sizes the coupled group on its own: a one-device coupled job
            # (the single-accelerator check of `bench device`) has no decoupled layout of its size.
            ranks = int(getattr(parallel_cfg, "world_size", 0) or 0) or sum(e.size for e in encoders) + bb.size
            coupled = getattr(parallel_cfg, "coupled", None)
            pp = coupled.pp if coupled is not None else 1
            tp, cp = (int(getattr(coupled, "tp", 1) or 1), int(getattr(coupled, "cp", 1) or 1)) if coupled else (1, 1)
            if not isinstance(pp, int) or pp < 1 or ranks % (pp * tp * cp):
                sizes = f" (times tp={tp} x cp={cp})" if tp * cp > 1 else ""
                raise LayoutError(f"parallel.coupled.pp={pp!r}: must be an integer >= 1 that divides the {ranks} "
                                  f"ranks of the layout{sizes} (coupled mode runs on the ranks the decoupled one uses)")
            split = _split(coupled.layer_split, "parallel.coupled.layer_split") if coupled is not None else None
            return Layout((PartLayout(COUPLED, dp=ranks // (pp * tp * cp), tp=tp, pp=pp, cp=cp, layer_split=split),),
                          "coupled")
        raise LayoutError(f"flow.mode={mode!r}: must be 'decoupled' or 'coupled'")

    @property
    def world_size(self) -> int:
        return sum(p.size for p in self.parts)

    @property
    def encoder_parts(self) -> list[str]:
        """The encoder parts' names, in rank order (["encoder"] for a VLM; e.g. ["audio", "vision"])."""
        return [p.name for p in self.parts if p.name not in (BACKBONE, COUPLED)]

    def part(self, name: str) -> PartLayout:
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(name)

    def offset(self, name: str) -> int:
        """The part's first global rank (parts take contiguous blocks in list order)."""
        start = 0
        for p in self.parts:
            if p.name == name:
                return start
            start += p.size
        raise KeyError(name)

    def part_ranks(self, name: str) -> list[int]:
        start = self.offset(name)
        return list(range(start, start + self.part(name).size))

    def part_of(self, rank: int) -> PartLayout:
        """The part global rank `rank` belongs to."""
        start = 0
        for p in self.parts:
            if start <= rank < start + p.size:
                return p
            start += p.size
        raise LayoutError(f"global rank {rank} is outside the layout's {self.world_size} ranks ({self.describe()})")

    def coords(self, rank: int) -> dict[str, int]:
        """(tp, cp, dp, pp) of global rank `rank` inside its part."""
        p = self.part_of(rank)
        return p.coords(rank - self.offset(p.name))

    def global_rank(self, name: str, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return self.offset(name) + self.part(name).local_rank_of(tp=tp, cp=cp, dp=dp, pp=pp)

    def validate(self, *, world_size: Optional[int] = None, limits: Optional[ModelLimits] = None,
                 global_batch_size: Optional[int] = None, expected_world: int = 0) -> None:
        """Raise LayoutError naming the field and the rule. Called before any process group exists."""
        field_of = {ENCODER: "parallel.encoder", BACKBONE: "parallel.backbone", COUPLED: "parallel",
                    **{n: f"parallel.encoders.{n}" for n in self.encoder_parts if n != ENCODER}}
        for p in self.parts:
            f = field_of[p.name]
            is_encoder = p.name not in (BACKBONE, COUPLED)
            for dim in ("dp", "tp", "pp", "cp"):
                v = getattr(p, dim)
                if not isinstance(v, int) or v < 1:
                    raise LayoutError(f"{f}.{dim}={v!r}: every parallel size must be an integer >= 1")
            if p.cp != 1:
                raise LayoutError(f"{f}.cp={p.cp}: context parallelism is not supported by the torch host (cp must be 1)")
            if p.name == COUPLED and p.tp != 1:
                raise LayoutError(f"parallel.coupled.tp={p.tp}: the torch host's coupled mode runs DP x PP only (tp must "
                                  "be 1); a coupled MindSpeed-MM recipe runs with `launch-script --job mm`")
            if limits is not None:
                # an audio part (the Omni thinker's) has its own head count; every other encoder part is a ViT
                heads = (limits.audio_heads if p.name == AUDIO else limits.vit_heads) if is_encoder else \
                    limits.llm_heads
                if heads % p.tp:
                    raise LayoutError(f"{f}.tp={p.tp}: the attention heads ({heads}) must be divisible by tp")
                if not is_encoder and limits.llm_kv_heads % p.tp and p.tp % limits.llm_kv_heads:
                    raise LayoutError(f"{f}.tp={p.tp}: the KV heads ({limits.llm_kv_heads}) and tp must divide "
                                      "one another")
                layers = limits.vit_layers if is_encoder else limits.llm_layers
                if p.pp > layers:
                    raise LayoutError(f"{f}.pp={p.pp}: more pipeline stages than layers ({layers})")
            if is_encoder and p.pp != 1:
                raise LayoutError(f"{f}.pp={p.pp}: the encoder part runs data/tensor parallel only (pp must be 1)")
            if p.layer_split is not None:
                where = "parallel.coupled" if p.name == COUPLED else f
                split = list(p.layer_split)
                layers = f" and sum to the {limits.llm_layers} LLM layers" if limits is not None else ""
                if (len(split) != p.pp or min(split) < 1
                        or (limits is not None and sum(split) != limits.llm_layers)):
                    raise LayoutError(f"{where}.layer_split={split}: must list {p.pp} stage(s) ({where}.pp), "
                                      f"each >= 1 layer{layers}")
        if expected_world and expected_world != self.world_size:
            raise LayoutError(f"parallel.world_size={expected_world} but the layout needs {self.world_size} ranks "
                              f"({self.describe()})")
        if world_size is not None and world_size != self.world_size:
            raise LayoutError(f"the job was launched with {world_size} ranks but the layout needs "
                              f"{self.world_size} ({self.describe()}); change the layout or the launch size")
        if global_batch_size is not None:
            if global_batch_size < 1:
                raise LayoutError(f"trainer.global_batch_size={global_batch_size}: must be >= 1")
            for p in self.parts:
                if global_batch_size % p.dp:
                    raise LayoutError(f"trainer.global_batch_size={global_batch_size} is not divisible by "
                                      f"{field_of[p.name]}.dp={p.dp}: every DP rank must get the same share")

    def describe(self) -> str:
        return " + ".join(f"{p.name}[dp{p.dp} tp{p.tp} pp{p.pp}"
                          + (f" layers {list(p.layer_split)}" if p.layer_split else "") + "]" for p in self.parts)


@dataclass
class Bridge:
    """Who feeds whom: encoder ranks (producers) -> backbone first-stage ranks (consumers, one per backbone DP
    rank). Affinity groups partition both sides so every embedding crosses a small, fixed set of links (at scale
    an all-to-all between every encoder and every backbone rank costs memory per peer; Megatron #6378). A
    sample consumed by backbone DP rank d is produced by a rank of d's group, and its gradient returns there.
    """

    producers: list[int]
    consumers: list[int]  # indexed by backbone DP rank
    groups: list[tuple[list[int], list[int]]] = field(default_factory=list)

    @staticmethod
    def build(producers: Sequence[int], consumers: Sequence[int]) -> "Bridge":
        producers, consumers = list(producers), list(consumers)
        e, d = len(producers), len(consumers)
        if e % d == 0:  # each consumer owns e/d producers
            k = e // d
            groups = [(producers[i * k:(i + 1) * k], [consumers[i]]) for i in range(d)]
        elif d % e == 0:  # each producer serves d/e consumers
            k = d // e
            groups = [([producers[i]], consumers[i * k:(i + 1) * k]) for i in range(e)]
        else:  # sizes share no factor: one group, the plan balances across all links
            groups = [(producers, consumers)]
        return Bridge(producers, consumers, groups)

    def group_of_consumer(self, consumer: int) -> tuple[list[int], list[int]]:
        for prods, cons in self.groups:
            if consumer in cons:
                return prods, cons
        raise KeyError(f"rank {consumer} is not a backbone first-stage rank")

    def consumers_of(self, producer: int) -> list[int]:
        return [c for prods, cons in self.groups if producer in prods for c in cons]

    def producers_of(self, consumer: int) -> list[int]:
        return self.group_of_consumer(consumer)[0]


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


def _split(value: Optional[Sequence[int]], field: str) -> Optional[tuple[int, ...]]:
    """A recipe's layer_split (a list, or null) as a hashable tuple of ints."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, int)) or not all(isinstance(v, int) for v in value):
        raise LayoutError(f"{field}={value!r}: must be a list of integers (layers per pipeline stage)")
    return tuple(int(v) for v in value)


def bridge_of(layout: Layout, part: str = ENCODER) -> Optional[Bridge]:
    """The `part` -> backbone bridge of a decoupled layout (None when coupled); needs no process group."""
    if layout.mode != "decoupled":
        return None
    enc, bb = layout.part(part), layout.part(BACKBONE)
    bb_base = layout.part_ranks(BACKBONE)[0]
    # One consumer per backbone DP rank: the first stage, TP rank 0 (TP peers get it by broadcast).
    consumers = [bb_base + bb.local_rank_of(dp=d, pp=0) for d in range(bb.dp)]
    base = layout.part_ranks(part)[0]
    producers = [r for r in layout.part_ranks(part) if enc.coords(r - base).get("tp") == 0]
    return Bridge.build(producers, consumers)


def bridges_of(layout: Layout) -> dict[str, Bridge]:
    """Every encoder part's bridge to the backbone ({} when coupled)."""
    if layout.mode != "decoupled":
        return {}
    return {name: bridge_of(layout, name) for name in layout.encoder_parts}


def _encoder_part_layouts(parallel_cfg) -> list[PartLayout]:
    """`parallel.encoders` (several named encoder parts) when set, else the one `parallel.encoder`."""
    encoders = getattr(parallel_cfg, "encoders", None) or {}
    if not encoders:
        e = parallel_cfg.encoder
        return [PartLayout(ENCODER, e.dp, e.tp, e.pp, e.cp)]
    parts = []
    for name, e in encoders.items():
        if name in (ENCODER, BACKBONE, COUPLED):
            raise LayoutError(f"parallel.encoders.{name}: {name!r} is reserved; name each part by its modality "
                              "(e.g. audio, vision)")
        sizes = dict(e) if e is not None else {}
        unknown = sorted(set(sizes) - {"dp", "tp", "pp", "cp"})
        if unknown:
            raise LayoutError(f"parallel.encoders.{name}: unknown keys {unknown}; each part takes dp, tp, pp, cp")
        parts.append(PartLayout(str(name), **{k: sizes.get(k, 1) for k in ("dp", "tp", "pp", "cp")}))
    return parts


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
