"""Command lines of tiny MindSpeed-MM Qwen2.5-VL jobs that run under emulation (used by tests and users).

The flags a CPU run needs beyond a normal NPU run: `--bf16` (MindSpeed-MM's forward_step assumes the
Float16Module wrapper), `--no-gradient-accumulation-fusion` (its fused kernel is a JIT-built NPU op), and
`--variable-seq-lengths` with PP > 1 (activations are padded to seq_length, mrope tables are not).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


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
    save: Path | None = None
    load: Path | None = None
    save_interval: int = 10000
    extra: list[str] = field(default_factory=list)

    def argv(self, script: str = "pretrain_vlm.py") -> list[str]:
        a = [script, "--use-mcore-models", "--tensor-model-parallel-size", str(self.tp),
             "--pipeline-model-parallel-size", str(self.pp), "--micro-batch-size", str(self.micro_batch_size),
             "--global-batch-size", str(self.global_batch_size), "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "384", "--seq-length", str(self.seq_length), "--make-vocab-size-divisible-by", "1",
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
