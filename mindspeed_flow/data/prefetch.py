"""A tiny prefetching loader: one background thread runs `fn(id)` ahead of the consumer, in order.

The runtime feeds it the ids of a step in the order it will consume them, with `fn = lambda i:
dataset.sample(i, with_pixels=...)`, so image decoding / pixel generation overlaps the model's compute (numpy,
PIL and torch release the GIL in their heavy parts). At most `depth` results wait in the queue, which bounds the
memory held by prefetched pixels. An exception in `fn` is re-raised, unchanged, in the consumer at that item;
`close()` (or leaving the `with` block) stops the thread even if the consumer stopped early.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Generic, Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")

_DONE = object()
_POLL_S = 0.05  # how often a blocked producer checks whether it was closed


class Prefetcher(Generic[T]):
    """Iterate `fn(i) for i in ids`, computed up to `depth` items ahead in a background thread."""

    def __init__(self, fn: Callable[[Any], T], ids: Iterable[Any], depth: int = 2, *,
                 timeout_s: Optional[float] = None, name: str = "mindspeed-flow-prefetch") -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._fn = fn
        self._ids = iter(ids)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._timeout_s = timeout_s
        self._finished = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        """Put unless closed; False once the consumer has gone away."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        for sample_id in self._ids:
            if self._stop.is_set():
                return
            try:
                item: tuple[str, Any, Any] = ("ok", sample_id, self._fn(sample_id))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
                item = ("error", sample_id, exc)
            if not self._put(item) or item[0] == "error":
                return
        self._put(("done", None, _DONE))

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._finished:
            raise StopIteration
        try:
            kind, sample_id, payload = self._queue.get(timeout=self._timeout_s)
        except queue.Empty:
            raise TimeoutError(f"prefetch: no sample arrived within {self._timeout_s}s from thread "
                               f"{self._thread.name!r} (alive: {self._thread.is_alive()})") from None
        if kind == "done":
            self._finished = True
            raise StopIteration
        if kind == "error":
            self._finished = True
            # Re-raised as is (a BadSample stays a BadSample for the caller), with a note naming the item.
            if hasattr(payload, "add_note"):
                payload.add_note(f"(raised in the prefetch thread while loading item {sample_id!r})")
            raise payload
        return payload

    def close(self) -> None:
        """Stop the thread (it finishes at most the item it is computing) and drop queued results."""
        self._stop.set()
        self._finished = True
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5.0)

    def __enter__(self) -> "Prefetcher[T]":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def prefetch_samples(dataset: Any, ids: Iterable[int], *, with_pixels: bool = True, depth: int = 2,
                     timeout_s: Optional[float] = None) -> "Prefetcher[Any]":
    """`dataset.sample(i, with_pixels)` for each id, loaded ahead in a background thread (the runtime's loader)."""
    return Prefetcher(lambda i: dataset.sample(i, with_pixels=with_pixels), ids, depth, timeout_s=timeout_s)
