"""Steps the streaming packer makes, for the runtime: the sampler's ids through `StreamingPacker` or `WindowPacker`.

In the default mode a step is `trainer.global_batch_size` samples and `plan_step` packs them. With
`packing.step_mode: packs` the sampler's global batches are only a source of ids, in order; `StreamingPacker` packs
them with a bounded look-ahead buffer and each step is the next dp x packs_per_rank packs (nearly full; samples that
fit no full pack wait for a later step). With `step_mode: window` a step is again exactly global_batch_size samples,
chosen by `WindowPacker` from a pool of packs holding global_batch_size + lookahead samples (packing/window.py).
`PackedSteps` is a drop-in for the sampler in the step loop: `next()` gives the step's sample ids (placed ones,
then those left out as oversize) and sets `plan`, which the planner uses instead of packing the ids itself.

Resume: `state_dict()` holds the sampler's state, the ids taken from it that the packer has not read yet, and the
packer's state (buffer, ready packs, the window's pool; JSON text, one checkpoint leaf whatever their lengths), so a
resumed run gives the same steps as an uninterrupted one. Every rank runs the same code on the same ids, so every
rank has the same plans.
"""
from __future__ import annotations

import json
from collections import deque
from typing import Any

from mindspeed_flow.data.shapes import SampleShape
from mindspeed_flow.packing import CostModel, StepPlan
from mindspeed_flow.packing.streaming import StreamingPacker
from mindspeed_flow.packing.window import WindowPacker
from mindspeed_flow.topology import Topology


def step_geometry(topo: Topology) -> tuple[int, int, int]:
    """(backbone DP size, encoder ranks a plan balances over, pipeline size) as `step.plan.plan_job_step` uses them."""
    layout = topo.layout
    if layout.mode == "decoupled":  # the first encoder part's producers, as plan_decoupled_step counts them
        bridge = next(iter(topo.bridges.values()))
        return len(bridge.consumers), len(bridge.producers), layout.part("backbone").pp
    coupled = layout.part("coupled")
    return coupled.dp, coupled.dp, coupled.pp


class _SampleStream:
    """Shapes of the sampler's ids, one at a time; `pending` are ids taken from the sampler and not yet read."""

    def __init__(self, sampler: Any, dataset: Any) -> None:
        self.sampler = sampler
        self.dataset = dataset
        self.pending: deque[int] = deque()

    def __iter__(self) -> "_SampleStream":
        return self

    def __next__(self) -> SampleShape:
        if not self.pending:
            self.pending.extend(next(self.sampler))
        return self.dataset.shape(self.pending.popleft())


class PackedSteps:
    """Steps of the streaming packer over a sampler's ids; see the module docstring."""

    def __init__(self, sampler: Any, dataset: Any, *, token_budget: int, cost_model: CostModel, lookahead: int,
                 oversize_policy: str, dp: int, num_encoders: int, packs_per_rank: int, pp: int,
                 global_batch_size: int = 0, pad_multiple: int = 0) -> None:
        """`global_batch_size` > 0 selects window steps of that many samples (padded to the longest pack rounded up
        to `pad_multiple`); 0 selects steps of dp x packs_per_rank packs."""
        if packs_per_rank and packs_per_rank < pp:
            raise ValueError(f"packing.packs_per_rank={packs_per_rank}: must be >= the backbone's pipeline size "
                             f"{pp} (every pipeline runs at least pp microbatches per step), or 0 for pp")
        self.sampler = sampler
        self.dataset = dataset
        self.dp, self.num_encoders = dp, num_encoders
        self.per_rank = packs_per_rank or pp
        self.global_batch_size, self.pad_multiple = global_batch_size, pad_multiple
        self._packer_args = dict(token_budget=token_budget, cost_model=cost_model, lookahead=lookahead,
                                 oversize_policy=oversize_policy)
        self.stream = _SampleStream(sampler, dataset)
        self.packer = self._packer(self.stream)
        self.plan: StepPlan | None = None  # the plan of the step `next()` last returned

    def _packer(self, stream: _SampleStream) -> StreamingPacker | WindowPacker:
        if self.global_batch_size:
            return WindowPacker(stream, global_batch_size=self.global_batch_size, **self._packer_args)
        return StreamingPacker(stream, **self._packer_args)

    @property
    def guard(self) -> Any:
        return self.sampler.guard

    def __iter__(self) -> "PackedSteps":
        return self

    def __next__(self) -> list[int]:
        if isinstance(self.packer, WindowPacker):
            plan = self.packer.next_step(dp=self.dp, num_encoders=self.num_encoders, min_microbatches=self.per_rank,
                                         pad_multiple=self.pad_multiple)
        else:
            plan = self.packer.next_step(dp=self.dp, num_encoders=self.num_encoders,
                                         microbatches_per_rank=self.per_rank)
        if plan is None:  # the sampler is endless; a finite one ends the steps here
            raise StopIteration
        self.plan = plan
        return plan.sample_ids() + [sid for sid, _ in plan.oversize]

    def state_dict(self) -> dict[str, Any]:
        stream = {"pending": list(self.stream.pending), "packer": self.packer.state_dict()}
        return {"sampler": self.sampler.state_dict(), "stream": json.dumps(stream)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        stream = json.loads(state["stream"])
        self.stream = _SampleStream(self.sampler, self.dataset)
        self.stream.pending.extend(int(sid) for sid in stream["pending"])
        self.packer = self._packer(self.stream)
        self.packer.load_state_dict(stream["packer"], self.dataset.shape)
        self.plan = None
