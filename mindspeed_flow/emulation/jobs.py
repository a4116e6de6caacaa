"""Command lines of tiny MindSpeed-MM Qwen2.5-VL jobs that run under emulation (used by tests and users).

The flags a CPU run needs beyond a normal NPU run: `--bf16` (MindSpeed-MM's forward_step assumes the
Float16Module wrapper), `--no-gradient-accumulation-fusion` (its fused kernel is a JIT-built NPU op), and
`--variable-seq-lengths` with PP > 1 (activations are padded to seq_length, mrope tables are not).
"""
from __future__ import annotations

import math
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mindspeed_flow.emulation import log as emu_log

_ITER_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)"
                      r".*?\| (?:lm )?loss: ([^ |]+)")
JOB_TIMEOUT_S = 900
# Megatron's and MindSpeed-MM's FSDP2 trainer's log lines both end an iteration's fields with "| grad norm: X |".
_GRAD_NORM_RE = re.compile(r"iteration\s+\d+/\s*\d+ \|.*? grad norm: ([0-9.]+) \|")


@dataclass
class TinyJob:
    """One tiny Qwen2.5-VL training job; `argv()` is what follows `mindspeed-flow emulate --`."""

    model_json: Path
    data_json: Path
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    mc2: bool = False
    micro_batch_size: int = 1
    global_batch_size: int = 2
    train_iters: int = 3
    lr: float = 1e-3
    seq_length: int = 128
    vocab_size: int = 384  # the tiny tokenizer's; a family with real token ids passes its real size
    save: Path | None = None
    load: Path | None = None
    save_interval: int = 10000
    extra: list[str] = field(default_factory=list)

    def argv(self, script: str = "pretrain_vlm.py") -> list[str]:
        a = [script, "--use-mcore-models", "--tensor-model-parallel-size", str(self.tp),
             "--pipeline-model-parallel-size", str(self.pp), "--micro-batch-size", str(self.micro_batch_size),
             "--global-batch-size", str(self.global_batch_size), "--tokenizer-type", "NullTokenizer",
             "--vocab-size", str(self.vocab_size), "--seq-length", str(self.seq_length),
             "--make-vocab-size-divisible-by", "1",
             "--normalization", "RMSNorm", "--use-fused-rmsnorm", "--swiglu", "--use-fused-swiglu",
             "--no-masked-softmax-fusion", "--use-flash-attn", "--lr", str(self.lr), "--lr-decay-style", "constant",
             "--weight-decay", "0", "--train-iters", str(self.train_iters), "--clip-grad", "1.0",
             "--adam-beta1", "0.9", "--adam-beta2", "0.999", "--no-gradient-accumulation-fusion", "--seed", "42",
             "--bf16", "--num-workers", "0", "--distributed-backend", "nccl",
             "--mm-data", str(self.data_json), "--mm-model", str(self.model_json),
             "--mm-tool", "mindspeed_mm/tools/tools.json",
             "--log-interval", "1", "--eval-interval", "10000", "--eval-iters", "0",
             "--save-interval", str(self.save_interval), "--ckpt-format", "torch"]
        if self.sequence_parallel:
            a.append("--sequence-parallel")
        if self.distributed_optimizer:
            a.append("--use-distributed-optimizer")
        if self.pp > 1:
            a.append("--variable-seq-lengths")
        if self.mc2:
            a.append("--use-ascend-mc2")
        if self.save is not None:
            a += ["--save", str(self.save)]
        if self.load is not None:
            a += ["--load", str(self.load)]
        return a + list(self.extra)


_SYNCS_RE = re.compile(r"\[msf-emulation rank=(\d+)\] host syncs: copies to host (\d+), scalar reads (\d+), "
                       r"data-dependent shapes (\d+)")


def host_syncs(output: str) -> dict[int, tuple[int, int, int]]:
    """{rank: (copies to host, scalar reads, data-dependent shapes)} from the exit summaries of a strict job's
    output (a job run with --log)."""
    return {int(r): (int(a), int(b), int(c)) for r, a, b, c in _SYNCS_RE.findall(output)}


@dataclass
class JobResult:
    rc: int
    output: str
    iterations: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    times_ms: list[float] = field(default_factory=list)
    log: dict[str, set[str]] = field(default_factory=dict)

    def assert_trained(self, n_iters: int, first: int = 1) -> None:
        assert self.rc == 0, f"job failed (rc={self.rc}):\n{self.output[-6000:]}"
        assert self.iterations == list(range(first, first + n_iters)), (self.iterations, self.output[-3000:])
        assert all(math.isfinite(x) for x in self.losses), self.losses


def parse_iterations(output: str) -> tuple[list[int], list[float], list[float]]:
    its, losses, times = [], [], []
    for m in _ITER_RE.finditer(output):
        its.append(int(m.group(1)))
        times.append(float(m.group(2)))
        losses.append(float(m.group(3)))
    return its, losses, times


def parse_grad_norms(output: str) -> list[float]:
    """The gradient norm of each logged iteration, in order."""
    return [float(x) for x in _GRAD_NORM_RE.findall(output)]


def emulate_command(argv: list[str], *, log_path: Path, nproc: int = 2, patches: bool = False,
                    flow_recipe: Path | None = None) -> list[str]:
    """The `mindspeed-flow emulate` command line of one job (its emulation log goes to `log_path`)."""
    return [sys.executable, "-m", "mindspeed_flow.cli", "emulate", "--nproc", str(nproc), "--log",
            str(log_path)] + (["--patches"] if patches else []) + \
        (["--flow-recipe", str(flow_recipe)] if flow_recipe else []) + ["--"] + argv


def job_result(rc: int, output: str, log_path: Path) -> JobResult:
    its, losses, times = parse_iterations(output)
    log = emu_log.read_log(str(log_path)) if log_path.exists() else {}
    return JobResult(rc, output, its, losses, times, log)


def emulate_job(name: str, argv: list[str], *, log_dir: Path, nproc: int = 2, patches: bool = False,
                flow_recipe: Path | None = None, timeout_s: float = JOB_TIMEOUT_S) -> JobResult:
    """Run one job through `mindspeed-flow emulate`; its emulation log is LOG_DIR/NAME.emulation.log."""
    log_path = log_dir / f"{name}.emulation.log"
    cmd = emulate_command(argv, log_path=log_path, nproc=nproc, patches=patches, flow_recipe=flow_recipe)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    return job_result(proc.returncode, proc.stdout + proc.stderr, log_path)
