"""Per-step metrics: what each rank measured, gathered to one writer, written as one JSON line per step.

Each rank fills a fixed vector of named slots; one all_gather on a dedicated gloo group (async, so a frozen
encoder running ahead never waits for the backbone's metrics) brings them to the writer, which aggregates and
appends to RUN_DIR/metrics.jsonl. MFU: model FLOPs actually trained (padding excluded) per
second over devices x per-device peak; the formula and the peak used are printed once at start.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from mindspeed_flow.resilience.diskspace import write_failed
from mindspeed_flow.skus import SKUS, peak_flops, sku_of

SLOTS = (
    "is_encoder", "is_backbone", "is_writer",
    "step_start_t", "step_end_t",
    "encoder_busy_s", "encoder_wait_s", "encoder_last_sample_done_t", "encoder_samples", "encoder_forwards",
    "backbone_busy_s", "backbone_wait_s", "backbone_first_mb_start_t",
    "loss_sum", "label_tokens", "pool_peak_bytes", "pool_bytes_sent", "grad_norm", "peak_rss_bytes",
    "pool_transfer_s", "pool_transfer_exposed_s", "update_skipped",
    "encoder_held_peak", "encoder_held_slots_peak", "encoder_held_bytes_peak",
    # the rank's part (its index in the layout's parts) and its pool traffic in both directions
    "part_index", "pool_bytes_received", "pool_grad_bytes_sent", "pool_grad_bytes_received",
)
INDEX = {name: i for i, name in enumerate(SLOTS)}


class StepRecord:
    """One rank's numbers for one step (timestamps are time.time(); durations perf_counter)."""

    def __init__(self) -> None:
        self.values = torch.full((len(SLOTS),), float("nan"), dtype=torch.float64)

    def __setitem__(self, key: str, value: float) -> None:
        self.values[INDEX[key]] = float(value)

    def __getitem__(self, key: str) -> float:
        return float(self.values[INDEX[key]])

    def add(self, key: str, value: float) -> None:
        cur = self[key]
        self[key] = value if cur != cur else cur + value  # nan means "not set yet"


def measure_cpu_peak_flops(seconds: float = 0.3, n: int = 512) -> float:
    """Single-thread fp32 matmul throughput: the honest 'peak' of one CPU rank (one thread per rank)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        reps += 1
    return 2.0 * n**3 * reps / (time.perf_counter() - start)


MFU_FORMULA = "MFU = model FLOPs per step (padding excluded) / step seconds / peak of all devices"


def machine_peak_flops(device_name: str, host_cpu: bool, dtype: str, devices: int,
                       group: Optional[dist.ProcessGroup] = None) -> tuple[float, str]:
    """Peak FLOP/s of all devices together, and how it was obtained (printed beside every MFU).

    Accelerators: devices x the per-SKU table (`skus.py`), named with the figure's source; a device the
    table does not know gives nan (no MFU rather than a wrong one). Host CPU (`host_cpu`: a CPU run, or an
    emulated NPU whose "device" is host memory): every rank of `group` times a matmul at the same moment (one
    thread each) and the rates are summed, so ranks sharing cores share the peak (3 ranks on 2 cores sum to about
    2 cores' worth) and MFU cannot exceed 1 because of oversubscription; then every rank of `group` must call this.
    """
    if not host_cpu:
        sku = sku_of(device_name)
        per_device = peak_flops(device_name, dtype) if sku is not None else None
        if per_device is None:
            return float("nan"), f"{device_name}: no {dtype} peak in the SKU table (skus.py), no MFU"
        return per_device * devices, (f"{devices} x {per_device / 1e12:.1f} TFLOPS ({device_name}, table: "
                                      f"{SKUS[sku].source})")
    dist.barrier(group=group)
    # float32: MindSpeed's all_reduce wrapper reduces a float64 tensor on a dropped float32 copy (see the MM host)
    rate = torch.tensor([measure_cpu_peak_flops()], dtype=torch.float32)
    dist.all_reduce(rate, group=group)
    total = float(rate)
    return total, f"{total / 1e12:.4f} TFLOPS: {devices} ranks timing an fp32 matmul concurrently, summed"


@dataclass
class StepStatic:
    """What the writer knows about a step from the plan (no communication needed)."""

    step: int
    samples: int
    real_tokens: int
    padded_tokens: int
    microbatches: int
    padding_fraction: float
    dp_imbalance: float
    slot_imbalance: float
    encoder_imbalance: float
    model_flops: float
    oversize_skipped: int
    lr: float
    rank_costs: tuple = ()  # backbone cost (cost-model units) per DP rank
    bad_samples_total: int = 0  # samples skipped so far (missing/corrupt), identical on every rank


def _step_of(line: str) -> float:
    """The step of a metrics line; a torn line (the writer was killed while appending it) counts as redone."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


class MetricsFile:
    """RUN_DIR/metrics.jsonl on the writer rank, and the sinks (TensorBoard) that get each line too.

    A fresh run starts the file empty; a resumed run (`resume_step`) continues it without the lines of the steps it
    is about to redo, so each step appears once. Used by the torch host's gatherer and by the MindSpeed-MM host."""

    def __init__(self, run_dir: Path, append: bool = False, resume_step: Optional[int] = None,
                 on_write_error: str = "stop") -> None:
        self.path = run_dir / "metrics.jsonl"
        self.lines: list[dict[str, Any]] = []
        self.sinks: list[Any] = []  # more writers of each line (TensorBoard): .write(line), .close()
        # A failed append (full disk): "stop" raises RunDirWriteError; "continue" (trainer.on_save_error=continue)
        # keeps the lines and appends them with the next write that succeeds, so none is lost while space returns.
        self.on_write_error = on_write_error
        self.unwritten: list[str] = []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not append:
            self.path.write_text("")
        elif resume_step is not None and self.path.exists():
            kept = [x for x in self.path.read_text().splitlines(keepends=True)
                    if (_step_of(x) if x.strip() else resume_step) < resume_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            try:
                tmp.write_text("".join(kept))
                tmp.replace(self.path)
            except OSError as exc:  # the run's history stays as it was; no empty .tmp left behind
                tmp.unlink(missing_ok=True)
                raise write_failed(self.path, exc, "it is unchanged; free space there, then launch again") from None

    def write(self, line: dict[str, Any]) -> None:
        self.unwritten.append(json.dumps(line) + "\n")
        try:
            self._append()
        except OSError as exc:
            if self.on_write_error != "continue":
                raise write_failed(self.path, exc, f"its first {len(self.lines)} lines are intact; the newest "
                                   "valid checkpoint is what trainer.resume=true continues from") from None
            if len(self.unwritten) == 1:
                said = write_failed(self.path, exc, "its lines are kept in memory and appended once a write succeeds")
                print(f"[mindspeed-flow] warning: {said} (trainer.on_save_error=continue)", flush=True)
        self.lines.append(line)
        for sink in self.sinks:
            sink.write(line)

    def _append(self) -> None:
        """Append the unwritten lines whole or not at all: a write cut short by a full disk is truncated away, so
        the file never ends in a torn line."""
        size = self.path.stat().st_size if self.path.exists() else 0
        try:
            with open(self.path, "a") as f:
                f.write("".join(self.unwritten))
        except OSError:
            os.truncate(self.path, size)
            raise
        self.unwritten.clear()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        if self.unwritten:  # the last chance: the lines kept through a full disk
            try:
                self._append()
            except OSError as exc:
                raise write_failed(self.path, exc, f"{len(self.unwritten)} step lines could not be written; "
                                   f"the first {len(self.lines) - len(self.unwritten)} are intact") from None
            self.unwritten.clear()


class MetricsGatherer:
    """Async all_gather of StepRecords on its own group; the writer turns them into JSON lines."""

    def __init__(self, group: Optional[dist.ProcessGroup], world_size: int, writer: bool, run_dir: Path,
                 devices: int, peak_flops: float, peak_desc: str, append: bool = False,
                 resume_step: Optional[int] = None, on_write_error: str = "stop",
                 part_names: Sequence[str] = ()) -> None:
        self.group, self.world_size, self.writer = group, world_size, writer
        # decoupled: the layout's parts in order (a rank's record carries its index), for per-part pool traffic
        self.part_names = tuple(part_names)
        self.devices, self.peak_flops, self.peak_desc = devices, peak_flops, peak_desc
        self.pending: list[tuple[StepStatic, list[torch.Tensor], Any]] = []
        self.last_end: Optional[float] = None
        self.file = MetricsFile(run_dir, append, resume_step, on_write_error) if writer else None
        self.path = run_dir / "metrics.jsonl"

    @property
    def lines(self) -> list[dict[str, Any]]:
        return self.file.lines if self.file is not None else []

    @property
    def sinks(self) -> list[Any]:
        return self.file.sinks if self.file is not None else []

    def post(self, static: StepStatic, record: StepRecord) -> None:
        out = [torch.empty_like(record.values) for _ in range(self.world_size)]
        work = dist.all_gather(out, record.values, group=self.group, async_op=True)
        self.pending.append((static, out, work))

    def drain(self, block: bool) -> list[dict[str, Any]]:
        """Complete finished gathers in order; with block=True wait for all. Returns lines written now."""
        written = []
        while self.pending:
            static, out, work = self.pending[0]
            if not block and not work.is_completed():
                break
            work.wait()
            self.pending.pop(0)
            if self.file is not None:
                line = self._line(static, torch.stack(out))
                self.file.write(line)
                written.append(line)
        return written

    def _line(self, s: StepStatic, table: torch.Tensor) -> dict[str, Any]:
        col = {name: table[:, INDEX[name]] for name in SLOTS}
        enc = col["is_encoder"] == 1
        bb = col["is_backbone"] == 1

        def agg(name: str, mask: torch.Tensor, fn: str = "max") -> float:
            v = col[name][mask]
            v = v[~torch.isnan(v)]
            if v.numel() == 0:
                return 0.0
            return float(getattr(v, fn)())

        everyone = torch.ones_like(enc)
        end = agg("step_end_t", everyone, "max")
        start = agg("step_start_t", everyone, "min")
        seconds = end - (self.last_end if self.last_end is not None else start)
        self.last_end = end
        label_tokens = agg("label_tokens", bb, "max")
        loss_sum = agg("loss_sum", bb, "sum")
        mfu = s.model_flops / max(seconds, 1e-9) / (self.devices * self.peak_flops) if self.peak_flops else None
        first_mb = agg("backbone_first_mb_start_t", bb, "min")
        skipped = agg("update_skipped", everyone) > 0
        last_enc = agg("encoder_last_sample_done_t", enc, "max")
        return {
            "step": s.step,
            "loss": loss_sum / label_tokens if label_tokens else None,
            "samples": s.samples,
            "real_tokens": s.real_tokens,
            "padded_tokens": s.padded_tokens,
            "padding_fraction": s.padding_fraction,
            "microbatches": s.microbatches,
            "step_seconds": seconds,
            "encoder_busy_s": agg("encoder_busy_s", enc),
            "encoder_wait_s": agg("encoder_wait_s", enc),
            # encoder forwards over all encoder ranks (fewer than the samples when flow.encoder_batch_tokens > 0)
            "encoder_forwards": agg("encoder_forwards", enc, "sum"),
            "encoder_samples": agg("encoder_samples", enc, "sum"),
            # what one encoder rank held at once between forward and backward (max over encoder ranks):
            # samples, consumer microbatch slots (<= flow.encoder_inflight when set) and saved-activation bytes
            "encoder_held_peak": agg("encoder_held_peak", enc),
            "encoder_held_slots_peak": agg("encoder_held_slots_peak", enc),
            "encoder_held_bytes_peak": agg("encoder_held_bytes_peak", enc),
            "backbone_busy_s": agg("backbone_busy_s", bb),
            "backbone_wait_s": agg("backbone_wait_s", bb),
            "pool_occupancy_peak_bytes": agg("pool_peak_bytes", everyone),
            "pool_bytes_sent": agg("pool_bytes_sent", enc, "sum"),
            # embedding transfers as the backbone ranks saw them (summed over ranks): on the wire, and the part
            # a get() was blocked on (exposed); the rest was hidden behind compute by receiving ahead
            "transfer_s": agg("pool_transfer_s", bb, "sum"),
            "transfer_exposed_s": agg("pool_transfer_exposed_s", bb, "sum"),
            "transfer_hidden_s": agg("pool_transfer_s", bb, "sum") - agg("pool_transfer_exposed_s", bb, "sum"),
            # A step whose update was skipped for a non-finite norm (trainer.nan_policy=skip) has no norm to show:
            # null, never the 0.0 that NaN-as-unset would aggregate to (NaN is "not set" in a StepRecord).
            "grad_norm": None if skipped else agg("grad_norm", everyone),
            "update_skipped": skipped,
            "mfu": mfu,
            "model_tflops": s.model_flops / 1e12,
            "dp_imbalance": s.dp_imbalance,
            "slot_imbalance": s.slot_imbalance,
            "encoder_imbalance": s.encoder_imbalance,
            "oversize_skipped": s.oversize_skipped,
        "rank_costs": list(s.rank_costs),
        "bad_samples_total": s.bad_samples_total,
            "lr": s.lr,
            # Streaming evidence: seconds (from the step's start) at which the backbone began its first
            # microbatch and at which the encoder finished its last sample; first < last means overlap.
            "backbone_first_mb_start_s": first_mb - start if first_mb else None,
            "encoder_last_sample_done_s": last_enc - start if last_enc else None,
            "peak_rss_mb": agg("peak_rss_bytes", everyone) / 2**20,
            "pool_bytes_by_part": self._bytes_by_part(col, agg),
        }

    def _bytes_by_part(self, col: dict[str, torch.Tensor], agg: Callable[..., float]) -> Optional[dict[str, Any]]:
        """Pool traffic of each part this step, summed over its ranks: embeddings an encoder part sent and the
        gradients it got back; what the backbone received and returned (None when nothing is decoupled)."""
        if not self.part_names:
            return None
        out: dict[str, Any] = {}
        for i, name in enumerate(self.part_names):
            ranks = col["part_index"] == i
            if bool(ranks.any()):
                out[name] = {"embedding_bytes_sent": int(agg("pool_bytes_sent", ranks, "sum")),
                             "embedding_bytes_received": int(agg("pool_bytes_received", ranks, "sum")),
                             "gradient_bytes_sent": int(agg("pool_grad_bytes_sent", ranks, "sum")),
                             "gradient_bytes_received": int(agg("pool_grad_bytes_received", ranks, "sum"))}
        return out
