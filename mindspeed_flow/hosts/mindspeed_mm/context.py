"""The flow context of one MindSpeed-MM rank: its part, its sub-world's Megatron parallel state, the flow groups.

Why static sub-worlds instead of MindSpeed dist-train's getter swapping. dist-train replaces ~55 `mpu.get_*` getters
with versions that reload the calling sub-world's groups on every call; MindSpeed-MM's `--hetero-parallel` swaps
module globals because its ranks run *both* modules. In a flow job every rank belongs to exactly one part for the
whole run, so the rank's Megatron state can simply *be* its part's: `initialize_model_parallel` runs once per part
(every rank takes part in every `new_group`, as torch requires), inside a world of the part's size whose rank
generator is offset to the part's first global rank. Megatron's own code then builds the part's groups with global
ranks, sets its globals only on the part's members, and every unpatched getter answers for the caller's part with
no per-call cost. Megatron asserts its globals are unset at entry, so each pass starts from the pristine module
state and the member's pass is what remains.

Flow groups built beside them (collectively, on every rank):
- `part_group`: the ranks of this rank's part. Megatron's distributed optimizer reduces its gradient statistics
  (the norm) over "the whole world" (no group); in a flow job that is the part, and the parts' norms are then
  combined once over `reduce_group` (`schedule.global_grad_norm`).
- `reduce_group`: the ranks of every trainable part, for the global token count (per-token loss), the one global
  gradient norm and the one found-inf decision. A frozen encoder is not in it, so it never waits on the decoder's
  optimizer and runs ahead (Megatron's per-iteration log gathers
  every rank's timers, which bounds the lead to about one step).
- `bridge_groups[part]`, per encoder part (the image encoder; Qwen2.5-Omni's audio encoder when it is a part):
  its bridge ranks (tensor-parallel rank 0 of each of its replicas and of each decoder first-stage replica), on
  the job's backend once per direction (device backends run one communicator's point-to-point operations in
  order: see `mindspeed_flow.pool.planned`; a communicator per part keeps each part's order its own), and on gloo
  for the headers that check each payload against the plan (`pool.planned.PlannedTransport`).
- `metrics_group`: every rank on gloo, used once at the start (timing the host CPU's peak under emulation, for MFU)
  and once at the end (the trace's merge waits for every rank's file); never during a step.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import astuple, dataclass, field, fields
from typing import Any, Callable, Iterator, Optional

import torch.distributed as dist

from mindspeed_flow.hosts.mindspeed_mm.recipe import FlowParts, part_modules
from mindspeed_flow.resilience.watchdog import Watchdog
from mindspeed_flow.step.layout import AUDIO, BACKBONE, ENCODER

# The one registry the patch mechanism needs: MindSpeed's patches are plain functions that find the rank's flow
# state here. Everything else a flow rank holds lives on its FlowContext.
_CONTEXT: Optional["FlowContext"] = None


def current() -> Optional["FlowContext"]:
    """The flow context of this process, or None in an unpatched (coupled) job."""
    return _CONTEXT


def install(ctx: Optional["FlowContext"]) -> None:
    global _CONTEXT
    _CONTEXT = ctx


@dataclass
class StepCounts:
    """What a step's plan holds; every rank plans the step, so these need no communication."""

    samples: int = 0  # samples trained (oversize ones skipped)
    real_tokens: int = 0
    padded_tokens: int = 0
    microbatches: int = 0  # over every decoder replica
    microbatches_per_rank: int = 0
    model_flops: float = 0.0  # FLOPs of the samples trained, padding excluded (for MFU)


@dataclass
class PartFigures:
    """One step's per-part figures, summed over the trainable parts by one all-reduce: each part leader adds its
    part's busy/wait seconds (the encoder leader also the peak of groups and activation bytes its replica held),
    every decoder rank adds what it moved (`DecoderStep._transfer_stats`)."""

    encoder_busy_s: float = 0.0
    encoder_wait_s: float = 0.0
    decoder_busy_s: float = 0.0
    decoder_wait_s: float = 0.0
    grad_bytes_sent: float = 0.0
    embedding_bytes: float = 0.0
    transfer_exposed_s: float = 0.0  # blocked on embeddings
    transfer_window_s: float = 0.0  # receives posted to last embedding taken
    encoder_held_groups: float = 0.0
    encoder_held_bytes: float = 0.0
    grad_bytes_audio: float = 0.0  # of grad_bytes_sent: to an audio encoder part (Qwen2.5-Omni)

    def as_list(self) -> list[float]:
        return [float(v) for v in astuple(self)]

    @staticmethod
    def from_list(values: list[float]) -> "PartFigures":
        return PartFigures(*values[:len(fields(PartFigures))])


@dataclass
class StepStats:
    """What the running step measured; the writer rank's iteration line and metrics.jsonl read it."""

    counts: StepCounts = field(default_factory=StepCounts)
    own: PartFigures = field(default_factory=PartFigures)  # this rank's, before the reduction
    pending: Any = None  # the reduction's device tensor ([global tokens] + PartFigures), read at log time
    reduced: Optional[PartFigures] = None  # the step's sums, once read
    global_tokens: Optional[int] = None  # per-token loss: the global loss-token count
    grad_norm_part: Optional[float] = None  # this part's gradient norm (decoder on the writer rank)
    grad_norm_global: Optional[float] = None  # over every trainable part

    def read_pending(self) -> None:
        """Move the reduced device tensor into `reduced` / `global_tokens` (one device read per step)."""
        if self.pending is None:
            return
        values = self.pending.tolist()
        self.pending = None
        if values[0] > 0:
            self.global_tokens = int(values[0])
        self.reduced = PartFigures.from_list(values[1:])


@dataclass
class BridgeGroups:
    """One encoder part's bridge ranks and the decoder's first-stage replicas, as process groups."""

    embedding: Any  # on the job's backend (HCCL / NCCL), encoder -> decoder payloads
    gradient: Any  # the same ranks, decoder -> encoder payloads (a communicator per direction)
    header: Any  # on gloo: the small headers that check each payload against the plan


@dataclass
class FlowContext:
    parts: FlowParts
    rank: int
    reduce_group: Any = None
    bridge_groups: dict[str, BridgeGroups] = field(default_factory=dict)  # encoder part -> its bridge's groups
    part_group: Any = None  # every rank of this rank's part: the "whole world" of its distributed optimizer
    device: Any = None  # where the job's tensors live (the NPU; set once the device is chosen)
    timer: Any = None  # the running step's Timer (busy/wait seconds)
    stats: StepStats = field(default_factory=StepStats)
    # this decoder rank's transfers in the running step, added by finalize into `stats.own`
    step_transfer: Callable[[PartFigures], None] = lambda figures: None
    host: Any = None  # the rank's FlowHost (hosts.mindspeed_mm.host), set when MindSpeed-MM's pretrain starts
    packed_params: Any = None  # the PackedSeqParams of the packed forward in progress (packed.packed_forward)
    shapes: dict[str, list] = field(default_factory=lambda: {"segments": [], "images": []})  # memory.record
    metrics_group: Any = None  # gloo over every rank: the CPU peak measurement and the end-of-run trace merge
    step_started_at: float = 0.0  # time.time() when this rank's running step began
    watchdog: Any = None  # the hang watchdog's heartbeat thread (started once the world's store exists)

    @staticmethod
    def for_this_process(parts: FlowParts) -> "FlowContext":
        return FlowContext(parts, int(os.environ.get("RANK", "0")))

    # ---------------------------------------------------------------- who am I

    @property
    def part(self) -> str:
        return self.parts.layout.part_of(self.rank).name

    @property
    def layout(self):
        return self.parts.layout.part(self.part)

    @property
    def modules(self) -> list[str]:
        return list(part_modules(self.parts.layout, self.part))

    @property
    def coords(self) -> dict[str, int]:
        return self.parts.layout.coords(self.rank)

    @property
    def is_encoder(self) -> bool:
        """An encoder part's rank (the image encoder's, or the audio encoder's when that is a part)."""
        return self.part != BACKBONE

    @property
    def is_audio(self) -> bool:
        return self.part == AUDIO

    @property
    def part_trainable(self) -> bool:
        return self.parts.trainable(self.part)

    @property
    def is_part_leader(self) -> bool:
        return self.rank == self.parts.layout.offset(self.part)

    def doing(self, activity: str) -> None:
        """What this rank does now, as the hang watchdog reports it if a peer finds this rank stuck."""
        if self.watchdog is not None:
            self.watchdog.activity = activity

    def start_watchdog(self) -> None:
        """Heartbeats in the job's TCPStore; part leaders and the last rank watch every rank's heartbeat, so a
        hung rank is named (with its part and what it was doing, and what the watcher waits for) within the
        flow timeout, wherever the others wait for it: a transfer, a collective of its part, the global norm."""
        if self.watchdog is not None or "MASTER_ADDR" not in os.environ:
            return
        layout = self.parts.layout
        watchers = tuple(layout.offset(lay.name) for lay in layout.parts) + (layout.world_size - 1,)
        side = self.describe(self.rank).split("(", 1)[1].rstrip(")")
        self.watchdog = Watchdog(self.rank, self.parts.layout.world_size, side, self.parts.timeout_s,
                                 attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                                 watchers=watchers).start()

    def describe(self, rank: int) -> str:
        """'rank 3 (decoder dp0 pp1 tp0)': how messages name a rank."""
        part = self.parts.layout.part_of(rank).name
        c = self.parts.layout.coords(rank)
        lay = self.parts.layout.part(part)
        where = f"dp{c['dp']}" + (f" pp{c['pp']}" if lay.pp > 1 else "") + (f" tp{c['tp']}" if lay.tp > 1 else "")
        return f"rank {rank} ({SIDE_NAMES.get(part, part)} {where})"

    def producers(self, part: str = ENCODER) -> list[int]:
        """An encoder part's bridge ranks: TP rank 0 of each of its DP replicas, in DP order."""
        return [self.parts.layout.global_rank(part, dp=d) for d in range(self.parts.layout.part(part).dp)]

    def consumers(self) -> list[int]:
        """Decoder bridge ranks: TP rank 0 of each decoder DP replica's first pipeline stage, in DP order."""
        return [self.parts.layout.global_rank(BACKBONE, dp=d, pp=0) for d in range(self.parts.layout.part(BACKBONE).dp)]

    def replica_leader(self) -> int:
        """The bridge rank of this rank's replica (same part, same dp, tp 0, first stage)."""
        c = self.coords
        return self.parts.layout.global_rank(self.part, dp=c["dp"], cp=c["cp"], pp=c["pp"] if self.is_encoder else 0)

    # ---------------------------------------------------------------- Megatron args and groups

    def apply_part_args(self, args: Any) -> None:
        """Make this rank's Megatron args describe its own part (validate_args then derives the part's DP)."""
        lay = self.layout
        args.flow_world_size = self.parts.layout.world_size
        args.world_size = lay.size
        args.tensor_model_parallel_size = lay.tp
        args.pipeline_model_parallel_size = lay.pp
        args.context_parallel_size = lay.cp
        if lay.tp == 1 and getattr(args, "sequence_parallel", False):
            args.sequence_parallel = False  # Megatron would warn and drop it; MC2 then stays off for this part
        if getattr(args, "use_ascend_mc2", False) and not self.uses_mc2(args):
            args.use_ascend_mc2 = False  # MindSpeed asserts TP > 1 and SP for MC2; this part builds plain linears
        if lay.pp == 1:
            args.variable_seq_lengths = getattr(args, "variable_seq_lengths", False)

    def uses_mc2(self, args: Any) -> bool:
        """MC2 runs in a part only where it can: `--use-ascend-mc2`, TP > 1 and sequence parallel."""
        return bool(getattr(args, "use_ascend_mc2", False)) and self.layout.tp > 1 and \
            bool(getattr(args, "sequence_parallel", False))

    def initialize_parts(self, initialize: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        """Run Megatron's (MindSpeed-wrapped) `initialize_model_parallel` once per part; keep this rank's state.

        During a part's pass every rank's Megatron args describe that part too: code in the wrapped chain that
        reads `get_args()` (MindSpeed's does) must build the same groups on every rank, or the ranks' group
        counters drift apart and the next collective `new_group` never completes."""
        from megatron.core import parallel_state as ps  # optional: megatron
        from megatron.training import get_args  # optional: megatron

        margs = get_args()
        pristine = _snapshot(ps)
        mine: Optional[dict[str, Any]] = None
        for lay in self.parts.layout.parts:
            _restore(ps, pristine)
            call_args = (lay.tp, lay.pp) + tuple(args[2:])
            # Megatron's validate_args derives expert TP from the rank's own TP; each pass must use the part's, or
            # the expert groups (built on every rank) differ between ranks of different parts.
            call_kwargs = dict(kwargs, context_parallel_size=lay.cp, expert_tensor_parallel_size=lay.tp)
            with part_world(ps, self.parts.layout.offset(lay.name), lay.size), part_args(margs, lay):
                initialize(*call_args, **call_kwargs)
            if self.rank in self.parts.layout.part_ranks(lay.name):
                mine = _snapshot(ps)
        assert mine is not None, f"rank {self.rank} is in no part"
        _restore(ps, mine)
        self._build_flow_groups()
        groups = self.check_groups()
        print(f"[mindspeed-flow] rank {self.rank} ({self.part}) groups: "
              + " ".join(f"{k}={v}" for k, v in groups.items()), flush=True)

    def _build_flow_groups(self) -> None:
        trainable = [r for lay in self.parts.layout.parts if self.parts.trainable(lay.name)
                     for r in self.parts.layout.part_ranks(lay.name)]
        self.reduce_group = dist.new_group(trainable)
        for lay in self.parts.layout.parts:
            ranks = self.parts.layout.part_ranks(lay.name)
            group = dist.new_group(ranks)
            if self.rank in ranks:
                self.part_group = group
        for part in self.parts.layout.encoder_parts:
            bridge = sorted(set(self.producers(part)) | set(self.consumers()))
            self.bridge_groups[part] = BridgeGroups(dist.new_group(bridge), dist.new_group(bridge),
                                                    dist.new_group(bridge, backend="gloo"))
        self.metrics_group = dist.new_group(backend="gloo")

    def check_groups(self) -> dict[str, list[int]]:
        """The global ranks of this rank's Megatron groups (for tests and the start-up report)."""
        from megatron.core import parallel_state as ps  # optional: megatron

        groups = {
            "tp": ps.get_tensor_model_parallel_group(), "pp": ps.get_pipeline_model_parallel_group(),
            "dp": ps.get_data_parallel_group(), "mp": ps.get_model_parallel_group(),
            "cp": ps.get_context_parallel_group(),
        }
        return {k: sorted(dist.get_process_group_ranks(g)) for k, g in groups.items()}


# How messages name each part's ranks.
SIDE_NAMES = {ENCODER: "encoder", AUDIO: "audio encoder", BACKBONE: "decoder"}


@contextlib.contextmanager
def part_world(ps: Any, offset: int, size: int) -> Iterator[None]:
    """Inside: the default world has `size` ranks and Megatron's rank generator starts at global rank `offset`."""
    real_world_size = dist.get_world_size
    base_generator = ps.RankGenerator

    def world_size(group: Any = None) -> int:
        return size if group is None else real_world_size(group)

    class OffsetRankGenerator(base_generator):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, rank_offset: int = 0, **kw: Any) -> None:
            super().__init__(*a, rank_offset=rank_offset + offset, **kw)

    dist.get_world_size = world_size
    ps.RankGenerator = OffsetRankGenerator
    try:
        yield
    finally:
        dist.get_world_size = real_world_size
        ps.RankGenerator = base_generator


_PART_ARGS = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
              "data_parallel_size", "sequence_parallel")


@contextlib.contextmanager
def part_args(args: Any, lay: Any) -> Iterator[None]:
    """Inside: the Megatron args describe part `lay` (every rank the same), whatever part the rank belongs to."""
    saved = {k: getattr(args, k, None) for k in _PART_ARGS}
    args.world_size, args.tensor_model_parallel_size = lay.size, lay.tp
    args.pipeline_model_parallel_size, args.context_parallel_size = lay.pp, lay.cp
    args.data_parallel_size = lay.size // (lay.tp * lay.pp * lay.cp)
    args.sequence_parallel = bool(saved["sequence_parallel"]) and lay.tp > 1
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(args, k, v)


def _is_state(name: str, value: Any) -> bool:
    return name.startswith("_") and name.lstrip("_")[:1].isupper() and not callable(value)


def _snapshot(module: Any) -> dict[str, Any]:
    out = {}
    for name, value in vars(module).items():
        if _is_state(name, value):
            out[name] = value.copy() if isinstance(value, (list, dict)) else value
    return out


def _restore(module: Any, snap: dict[str, Any]) -> None:
    for name, value in snap.items():
        setattr(module, name, value.copy() if isinstance(value, (list, dict)) else value)
