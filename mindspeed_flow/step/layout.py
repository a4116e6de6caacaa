"""The job's parallel layout as data: its parts (encoder part(s) and the backbone, or one coupled part), each with
its DP/TP/PP/CP sizes and global ranks, and each encoder part's bridge to the backbone's first-stage ranks.

The step core's one layout type: the torch host builds its process groups from it (`topology.Topology`), the
MindSpeed-MM flow job derives every rank's part and coordinates from it, the planner's simulator replays it and the
launch-script writer sizes its jobs with it. No process group exists here, so it is checked (`Layout.validate`)
before any is built: a wrong recipe fails fast with the field and the rule, not inside gloo.

Rank order: parts take contiguous blocks of global ranks in list order (encoder first). Inside a part the order
is Megatron's tp-cp-dp-pp: rank = tp + TP*(cp + CP*(dp + DP*pp)), so TP neighbours are adjacent (one node)
and a pipeline stage is a contiguous block.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from mindspeed_flow.specs import VLMSpec

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

    @staticmethod
    def of(spec: VLMSpec) -> "ModelLimits":
        return ModelLimits(llm_layers=spec.llm.num_layers, llm_heads=spec.llm.num_heads,
                           llm_kv_heads=spec.llm.num_kv_heads, vit_heads=spec.vision.num_heads,
                           vit_layers=spec.vision.depth, audio_heads=spec.audio.heads if spec.audio else 0)


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
