"""The dataset interface every data source implements (synthetic, ShareGPT reader, length-table replay).

Contract, relied on by the sampler, the planner and the runtime:
- `len(ds)` samples, addressed by index; **the sample id is the index** (`shape(i).sample_id == i`), so an id
  taken from a plan can always be passed back to `sample(i)`.
- `shape(i)` is cheap (no pixels decoded or generated) and deterministic: every rank computes the same shape.
  A sample that cannot be used raises `BadSample` *here*, never only later in `sample(i)`.
- `sample(i, with_pixels)` returns the `VLMSample`; `sample(i).shape(ds.merge_size) == shape(i)`.
  `with_pixels=False` skips image decoding/generation (backbone ranks need token ids and grids, not pixels):
  `pixel_values` is None, `image_grid_thw` and `image_token_counts` are still set.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from mindspeed_flow.data.sample import TokenSpec, VLMSample
from mindspeed_flow.data.shapes import SampleShape


class VLMDataset(ABC):
    """Random-access, deterministic source of `VLMSample`s with cheap `shape(i)`."""

    def __init__(self, token_spec: TokenSpec) -> None:
        self.token_spec = token_spec

    @property
    def merge_size(self) -> int:
        return self.token_spec.merge_size

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def shape(self, i: int) -> SampleShape: ...

    @abstractmethod
    def sample(self, i: int, with_pixels: bool = True) -> VLMSample: ...

    def shapes(self) -> list[SampleShape]:
        """Every sample's shape (raises `BadSample` on the first bad one; use a `SampleGuard` to skip)."""
        return [self.shape(i) for i in range(len(self))]

    def _check_index(self, i: int) -> int:
        n = len(self)
        if not isinstance(i, int) or isinstance(i, bool):
            try:
                i = int(i)  # numpy integers from a permutation
            except (TypeError, ValueError):
                raise TypeError(f"{type(self).__name__}: sample index must be an int, got {i!r}") from None
        if not 0 <= i < n:
            raise IndexError(f"{type(self).__name__}: sample index {i} out of range [0, {n})")
        return i
