"""TensorBoard scalars of a run, written by the metrics writer beside metrics.jsonl (RUN_DIR/tensorboard).

Megatron and MindSpeed-MM users read their curves in TensorBoard; this sink turns each metrics line into the same
curves under grouped tags (train/, throughput/, packing/, parts/, pool/, memory/). A resumed run purges the events
past the step it resumed from, so a curve never shows two histories for one step. The MindSpeed-MM host writes the
same curves (those its lines have, plus its own `scalars`) under a `flow/` prefix into Megatron's tensorboard folder.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from torch.utils.tensorboard import SummaryWriter


def to_mib(value: Optional[float]) -> Optional[float]:
    return None if value is None else value / 2**20


# tag -> value from one metrics.jsonl line (None: not measured this step, no point written)
SCALARS: dict[str, Callable[[dict[str, Any]], Optional[float]]] = {
    "train/loss": lambda m: m.get("loss"),
    "train/grad_norm": lambda m: m.get("grad_norm"),
    "train/lr": lambda m: m.get("lr"),
    "throughput/samples_per_s": lambda m: m["samples"] / m["step_seconds"] if m.get("step_seconds") else None,
    "throughput/mfu": lambda m: m.get("mfu"),
    "throughput/step_seconds": lambda m: m.get("step_seconds"),
    "packing/padding_fraction": lambda m: m.get("padding_fraction"),
    "packing/dp_imbalance": lambda m: m.get("dp_imbalance"),
    "parts/encoder_busy_s": lambda m: m.get("encoder_busy_s"),
    "parts/encoder_wait_s": lambda m: m.get("encoder_wait_s"),
    "parts/backbone_busy_s": lambda m: m.get("backbone_busy_s"),
    "parts/backbone_wait_s": lambda m: m.get("backbone_wait_s"),
    "pool/occupancy_peak_mb": lambda m: to_mib(m.get("pool_occupancy_peak_bytes")),
    "pool/sent_mb": lambda m: to_mib(m.get("pool_bytes_sent")),
    "pool/transfer_exposed_s": lambda m: m.get("transfer_exposed_s"),
    "pool/transfer_hidden_s": lambda m: m.get("transfer_hidden_s"),
    "memory/peak_rss_mb": lambda m: m.get("peak_rss_mb"),
}


Scalars = dict[str, Callable[[dict[str, Any]], Optional[float]]]


class TensorBoardSink:
    """Writes `scalars` (default SCALARS) of every metrics line at global_step = the line's step, each tag under
    `prefix` (e.g. "flow/": beside another writer's curves in one folder)."""

    def __init__(self, log_dir: Path, start_step: int = 0, prefix: str = "", scalars: Optional[Scalars] = None) -> None:
        self.writer = SummaryWriter(str(log_dir), purge_step=start_step if start_step > 0 else None)
        self.prefix, self.scalars = prefix, SCALARS if scalars is None else scalars

    def write(self, line: dict[str, Any]) -> None:
        step = int(line["step"])
        for tag, get in self.scalars.items():
            value = get(line)
            if value is not None:
                self.writer.add_scalar(self.prefix + tag, float(value), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_sink(log_dir: Path, start_step: int = 0, prefix: str = "", scalars: Optional[Scalars] = None,
              asked_by: str = "trainer.tensorboard=true", turn_off: str = "trainer.tensorboard=false"
              ) -> Optional[TensorBoardSink]:
    """The sink, or None with one printed line when the tensorboard package is absent (the run goes on: the
    writer rank failing here would leave every other rank waiting on it). `asked_by` / `turn_off`: the setting
    that asked for it and how to turn it off, named in that line."""
    try:
        return TensorBoardSink(log_dir, start_step, prefix, scalars)
    except ImportError:  # torch.utils.tensorboard names the missing package
        print(f"[mindspeed-flow] {asked_by} but the tensorboard package is not installed: curves go to "
              f"metrics.jsonl only (pip install tensorboard, or {turn_off})", flush=True)
        return None
