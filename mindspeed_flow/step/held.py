"""What an encoder holds between forward and backward, measured: saved-activation bytes of a forward
(`SavedBytes`) and the peak of groups, samples and bytes held at once during a step (`HeldPeak`).

Both hosts' encoders bound what they hold (`flow.encoder_inflight`) and report these peaks, so the bound is
checked by a number in the step's record rather than taken on trust. Torch only (no host-specific imports).
"""
from __future__ import annotations

from typing import Any

import torch


class SavedBytes:
    """Bytes of the activations autograd saves for backward inside `with self.counting():` (each storage once).

    Parameters saved by a layer are not activations (they live anyway), so they are left out; everything else a
    forward saves is held until that graph's backward frees it. Reads tensor metadata only (no device sync)."""

    def __init__(self) -> None:
        self.total = 0
        self._seen: set[int] = set()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter) and not (t.is_leaf and t.requires_grad):
            try:
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # a tensor without storage (e.g. a wrapper subclass)
                key, nbytes = id(t), t.numel() * t.element_size()
            if key not in self._seen:
                self._seen.add(key)
                self.total += nbytes
        return t

    def counting(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


class HeldPeak:
    """Peak groups, samples and bytes an encoder replica held at once during a step (activations, or sent
    embeddings)."""

    def __init__(self) -> None:
        self.groups = self.bytes = self.samples = 0
        self.peak_groups = self.peak_bytes = self.peak_samples = 0

    def add(self, nbytes: int, samples: int = 0) -> None:
        self.groups += 1
        self.bytes += nbytes
        self.samples += samples
        self.peak_groups = max(self.peak_groups, self.groups)
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.peak_samples = max(self.peak_samples, self.samples)

    def drop(self, nbytes: int, samples: int = 0) -> None:
        self.groups -= 1
        self.bytes -= nbytes
        self.samples -= samples
