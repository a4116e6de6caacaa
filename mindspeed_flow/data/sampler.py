"""Global batches of good sample ids: seeded, identical on every rank, resumable.

Every rank runs the same `GlobalBatchSampler` over the same dataset: epoch e visits the ids in the order of
`default_rng([seed, e]).permutation(n)`, skips the ones `SampleGuard` finds bad (judged from `shape(i)`, so every
rank skips the same ids), and cuts the rest into global batches of `global_batch_size` ids. An epoch's
incomplete last batch is dropped, so each batch lies inside one epoch. The planner, not the sampler, assigns a
batch's samples to ranks.

`state_dict()` after k batches, loaded into a fresh sampler, makes it yield exactly batch k+1, k+2, ... of the
uninterrupted run (the skipped-sample count comes with it).
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

import numpy as np

from mindspeed_flow.data.guard import SampleGuard


class GlobalBatchSampler:
    """Infinite iterator over global batches (lists of good sample ids); see the module docstring."""

    def __init__(self, dataset: Any, global_batch_size: int, seed: int, *, epoch: int = 0,
                 guard: Optional[SampleGuard] = None, max_bad: int = 16) -> None:
        if global_batch_size <= 0:
            raise ValueError(f"trainer.global_batch_size must be > 0, got {global_batch_size}")
        if seed < 0:
            raise ValueError(f"sampler seed must be >= 0, got {seed}")
        if len(dataset) == 0:
            raise ValueError("the dataset is empty: nothing to sample global batches from")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.guard = guard if guard is not None else SampleGuard(max_bad)
        self.epoch = epoch
        self.cursor = 0  # position in this epoch's permutation of the next id to look at
        self.batches_yielded = 0
        self._order: Optional[np.ndarray] = None
        self._order_epoch = -1

    def _permutation(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.dataset))
            self._order_epoch = self.epoch
        assert self._order is not None
        return self._order

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        while True:
            order = self._permutation()
            whole_epoch = self.cursor == 0
            batch: list[int] = []
            while self.cursor < len(order) and len(batch) < self.global_batch_size:
                sid = int(order[self.cursor])
                self.cursor += 1
                if self.guard.shape(self.dataset, sid) is not None:
                    batch.append(sid)
            if len(batch) == self.global_batch_size:
                self.batches_yielded += 1
                return batch
            if whole_epoch:  # a full pass found fewer good samples than one batch: it never will
                good = len(self.dataset) - self.guard.num_bad
                raise ValueError(f"the dataset has {good} good samples (of {len(self.dataset)}; "
                                 f"{self.guard.num_bad} bad), fewer than trainer.global_batch_size="
                                 f"{self.global_batch_size}: no global batch can be formed")
            # The epoch ran out: drop its incomplete batch and start the next epoch.
            self.epoch += 1
            self.cursor = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "global_batch_size": self.global_batch_size, "num_samples": len(self.dataset),
                "epoch": self.epoch, "cursor": self.cursor, "batches_yielded": self.batches_yielded,
                "guard": self.guard.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        why = resume_mismatch(state, {"seed": self.seed, "global_batch_size": self.global_batch_size,
                                      "num_samples": len(self.dataset)})
        if why is not None:
            raise ValueError(why)
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.batches_yielded = int(state["batches_yielded"])
        self.guard.load_state_dict(state["guard"])


# The sampler state a resume must match, by the recipe field that sets it.
RESUME_FIELDS = {"seed": "seed", "global_batch_size": "trainer.global_batch_size",
                 "num_samples": "data.num_samples (samples in the dataset)"}


def resume_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> Optional[str]:
    """One line naming the first field of `current` whose value differs from the checkpoint's sampler state
    `saved`, with the new and the old value; None when they agree."""
    for key, name in RESUME_FIELDS.items():
        if key in current and key in saved and saved[key] != current[key]:
            return (f"{name}={current[key]} but the checkpoint was saved with {name}={saved[key]}: resuming would "
                    "replay different batches")
    return None


def iter_global_batches(dataset: Any, global_batch_size: int, seed: int, epoch: int = 0, *,
                        guard: Optional[SampleGuard] = None, max_bad: int = 16) -> GlobalBatchSampler:
    """Global batches of good ids (an iterator with `state_dict()` / `load_state_dict()`)."""
    return GlobalBatchSampler(dataset, global_batch_size, seed, epoch=epoch, guard=guard,
                              max_bad=max_bad)
