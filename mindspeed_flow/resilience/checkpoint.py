"""Layout-agnostic, verified training checkpoints with torch.distributed.checkpoint (DCP).

Keys are the parameter names of the two parts, `encoder.<name>` and `backbone.<name>`, whatever the layout
(DP replicas, pipeline stages, FSDP2 shards, or the coupled baseline holding both): DCP deduplicates replicas
and stores shards, so a decoupled run and the coupled baseline write the same keys and a run can resume on
another layout (another DP size on either part: DCP reshards on load). Optimizer moments are stored under the
same names (`optim.<key>.exp_avg` ...).

Safety. Rank 0 writes `manifest.json` last, once DCP reports every rank's files written: the run id, the step,
the layout, the data position, every rank's RNG state and each file's size and SHA-256. A step folder counts
only when its manifest exists, belongs to this run and matches the files; a resume walks the folders newest
first and loads the first that verifies, printing one line per folder it skipped and why (truncated `.distcp`,
truncated `.metadata`, unfinished save, another run's). A finished checkpoint of this run that fails
verification (truncated, bit-flipped, unreadable manifest) is renamed `step-N.corrupt` (kept byte for byte for
inspection, never deleted) so it can never count as this run's newest for keep-last: otherwise, after a fallback,
every new valid save would be purged at once in favour of the corrupt ones. Older checkpoints are deleted only
after a newer one is complete, only this run's valid ones, and a failed delete never stops training. A failed save
(ENOSPC ...) never writes a manifest, so the previous checkpoint stays the newest valid one; its partial folder is
removed, so that a full disk is not kept full by the save that failed. Async saves use their own gloo group
(on the default group `async_save` deadlocks while training runs).
"""
from __future__ import annotations

import base64
import errno
import hashlib
import io
import json
import os
import re
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from mindspeed_flow.overlap import checkpoint_tensor

STEP_DIR = re.compile(r"^step-(\d+)$")
ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
CORRUPT_SUFFIX = ".corrupt"


class CheckpointSaveError(RuntimeError):
    """A save failed (disk full, I/O error); the previous checkpoint is intact."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every `step-N` folder, newest first, whether valid or not."""
    out = []
    if Path(root).is_dir():
        for d in Path(root).iterdir():
            m = STEP_DIR.match(d.name)
            if m and d.is_dir():
                out.append((int(m.group(1)), d))
    return sorted(out, reverse=True)


def read_manifest(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def verify(path: Path, run_id: Optional[str] = None, *, hashes: bool = True) -> Optional[str]:
    """Why the checkpoint folder `path` cannot be loaded, or None when its manifest matches its files."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest is None:
        if (path / MANIFEST).exists():
            return f"{MANIFEST} is unreadable"
        return f"no {MANIFEST} (the save did not finish)"
    if run_id is not None and manifest.get("run_id") != run_id:
        return f"it belongs to run {manifest.get('run_id')}, not this run ({run_id})"
    for name, want in sorted(manifest.get("files", {}).items()):
        f = path / name
        if not f.exists():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{name} has {size} bytes, the manifest says {want['size']} (truncated)" if size < want["size"] \
                else f"{name} has {size} bytes, the manifest says {want['size']}"
        if hashes and _sha256(f) != want["sha256"]:
            return f"{name} does not match its SHA-256 in the manifest (corrupt)"
    if ".metadata" not in manifest.get("files", {}):
        return "the manifest lists no .metadata"
    return None


def valid_steps(root: Path, run_id: Optional[str] = None) -> list[int]:
    """Steps of the folders under `root` whose manifest verifies (sizes only), oldest first."""
    return sorted(s for s, d in _step_dirs(root) if verify(d, run_id, hashes=False) is None)


def move_aside(path: Path) -> Optional[Path]:
    """Rename a checkpoint folder that failed verification to `<name>.corrupt` (`.corrupt-2` ... if taken), out of
    reach of resume and keep-last; None (with a warning) when the rename fails, which never stops training."""
    path = Path(path)
    for n in range(1, 1000):
        dest = path.with_name(path.name + CORRUPT_SUFFIX + ("" if n == 1 else f"-{n}"))
        if not dest.exists():
            break
    try:
        os.rename(path, dest)
    except OSError as e:
        print(f"[mindspeed-flow] warning: could not move the corrupt checkpoint {path} aside: {e}", flush=True)
        return None
    return dest


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


def _rng_blob() -> str:
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def _set_rng_blob(blob: str) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(blob)), dtype=torch.uint8))


class _DiskFull(FileSystem):
    """Fault drill: DCP's file system, but every data file fails with ENOSPC after half a chunk is written,
    as a full disk does (the file exists, partially written)."""

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[io.IOBase, None, None]:
        with super().create_stream(path, mode) as stream:
            if str(path).endswith(".distcp"):
                real_write = stream.write

                def write(data: Any) -> int:
                    real_write(bytes(memoryview(data)[: max(1, len(memoryview(data)) // 2)]))
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

                stream.write = write  # type: ignore[method-assign]
            yield stream


@dataclass
class _Pending:
    step: int
    path: Path
    future: Any
    meta: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[BaseException] = None


class Checkpointer:
    """Saves (sync or async) and verified resume for one run's `RUN_DIR/checkpoints` (see module docstring)."""

    def __init__(self, root: Path, *, run_id: str = "", keep_last: int = 2, async_save: bool = False,
                 layout: Optional[dict[str, Any]] = None, verbose: bool = True,
                 log_path: Optional[Path] = None) -> None:
        self.root = Path(root)
        self.run_id = run_id
        self.keep_last = keep_last
        self.async_save = async_save
        self.layout = dict(layout or {})
        self.verbose = verbose
        # Own gloo group: async saves need it and the resume decision is broadcast on it.
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._pending: Optional[_Pending] = None
        self.blocking_seconds: list[float] = []
        self.last_save_s: Optional[float] = None  # the newest finished save, start to manifest (async included)
        self.fail_next_with_enospc = False  # fault drill (faults.enospc_step)
        self.last_skipped: list[str] = []  # the folders the last load_latest skipped, each with why
        # Rank 0 appends one JSON line per save / restore: how long the loop was blocked, bytes, restore time.
        self.log_path = log_path

    def _log(self, **event: Any) -> None:
        if self.log_path is not None and self._rank == 0:
            try:
                with open(self.log_path, "a") as f:
                    f.write(json.dumps(event) + "\n")
            except OSError as e:  # a timing log; the checkpoints themselves are verified by their manifests
                print(f"[mindspeed-flow] warning: could not append to {self.log_path}: {e.strerror or e}", flush=True)

    @property
    def _rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def save(self, step: int, params: dict[str, torch.nn.Parameter], optimizer: Optional[torch.optim.Optimizer],
             extra: dict[str, Any]) -> Path:
        """Save step `step`; raises `CheckpointSaveError` when it (or the previous async save) failed."""
        self.wait()
        start = time.perf_counter()
        path = self.root / f"step-{step}"
        if self._rank == 0:
            # A folder re-saved (a resumed run passing the same step) is invalid until its new manifest exists.
            (path / MANIFEST).unlink(missing_ok=True)
        rngs: list[Any] = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
        if dist.is_initialized():
            dist.all_gather_object(rngs, _rng_blob(), group=self.group)
        else:
            rngs = [_rng_blob()]
        meta = {"extra": _jsonable(extra), "rng": {str(r): b for r, b in enumerate(rngs)}, "_start": start}
        state = training_state(params, optimizer, extra)
        writer = dcp.FileSystemWriter(str(path))
        if self.fail_next_with_enospc:
            self.fail_next_with_enospc = False
            writer.fs = _DiskFull()
        if self.async_save:
            fut = dcp.async_save(state, storage_writer=writer, checkpoint_id=str(path), process_group=self.group)
            pending = _Pending(step, path, fut, meta)
            self._pending = pending
            fut.add_done_callback(lambda f, p=pending: self._on_async_done(p))
        else:
            try:
                dcp.save(state, storage_writer=writer, checkpoint_id=str(path))
                self._finalize(step, path, meta)  # the manifest write can meet the full disk too
            except (Exception, CheckpointException) as exc:  # DCP's (a BaseException) carries every rank's failure
                raise self._save_error(step, path, exc) from None
        self.blocking_seconds.append(time.perf_counter() - start)
        self._log(event="save", step=step, async_save=self.async_save, blocked_s=self.blocking_seconds[-1])
        return path

    def _on_async_done(self, pending: _Pending) -> None:
        """Runs in DCP's background thread when the async save ends: the manifest is written at once, so a kill
        right after still finds a valid checkpoint."""
        try:
            pending.future.result()
            self._finalize(pending.step, pending.path, pending.meta)
        except BaseException as exc:  # noqa: BLE001 - reported on the training thread by wait()
            pending.error = exc
        finally:
            pending.done.set()

    def wait(self) -> None:
        """Block until the pending async save is complete; raise `CheckpointSaveError` if it failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.future.result()
        except (Exception, CheckpointException):  # the callback recorded it
            pass
        pending.done.wait()
        if pending.error is not None:
            raise self._save_error(pending.step, pending.path, pending.error) from None

    def _save_error(self, step: int, path: Path, exc: BaseException) -> CheckpointSaveError:
        prev = valid_steps(self.root, self.run_id)
        cause = _root_cause(exc)
        # A full disk does not always surface as ENOSPC: torch's zip writer (torch.save inside DCP) reports the
        # short write as "unexpected pos A vs B". That, or a file system left with next to nothing free (measured
        # before the partial folder goes; another rank may already have removed it), names the cause.
        free = shutil.disk_usage(self.root).free if self.root.exists() else None
        short_write = "unexpected pos" in cause
        if "No space left on device" not in cause and (short_write or (free is not None and free < FULL_DISK_BYTES)):
            cause += (f" (No space left on device{', a short write' if short_write else ''}: the file system holding "
                      f"{self.root} has {free} bytes free now)")
        removed = ""
        # The failed save's partial files never counted (no manifest); left behind they would keep a full disk full
        # and fail the next metrics line or save. DCP reports a failure once every rank has stopped writing.
        if self._rank == 0 and path.is_dir() and not (path / MANIFEST).exists():
            freed = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            shutil.rmtree(path, ignore_errors=True)
            removed = f"; its partial folder was removed ({freed / 2**20:.1f} MiB freed)"
        return CheckpointSaveError(
            f"checkpoint {path} failed: {cause}{removed}; "
            + (f"the previous checkpoint step-{prev[-1]} is intact" if prev else "there is no earlier checkpoint"))

    def _finalize(self, step: int, path: Path, meta: dict[str, Any]) -> None:
        """Rank 0: write the manifest (last, atomically), then purge this run's older checkpoints."""
        start = meta.pop("_start", None)
        if start is not None:  # every rank: the whole save as this rank saw it (the stop-on-signal bound uses it)
            self.last_save_s = time.perf_counter() - start
        if self._rank != 0:
            return
        files = {f.name: {"size": f.stat().st_size, "sha256": _sha256(f)}
                 for f in sorted(path.iterdir()) if f.is_file() and not f.name.startswith(MANIFEST)}
        manifest = {"version": MANIFEST_VERSION, "run_id": self.run_id, "step": step,
                    "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "layout": self.layout,
                    "world_size": len(meta["rng"]), **meta, "files": files}
        tmp = path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, path / MANIFEST)
        self._log(event="saved", step=step, bytes=sum(f["size"] for f in files.values()),
                  total_s=time.perf_counter() - start if start is not None else None)
        self._purge()

    def _purge(self) -> None:
        if self._rank != 0 or self.keep_last <= 0:
            return
        mine = []
        for s, d in _step_dirs(self.root):
            if (read_manifest(d) or {}).get("run_id") != self.run_id or not (d / MANIFEST).exists():
                continue  # another run's, or an unfinished save: never this run's to count or delete
            if verify(d, self.run_id, hashes=False) is None:  # sizes only: hashing every folder per save is slow
                mine.append(s)
            elif (dest := move_aside(d)) is not None:
                print(f"[mindspeed-flow] warning: checkpoint {d} fails verification ({verify(dest, self.run_id)}); "
                      f"moved aside to {dest.name}", flush=True)
        for s in sorted(mine)[:-self.keep_last]:
            try:
                shutil.rmtree(self.root / f"step-{s}")
            except OSError as e:  # a failed delete must never stop training
                print(f"[mindspeed-flow] warning: could not delete old checkpoint step-{s}: {e}", flush=True)

    def choose(self) -> tuple[Optional[Path], list[str]]:
        """Rank 0 verifies newest first; every rank gets the folder to load (or None) and the skip lines."""
        decision: list[Any] = [None]
        if self._rank == 0:
            skipped, chosen, moved = [], None, []
            for _, d in _step_dirs(self.root):
                why = verify(d, self.run_id)
                if why is None:
                    chosen = d
                    break
                skipped.append(f"{d.name} ({why})")
                if self._is_own_corrupt(d) and (dest := move_aside(d)) is not None:
                    moved.append(dest.name)
            if moved:  # one line with the skips: say where the corrupt folders went
                skipped[-1] += f"; moved aside (kept, never counted for keep-last): {', '.join(moved)}"
            decision = [(str(chosen) if chosen else None, skipped)]
        if dist.is_initialized():
            dist.broadcast_object_list(decision, src=0, group=self.group)
        chosen_s, skipped = decision[0]
        return (Path(chosen_s) if chosen_s else None), skipped

    def _is_own_corrupt(self, d: Path) -> bool:
        """A finished save (its manifest exists) of this run, or one whose manifest cannot be read: not an
        unfinished save (no manifest) and not another run's checkpoint, which are left where they are."""
        if not (d / MANIFEST).exists():
            return False
        manifest = read_manifest(d)
        return manifest is None or manifest.get("run_id") == self.run_id

    def load_latest(self, params: dict[str, torch.nn.Parameter], optimizer: Optional[torch.optim.Optimizer],
                    extra_template: dict[str, Any],
                    admit: Optional[Callable[[Path, dict[str, Any]], None]] = None) -> Optional[dict[str, Any]]:
        """Load the newest verified checkpoint of this run in place (DCP reshards to this layout); returns its
        `extra` dict, or None when there is none. Skipped folders are reported in one line on rank 0. `admit`
        sees the chosen folder and its manifest's `extra` before anything is loaded, and may raise to refuse it."""
        verify_start = time.perf_counter()
        chosen, skipped = self.choose()
        self.last_skipped = skipped  # what a refused resume reports
        verify_s = time.perf_counter() - verify_start
        if skipped and self.verbose and self._rank == 0:
            print(f"[mindspeed-flow] resume: skipped {'; '.join(skipped)}; "
                  + (f"using {chosen}" if chosen else "no valid checkpoint left"), flush=True)
        if chosen is None:
            return None
        if admit is not None:
            admit(chosen, (read_manifest(chosen) or {}).get("extra", {}))
        start = time.perf_counter()
        if optimizer is not None:
            _ensure_adam_state(optimizer, params)
        after_load: list[Callable[[], None]] = []
        state = training_state(params, optimizer, extra_template, after_load)
        dcp.load(state, checkpoint_id=str(chosen))
        for finish in after_load:
            finish()
        manifest = read_manifest(chosen) or {}
        world = dist.get_world_size() if dist.is_initialized() else 1
        rng = manifest.get("rng", {})
        if len(rng) == world and str(self._rank) in rng:  # same world: every rank continues its own RNG stream
            _set_rng_blob(rng[str(self._rank)])
        self._log(event="restore", step=manifest.get("step"), verify_s=verify_s, restore_s=time.perf_counter() - start)
        return state["extra"]


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return repr(obj)


# Free bytes under which a failed save's file system counts as full (one checkpoint shard is far larger).
FULL_DISK_BYTES = 1 << 20


def _root_cause(exc: BaseException) -> str:
    """DCP's CheckpointException maps each failed rank to (exception, traceback); the first OSError is what a
    person can act on (ENOSPC, EIO ...)."""
    failures = getattr(exc, "failures", None)
    causes = [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())] \
        if isinstance(failures, dict) else [exc]
    for c in causes:
        if isinstance(c, OSError):
            return f"{type(c).__name__}: {c}"
    first = causes[0] if causes else exc
    return f"{type(first).__name__}: {str(first).splitlines()[0] if str(first) else ''}"


def load_flat(path: Path) -> dict[str, torch.Tensor]:
    """A DCP checkpoint's model tensors on one process, no process group (for comparisons and export)."""
    tmp = Path(str(path).rstrip("/") + ".flat.pt")
    dcp_to_torch_save(str(path), str(tmp))
    try:
        state = torch.load(tmp, weights_only=False)
    finally:
        tmp.unlink(missing_ok=True)
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
