"""Layout-agnostic training checkpoints with torch.distributed.checkpoint (DCP).

Keys are the parts' own parameter names under `encoder.` and `backbone.` (DP/FSDP wrappers stripped by
torch's state-dict helpers), so a checkpoint does not depend on how the parts were laid out: a decoupled run
and the coupled baseline write the same keys, and a run can resume on another layout.

Safety: a step is valid only when DCP's `.metadata` exists (written last), so a save that dies halfway leaves
an invalid folder that is ignored; older checkpoints are deleted only after a newer one is complete, and a
failed delete never stops training. Async saves use their own gloo group (DESIGN §7: on the default group
`async_save` deadlocks while training goes on).
"""
from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_state_dict)

STEP_DIR = re.compile(r"^step-(\d+)$")


class PartsModule(torch.nn.Module):
    """The parts this rank holds, under the names every layout shares."""

    def __init__(self, **parts: Optional[torch.nn.Module]) -> None:
        super().__init__()
        for name, module in parts.items():
            if module is not None:
                self.add_module(name, module)


def valid_steps(root: Path) -> list[int]:
    steps = []
    if root.is_dir():
        for d in root.iterdir():
            m = STEP_DIR.match(d.name)
            if m and (d / ".metadata").exists():
                steps.append(int(m.group(1)))
    return sorted(steps)


class Checkpointer:
    def __init__(self, root: Path, *, keep_last: int = 2, async_save: bool = False) -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self._group = dist.new_group(backend="gloo") if async_save else None
        self._pending: Optional[Any] = None
        self.save_seconds: list[float] = []

    def state(self, parts: PartsModule, optimizer: Optional[torch.optim.Optimizer], extra: dict) -> dict:
        opts = StateDictOptions(ignore_frozen_params=False)
        if optimizer is not None:
            model_sd, optim_sd = get_state_dict(parts, optimizer, options=opts)
        else:
            model_sd, optim_sd = get_state_dict(parts, [], options=opts)
        return {"model": model_sd, "optim": optim_sd, "extra": extra}

    def save(self, step: int, parts: PartsModule, optimizer: Optional[torch.optim.Optimizer], extra: dict) -> None:
        self.wait()
        start = time.perf_counter()
        path = self.root / f"step-{step}"
        state = self.state(parts, optimizer, extra)
        if self.async_save:
            self._pending = dcp.async_save(state, checkpoint_id=str(path), process_group=self._group)
        else:
            dcp.save(state, checkpoint_id=str(path))
            self._purge()
        self.save_seconds.append(time.perf_counter() - start)

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
                print(f"[mindspeed-flow] warning: could not delete old checkpoint step-{s}: {e}")

    def load_latest(self, parts: PartsModule, optimizer: Optional[torch.optim.Optimizer]) -> Optional[dict]:
        """Load the newest valid checkpoint into parts/optimizer; returns its `extra` dict or None."""
        steps = valid_steps(self.root)
        if not steps:
            return None
        path = self.root / f"step-{steps[-1]}"
        state = self.state(parts, optimizer, {"step": -1, "sampler": {}})
        dcp.load(state, checkpoint_id=str(path))
        opts = StateDictOptions(ignore_frozen_params=False)
        set_state_dict(parts, [optimizer] if optimizer is not None else [],
                       model_state_dict=state["model"], optim_state_dict=state["optim"], options=opts)
        return state["extra"]


def load_flat(path: Path) -> dict[str, torch.Tensor]:
    """Read a DCP checkpoint's model tensors on one process (for comparisons and export), no process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp = Path(path).with_suffix(".flat.pt")
    dcp_to_torch_save(str(path), str(tmp))
    state = torch.load(tmp, weights_only=False)
    tmp.unlink()
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
