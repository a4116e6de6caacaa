"""Skip-bad-sample with a threshold, without ever desynchronising ranks.

A broken sample (missing or corrupt image, malformed JSON entry) is skipped, counted and, when `log_skips` is set
(the worker sets it on one rank), reported in one line with its record's own `id`, its file and the cause. The
job stops with `TooManyBadSamples`, listing them, once more than `max_bad` samples were skipped, or once more
than `max_bad_fraction` of the samples looked at were bad (judged after `RATE_MIN_SEEN` samples, or the whole
dataset if smaller, so one bad sample first does not read as 100 %): at that point the dataset or the code is
broken, not one file. System errors (MemoryError, KeyboardInterrupt, ...)
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


RATE_MIN_SEEN = 100


class TooManyBadSamples(RuntimeError):
    """More bad samples than `data.max_bad_samples` (or `data.max_bad_fraction`); the message lists each one."""

    def __init__(self, bad: dict[int, str], max_bad: int, rule: str = "") -> None:
        lines = "\n".join(f"  sample {sid}: {cause}" for sid, cause in sorted(bad.items()))
        rule = rule or f"more than data.max_bad_samples={max_bad}"
        super().__init__(f"{len(bad)} bad samples, {rule}; the dataset (or the reader) is likely broken. "
                         f"Skipped samples:\n{lines}")
        self.bad = dict(bad)
        self.max_bad = max_bad


def is_system_error(exc: BaseException) -> bool:
    return isinstance(exc, SYSTEM_EXCEPTIONS) or not isinstance(exc, Exception)


class SampleGuard:
    """Counts skipped samples (id -> cause) and raises `TooManyBadSamples` above `max_bad`.

    A sample is counted once however often it is met again (later epochs, re-planning). The state is part of
    the sampler's checkpoint, so a resumed run keeps its count.
    """

    def __init__(self, max_bad: int, max_bad_fraction: float = 1.0, log_skips: bool = False) -> None:
        if max_bad < 0:
            raise ValueError(f"data.max_bad_samples must be >= 0, got {max_bad}")
        if not 0.0 <= max_bad_fraction <= 1.0:
            raise ValueError(f"data.max_bad_fraction must be in [0, 1], got {max_bad_fraction}")
        self.max_bad = max_bad
        self.max_bad_fraction = max_bad_fraction
        self.log_skips = log_skips
        self.bad: dict[int, str] = {}
        self.seen = 0  # shape look-ups judged (the rate's denominator; a bad sample is judged once)

    @property
    def num_bad(self) -> int:
        return len(self.bad)

    def record(self, sample_id: int, cause: str, dataset: Any = None) -> None:
        """Count a bad sample (and log it); raise once the count or the rate goes above its threshold."""
        if sample_id in self.bad:
            return
        where = _where(dataset, sample_id)
        self.bad[sample_id] = f"{where}: {cause}" if where else cause
        if self.log_skips:
            rate = f" or above data.max_bad_fraction={self.max_bad_fraction} of the samples read" \
                if self.max_bad_fraction < 1.0 else ""
            print(f"[mindspeed-flow] skipped bad sample {sample_id}{f' ({where})' if where else ''}: {cause} "
                  f"[{len(self.bad)} skipped so far; the job stops above data.max_bad_samples={self.max_bad}{rate}]",
                  flush=True)
        if len(self.bad) > self.max_bad:
            raise TooManyBadSamples(self.bad, self.max_bad)
        self._check_rate(dataset)

    def _check_rate(self, dataset: Any) -> None:
        judged_after = min(RATE_MIN_SEEN, len(dataset)) if dataset is not None else RATE_MIN_SEEN
        if self.seen >= judged_after and len(self.bad) > self.max_bad_fraction * self.seen:
            raise TooManyBadSamples(self.bad, self.max_bad, f"{len(self.bad) / self.seen:.1%} of the {self.seen} "
                                    f"samples read so far, more than data.max_bad_fraction={self.max_bad_fraction}")

    def shape(self, dataset: Any, index: int) -> Optional[SampleShape]:
        """`dataset.shape(index)`, or None (counted) if the sample is bad; system errors propagate."""
        if index in self.bad:
            return None
        try:
            out = dataset.shape(index)
        except BadSample as exc:
            self.seen += 1
            self.record(index, exc.cause, dataset)
        except Exception as exc:  # noqa: BLE001 - any non-system failure of one sample is that sample's fault
            if is_system_error(exc):
                raise
            self.seen += 1
            self.record(index, f"{type(exc).__name__}: {exc}", dataset)
        else:
            self.seen += 1
            self._check_rate(dataset)
            return out
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"max_bad": self.max_bad, "bad": {int(k): v for k, v in self.bad.items()}, "seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bad = {int(k): str(v) for k, v in state["bad"].items()}
        self.seen = int(state.get("seen", len(self.bad)))


def _where(dataset: Any, index: int) -> str:
    """'id <record id>, <file>' for datasets that know them (ShareGPT), '' otherwise; a record whose id cannot be
    read (a malformed line without one) is named by its line in the cause, never by its index as if an id."""
    parts = []
    record_id = getattr(dataset, "record_id", None)
    if record_id is not None:
        try:
            rid = record_id(index)
        except Exception:  # noqa: BLE001 - a malformed entry may have no usable id; the cause still names it
            rid = None
        if rid is not None:
            parts.append(f"id {rid!r}")
    path = getattr(dataset, "path", None)
    if isinstance(path, str):
        parts.append(path)
    return ", ".join(parts)
