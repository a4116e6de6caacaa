"""`EmbeddingHandle`: the metadata of one embedding in the pool (what a consumer "reads by")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Tier = Literal["device", "host"]


@dataclass(frozen=True)
class EmbeddingHandle:
    """One sample's embedding: who made it, who consumes it, what it looks like and where it lives.

    `producer` and `consumer` are global ranks. `tier` is where the bytes live on the rank holding them:
    "device" (the pool's device, counted against its capacity) or "host" (spilled to host memory).
    """

    sample_id: int
    step: int
    producer: int
    consumer: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    tier: Tier

    @property
    def key(self) -> tuple[int, int]:
        return (self.sample_id, self.step)

    def describe(self) -> str:
        return f"sample {self.sample_id} (step {self.step})"
