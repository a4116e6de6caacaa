"""What a MindSpeed-MM flow job writes for its users: RUN_DIR/metrics.jsonl, `flow/` TensorBoard scalars, a trace.

The torch host's modules do the writing (`telemetry/metrics.py` MetricsFile, `telemetry/tensorboard.py`,
`telemetry/trace.py`), so `mindspeed-flow report RUN_DIR` reads a flow job's run as it reads a torch-host run.

- **Where.** RUN_DIR is the flow recipe's `run_dir` when it states one, else the folder holding the job's
  `--tensorboard-dir`, else the folder holding `--save` (`recipe.flow_run_dir`); without any, nothing is written.
- **metrics.jsonl**: one line per iteration (`step` = Megatron's iteration number), written by the global last
  rank (a decoder last-stage rank, the one that prints Megatron's iteration line). Every number is already on that
  rank when Megatron's log reads its own values: the loss, learning rate and global gradient norm Megatron passes
  to `training_log`; the step plan's token counts and model FLOPs; each part leader's busy/wait seconds and every
  decoder rank's transfer bytes and seconds, which ride on the one all-reduce that finalize makes anyway
  (`schedule.finalize_with_global_tokens`). So writing it adds no communication and no host synchronisation to
  a step. A fresh run (iteration 1) moves an earlier run's files to RUN_DIR/replaced/<time>/; a resumed run
  continues the file without the lines of the iterations it redoes.
- **TensorBoard** (when the job has `--tensorboard-dir`): the torch host's sink, tags under `flow/`, in
  `<tensorboard-dir>/flow/`, not through Megatron's writer. Megatron creates its writer on the rank whose *part*
  rank is its part's last (`args.world_size` is the part's in a flow job), which need not be the rank holding
  these numbers; and the sink purges the iterations a resumed run redoes, which TensorBoard applies to every tag
  of the folder the marker is in, so in Megatron's own folder it would also erase Megatron's resumed curves. The
  sub-folder shows as its own run beside Megatron's.
- **Trace** (`trainer.trace: true` in the flow recipe): each rank's spans (see `schedule`) in
  RUN_DIR/trace/rank-NNNNN.json, merged into RUN_DIR/trace.json when the job ends.
"""
from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from mindspeed_flow.hosts.mindspeed_mm.context import PartFigures, StepStats
from mindspeed_flow.telemetry.metrics import MFU_FORMULA, MetricsFile
from mindspeed_flow.telemetry.tensorboard import SCALARS, Scalars, to_mib, open_sink

# The torch host's curves (those a flow job's lines have) and the flow job's own.
FLOW_SCALARS: Scalars = {
    **SCALARS,
    "train/grad_norm_encoder": lambda m: m.get("grad_norm_encoder"),
    "train/grad_norm_decoder": lambda m: m.get("grad_norm_backbone"),
    "transfer/embedding_mb": lambda m: to_mib(m.get("embedding_bytes")),
    "transfer/gradient_mb": lambda m: to_mib(m.get("gradient_bytes")),
}
REPLACED = "replaced"
OUTPUTS = ("metrics.jsonl", "trace.json", "trace")  # what a fresh run would overwrite


def flow_line(iteration: int, stats: StepStats, *, loss: Optional[float], lr: Optional[float],
              grad_norm: Optional[float], seconds: float, peak_flops: float,
              encoder_trainable: bool) -> dict[str, Any]:
    """One metrics.jsonl line from the writer's step stats (after `StepStats.read_pending`).

    Field names are the torch host's where the quantity is the same (`backbone_*` is the text decoder).
    `transfer_exposed_s`: seconds the decoder's receiving ranks were blocked on embeddings (summed over them);
    `transfer_hidden_s`: the rest of their streaming windows (receives posted to last embedding taken), when
    embeddings were still arriving but the decoder computed. Encoder busy/wait and gradient norm are None with a
    frozen encoder (its part is not in the reduction that carries them)."""
    c, f = stats.counts, stats.reduced or PartFigures()
    norm = stats.grad_norm_global if stats.grad_norm_global is not None else grad_norm
    dec_norm = stats.grad_norm_part
    enc_norm = None
    if encoder_trainable and norm is not None and dec_norm is not None:
        # the global norm is the 2-norm over both parts: the encoder's follows from the two
        enc_norm = math.sqrt(max(norm * norm - dec_norm * dec_norm, 0.0))
    return {
        "step": int(iteration),
        "loss": loss,
        "samples": c.samples,
        "real_tokens": c.real_tokens,
        "padded_tokens": c.padded_tokens,
        "padding_fraction": 1.0 - c.real_tokens / c.padded_tokens if c.padded_tokens else 0.0,
        "microbatches": c.microbatches,
        "microbatches_per_rank": c.microbatches_per_rank,
        "global_tokens": stats.global_tokens,
        "step_seconds": seconds,
        "encoder_busy_s": f.encoder_busy_s if encoder_trainable else None,
        "encoder_wait_s": f.encoder_wait_s if encoder_trainable else None,
        "backbone_busy_s": f.decoder_busy_s,
        "backbone_wait_s": f.decoder_wait_s,
        "transfer_exposed_s": f.transfer_exposed_s,
        "transfer_hidden_s": max(f.transfer_window_s - f.transfer_exposed_s, 0.0),
        "embedding_bytes": int(f.embedding_bytes),
        "gradient_bytes": int(f.grad_bytes_sent),
        "gradient_bytes_audio": int(f.grad_bytes_audio),  # of gradient_bytes: to an audio encoder part
        "grad_norm": norm,
        "grad_norm_backbone": dec_norm,
        "grad_norm_encoder": enc_norm,
        "mfu": (c.model_flops / max(seconds, 1e-9) / peak_flops
                if math.isfinite(peak_flops) and peak_flops > 0 else None),
        "model_tflops": c.model_flops / 1e12,
        "lr": lr,
    }


def set_aside(run_dir: Path) -> Optional[Path]:
    """Move an earlier run's outputs to RUN_DIR/replaced/<UTC time>/ (a fresh run never overwrites them)."""
    present = [run_dir / name for name in OUTPUTS if (run_dir / name).exists()]
    if not present:
        return None
    dest = run_dir / REPLACED / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest.mkdir(parents=True, exist_ok=True)
    for path in present:
        shutil.move(str(path), str(dest / path.name))
    return dest


def loss_value(loss_dict: Any) -> Optional[float]:
    """The reported loss from Megatron's per-iteration loss dict (its `loss` entry, else the first)."""
    if not loss_dict:
        return None
    value = loss_dict["loss"] if "loss" in loss_dict else next(iter(loss_dict.values()))
    if isinstance(value, (tuple, list)):  # Megatron's (sum, count) form
        value = value[0] / max(float(value[1]), 1.0)
    return float(value)  # the one read of the loss, as Megatron's own log line reads it


class FlowMetrics:
    """The writer rank's metrics.jsonl and TensorBoard sink, opened at the first iteration it logs."""

    def __init__(self, run_dir: Path, tensorboard_dir: Optional[str], peak_flops: float, peak_desc: str,
                 encoder_trainable: bool) -> None:
        self.run_dir, self.tensorboard_dir = run_dir, tensorboard_dir
        self.peak_flops, self.peak_desc = peak_flops, peak_desc
        self.encoder_trainable = encoder_trainable
        self.file: Optional[MetricsFile] = None
        self.last_at: Optional[float] = None

    def _open(self, iteration: int) -> MetricsFile:
        resumed = iteration > 1
        moved = None if resumed else set_aside(self.run_dir)
        file = MetricsFile(self.run_dir, append=resumed, resume_step=iteration)
        if self.tensorboard_dir:
            sink = open_sink(Path(self.tensorboard_dir) / "flow", iteration, prefix="flow/", scalars=FLOW_SCALARS,
                             asked_by="--tensorboard-dir", turn_off="drop --tensorboard-dir")
            if sink is not None:
                file.sinks.append(sink)
        how = f"continued from iteration {iteration}" if resumed else "new"
        if moved is not None:
            how += f"; the earlier run's files moved to {moved}"
        print(f"[mindspeed-flow] metrics: {file.path} ({how}); {MFU_FORMULA} ({self.peak_desc})", flush=True)
        return file

    def write(self, iteration: int, stats: StepStats, *, loss: Optional[float], lr: Optional[float],
              grad_norm: Optional[float], logged_at: float, step_started_at: float) -> dict[str, Any]:
        """`logged_at`: when Megatron's `training_log` was entered for this iteration. Iteration seconds run from
        the previous iteration's `logged_at` (the first from this rank's step start, setup excluded), so every
        rank's busy + wait of this step lies inside them: at --log-interval 1 Megatron's log waits for every rank
        (its timers' barrier) before any next step starts, and this rank enters it only after the global gradient
        norm, which needs every trainable part's finished backward."""
        if self.file is None:
            self.file = self._open(iteration)
        seconds = logged_at - (self.last_at if self.last_at is not None else step_started_at)
        self.last_at = logged_at
        line = flow_line(iteration, stats, loss=loss, lr=lr, grad_norm=grad_norm, seconds=seconds,
                         peak_flops=self.peak_flops, encoder_trainable=self.encoder_trainable)
        self.file.write(line)
        return line

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
