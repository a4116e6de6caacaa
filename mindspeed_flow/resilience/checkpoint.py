"""Layout-agnostic training checkpoints with torch.distributed.checkpoint (DCP).

Keys are the parameter names of the two parts, `encoder.<name>` and `backbone.<name>`, whatever the layout
(DP replicas, pipeline stages, FSDP2 shards, or the coupled baseline holding both): DCP deduplicates replicas
and stores shards, so a decoupled run and the coupled baseline write the same keys and a run can resume on
another layout. Optimizer moments are stored under the same names (`optim.<key>.exp_avg` ...).

Safety: a step folder is valid only when DCP's `.metadata` exists (written last), so a save that dies halfway
leaves an invalid folder that is ignored and the previous checkpoint stays the newest valid one; older
checkpoints are deleted only after a newer one is complete, and a failed delete never stops training. Async
saves use their own gloo group (DESIGN §7: on the default group `async_save` deadlocks while training runs).
"""
from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from mindspeed_flow.hosts.torch.tensor_parallel import checkpoint_tensor

STEP_DIR = re.compile(r"^step-(\d+)$")
ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")


def valid_steps(root: Path) -> list[int]:
    steps = []
    if Path(root).is_dir():
        for d in Path(root).iterdir():
            m = STEP_DIR.match(d.name)
            if m and (d / ".metadata").exists():
                steps.append(int(m.group(1)))
    return sorted(steps)


def _ensure_adam_state(optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter]) -> None:
    """AdamW creates its state lazily at the first step; a resume must have tensors to load into."""
    for p in params.values():
        if p.requires_grad and p not in optimizer.state:
            optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                  "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def training_state(params: dict[str, torch.nn.Parameter], optimizer: Optional[torch.optim.Optimizer],
                   extra: dict[str, Any], after_load: Optional[list[Callable[[], None]]] = None) -> dict[str, Any]:
    """The DCP state dict. Tensor-parallel shards appear as whole tensors (`checkpoint_tensor`), so keys and
    shapes do not depend on the TP size; `after_load` collects what must run once a load has filled them."""
    def view(p: torch.nn.Parameter, t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:  # Adam's step counter
            return t
        stored, finish = checkpoint_tensor(p, t)
        if finish is not None and after_load is not None:
            after_load.append(finish)
        return stored

    state: dict[str, Any] = {"model": {k: view(p, p.data) for k, p in params.items()}, "optim": {},
                             "extra": dict(extra)}
    if optimizer is not None:
        for k, p in params.items():
            for name, t in optimizer.state.get(p, {}).items():
                if name in ADAM_KEYS:
                    state["optim"][f"{k}.{name}"] = view(p, t)
    return state


class Checkpointer:
    def __init__(self, root: Path, *, keep_last: int = 2, async_save: bool = False) -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self._group = dist.new_group(backend="gloo") if async_save else None
        self._pending: Optional[Any] = None
        self.blocking_seconds: list[float] = []

    def save(self, step: int, params: dict[str, torch.nn.Parameter], optimizer: Optional[torch.optim.Optimizer],
             extra: dict[str, Any]) -> Path:
        self.wait()
        start = time.perf_counter()
        path = self.root / f"step-{step}"
        state = training_state(params, optimizer, extra)
        if self.async_save:
            self._pending = dcp.async_save(state, checkpoint_id=str(path), process_group=self._group)
        else:
            dcp.save(state, checkpoint_id=str(path))
            self._purge()
        self.blocking_seconds.append(time.perf_counter() - start)
        return path

    def wait(self) -> None:
        if self._pending is not None:
            fut, self._pending = self._pending, None
            fut.result()
            self._purge()

    def _purge(self) -> None:
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        steps = valid_steps(self.root)
        for s in steps[:-self.keep_last] if self.keep_last > 0 else []:
            try:
                shutil.rmtree(self.root / f"step-{s}")
            except OSError as e:  # a failed delete must never stop training
                print(f"[mindspeed-flow] warning: could not delete old checkpoint step-{s}: {e}", flush=True)

    def load_latest(self, params: dict[str, torch.nn.Parameter], optimizer: Optional[torch.optim.Optimizer],
                    extra_template: dict[str, Any]) -> Optional[dict[str, Any]]:
        """Load the newest valid checkpoint in place; returns its `extra` dict, or None when there is none."""
        steps = valid_steps(self.root)
        if not steps:
            return None
        if optimizer is not None:
            _ensure_adam_state(optimizer, params)
        after_load: list[Callable[[], None]] = []
        state = training_state(params, optimizer, extra_template, after_load)
        dcp.load(state, checkpoint_id=str(self.root / f"step-{steps[-1]}"))
        for finish in after_load:
            finish()
        return state["extra"]


def load_flat(path: Path) -> dict[str, torch.Tensor]:
    """A DCP checkpoint's model tensors on one process, no process group (for comparisons and export)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp = Path(str(path).rstrip("/") + ".flat.pt")
    dcp_to_torch_save(str(path), str(tmp))
    try:
        state = torch.load(tmp, weights_only=False)
    finally:
        tmp.unlink(missing_ok=True)
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
