"""Skip-bad-sample with a threshold, without ever desynchronising ranks.

A broken sample (missing or corrupt image, malformed JSON entry) is skipped and counted with its id and cause;
once more than `max_bad` samples were skipped the job stops with `TooManyBadSamples`, listing them, because at
that point the dataset or the code is broken, not one file. System errors (MemoryError, KeyboardInterrupt, ...)
are never swallowed.

Why the check sits on `shape(i)`: every rank plans each step from sample shapes alone, so a sample must be
judged bad *where its shape is read*, by a deterministic function of the files. Then every rank (encoder and
backbone alike) skips exactly the same ids, and no rank waits for an embedding another rank decided to drop.
Datasets raise `BadSample` from `shape(i)`; `SampleGuard.shape(dataset, i)` turns that into "skip and count".
"""
from __future__ import annotations

from typing import Any, Optional

from mindspeed_flow.data.shapes import SampleShape

# Never counted as a bad sample: they say the process, not the sample, is in trouble (or a code bug).
SYSTEM_EXCEPTIONS: tuple[type[BaseException], ...] = (
    MemoryError, KeyboardInterrupt, SystemExit, GeneratorExit, RecursionError, ImportError, NameError,
    SyntaxError, AssertionError,
)


class BadSample(Exception):
    """One sample cannot be used; `cause` says why in words a person can act on."""

    def __init__(self, sample_id: int, cause: str) -> None:
        super().__init__(f"sample {sample_id}: {cause}")
        self.sample_id = sample_id
        self.cause = cause


class TooManyBadSamples(RuntimeError):
    """More bad samples than `data.max_bad_samples`; the message lists every id and cause."""

    def __init__(self, bad: dict[int, str], max_bad: int) -> None:
        lines = "\n".join(f"  sample {sid}: {cause}" for sid, cause in sorted(bad.items()))
        super().__init__(f"{len(bad)} bad samples, more than data.max_bad_samples={max_bad}; the dataset (or the "
                         f"reader) is likely broken. Skipped samples:\n{lines}")
        self.bad = dict(bad)
        self.max_bad = max_bad


def is_system_error(exc: BaseException) -> bool:
    return isinstance(exc, SYSTEM_EXCEPTIONS) or not isinstance(exc, Exception)


class SampleGuard:
    """Counts skipped samples (id -> cause) and raises `TooManyBadSamples` above `max_bad`.

    A sample is counted once however often it is met again (later epochs, re-planning). The state is part of
    the sampler's checkpoint, so a resumed run keeps its count.
    """

    def __init__(self, max_bad: int) -> None:
        if max_bad < 0:
            raise ValueError(f"data.max_bad_samples must be >= 0, got {max_bad}")
        self.max_bad = max_bad
        self.bad: dict[int, str] = {}

    @property
    def num_bad(self) -> int:
        return len(self.bad)

    def record(self, sample_id: int, cause: str) -> None:
        """Count a bad sample; raise once the count goes above the threshold."""
        if sample_id in self.bad:
            return
        self.bad[sample_id] = cause
        if len(self.bad) > self.max_bad:
            raise TooManyBadSamples(self.bad, self.max_bad)

    def shape(self, dataset: Any, index: int) -> Optional[SampleShape]:
        """`dataset.shape(index)`, or None (counted) if the sample is bad; system errors propagate."""
        if index in self.bad:
            return None
        try:
            return dataset.shape(index)
        except BadSample as exc:
            self.record(index, exc.cause)
        except Exception as exc:  # noqa: BLE001 - any non-system failure of one sample is that sample's fault
            if is_system_error(exc):
                raise
            self.record(index, f"{type(exc).__name__}: {exc}")
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"max_bad": self.max_bad, "bad": {int(k): v for k, v in self.bad.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bad = {int(k): str(v) for k, v in state["bad"].items()}


# The brief's other name for the same object.
BadSampleTracker = SampleGuard
