"""The metadata index of a MindSpeed-MM data set: what the flow job plans with, per sample, without any pixels.

Per sample (the data set's own index): its token count, vision tokens (those at model.json's
`img_context_token_id`), loss tokens (labels other than -100 after the shift), whether it carries video, its
images' or videos' `image_grid_thw` (a video's grid as MindSpeed-MM's `get_batch` renames `video_grid_thw`), and per
grid row the video's `second_per_grid_ts` (0 for an image), which MindSpeed-MM's mrope reads for video tokens; for
Qwen2.5-Omni its `<|AUDIO|>` tokens and each audio clip's frame count (its `feature_attention_mask`, which the rope
index reads on every decoder stage). Every rank plans each global batch from this alone; a rank then loads only the
content its side uses (`data.IndexedReads`).

Built once per data set by running MindSpeed-MM's own path on each sample once: the data set's item (its tokenized
text, which MindSpeed-MM's `map` preprocessing already holds) through the job's own collator (`collate_fn` of
MindSpeed-MM's loader, the processor's pixel path) on that sample alone, cut back exactly as a loader batch is
(`data.split_batch`). The build also checks that the collator leaves the item's token ids and labels as they are,
which is what lets decoder ranks take the text from the item without the collator (no pixels).

Cached beside MindSpeed-MM's data set cache: `<cache_dir>/mindspeed_flow_index/` (data.json's
`basic_parameters.cache_dir`; without one, the HF datasets cache MindSpeed-MM's `load_dataset` then uses,
`HF_DATASETS_CACHE`, default `~/.cache/huggingface/datasets`; `MSF_FLOW_INDEX_DIR` overrides both). The file's name
is a hash of everything its content depends on, so a change of any of them selects (and builds) another file:

- the data files (`basic_parameters.dataset`, globs expanded): path, size and modification time (what the HF
  datasets cache itself keys local files by; hashing a data file of many GB at every launch would cost minutes);
- the processor / tokenizer folder (`preprocess_parameters.model_name_or_path`): the content (sha256) of each of
  its files under 64 MiB (configs, vocabularies, chat templates; a hub name is taken as given);
- data.json's dataset parameters (`preprocess_parameters`, `basic_parameters`, `attr`), `--seq-length` (the
  cutoff), the flow job's token ids (vision start, image) and merge size;
- the data set's length and its HF datasets fingerprint (when it has one), and the index format.

The image files a sample names are not hashed (stat-ing millions of images at every launch is what the index
exists to avoid): an encoder rank checks each image grid it computes against the index and stops, naming the
sample and the index file, if an image changed since the index was built.

Ranks share the build: a rank that finds no index takes an exclusive file lock beside it, checks again, builds it
(with the job's `--num-workers` loader processes) and writes it atomically (a temporary file, then a rename);
the others wait on the lock, then read it. A rank that dies while building releases the lock, and the next one
builds. This works with a cache folder on each node or one shared by all. Where the folder cannot be written, each
rank builds the index in memory (and says so).
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

# 2: video samples are indexed (grids and their second_per_grid_ts) instead of only flagged.
# 3: each sample's audio tokens (Qwen2.5-Omni's <|AUDIO|> rows, which an audio encoder part produces) and its clips'
#    frame counts (the feature mask MindSpeed-MM's collator gives them, which the decoder's rope index reads).
FORMAT = 3
MAX_HASHED_FILE = 64 * 2 ** 20
INDEX_FOLDER = "mindspeed_flow_index"
_FIELDS = ("lengths", "image_tokens", "loss_tokens", "has_video", "grid_offsets", "grids", "grid_seconds",
           "audio_tokens", "clip_offsets", "clips")


@dataclass
class SampleMeta:
    length: int
    image_tokens: int
    loss_tokens: int
    has_video: bool
    grid: Optional[torch.Tensor]  # [images or videos, 3] int64, or None
    seconds: Optional[torch.Tensor] = None  # [videos] float64: a video sample's second_per_grid_ts, else None
    audio_tokens: int = 0  # its <|AUDIO|> tokens (the rows its clips encode to)
    clips: Optional[torch.Tensor] = None  # [clips, 2] int64: each clip's real frames and its mask's padded width


@dataclass
class MetadataIndex:
    """Per data set index i: lengths[i], image_tokens[i], loss_tokens[i], has_video[i], and grids[offsets[i]:
    offsets[i + 1]] (int64 tensors)."""

    lengths: torch.Tensor
    image_tokens: torch.Tensor
    loss_tokens: torch.Tensor
    has_video: torch.Tensor
    grid_offsets: torch.Tensor
    grids: torch.Tensor
    grid_seconds: torch.Tensor  # per grid row: its video's second_per_grid_ts (float64), 0 for an image
    audio_tokens: torch.Tensor  # per sample: its <|AUDIO|> tokens
    clip_offsets: torch.Tensor  # per sample i: its clips are clips[clip_offsets[i]:clip_offsets[i + 1]]
    clips: torch.Tensor  # [all clips, 2]: real frames, padded width
    key: str = ""
    path: Optional[Path] = None

    def __len__(self) -> int:
        return int(self.lengths.numel())

    def meta(self, i: int) -> SampleMeta:
        lo, hi = int(self.grid_offsets[i]), int(self.grid_offsets[i + 1])
        video = bool(self.has_video[i])
        return SampleMeta(int(self.lengths[i]), int(self.image_tokens[i]), int(self.loss_tokens[i]), video,
                          self.grids[lo:hi].clone() if hi > lo else None,
                          self.grid_seconds[lo:hi].clone() if video and hi > lo else None,
                          int(self.audio_tokens[i]), self.clips[int(self.clip_offsets[i]):
                                                                int(self.clip_offsets[i + 1])].clone()
                          if int(self.clip_offsets[i + 1]) > int(self.clip_offsets[i]) else None)

    @staticmethod
    def from_metas(metas: list[SampleMeta], key: str = "") -> "MetadataIndex":
        offsets, grids, seconds = [0], [], []
        clip_offsets, clips = [0], []
        for m in metas:
            if m.clips is not None:
                clips.append(m.clips.to(torch.long).reshape(-1, 2))
            clip_offsets.append(clip_offsets[-1] + (int(m.clips.shape[0]) if m.clips is not None else 0))
            if m.grid is not None:
                grids.append(m.grid.to(torch.long).reshape(-1, 3))
                n = int(grids[-1].shape[0])
                seconds.append(m.seconds.to(torch.float64).reshape(n) if m.seconds is not None
                               else torch.zeros(n, dtype=torch.float64))
            offsets.append(offsets[-1] + (int(m.grid.shape[0]) if m.grid is not None else 0))
        return MetadataIndex(torch.tensor([m.length for m in metas], dtype=torch.long),
                             torch.tensor([m.image_tokens for m in metas], dtype=torch.long),
                             torch.tensor([m.loss_tokens for m in metas], dtype=torch.long),
                             torch.tensor([m.has_video for m in metas], dtype=torch.bool),
                             torch.tensor(offsets, dtype=torch.long),
                             torch.cat(grids) if grids else torch.zeros((0, 3), dtype=torch.long),
                             torch.cat(seconds) if seconds else torch.zeros(0, dtype=torch.float64),
                             torch.tensor([m.audio_tokens for m in metas], dtype=torch.long),
                             torch.tensor(clip_offsets, dtype=torch.long),
                             torch.cat(clips) if clips else torch.zeros((0, 2), dtype=torch.long), key)

    def save(self, path: Path) -> None:
        """Atomically: a reader sees the whole file or none."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save({"format": FORMAT, "key": self.key, **{f: getattr(self, f) for f in _FIELDS}}, tmp)
        os.replace(tmp, path)

    @staticmethod
    def load(path: Path, key: str) -> Optional["MetadataIndex"]:
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            return None
        except Exception:  # a torn or foreign file (e.g. a disk that filled): rebuilt under the lock
            return None
        if not isinstance(blob, dict) or blob.get("format") != FORMAT or blob.get("key") != key:
            return None
        return MetadataIndex(*(blob[f] for f in _FIELDS), key=key, path=path)


# ------------------------------------------------------------------------------------------ the key


def _as_dict(node: Any) -> Any:
    if hasattr(node, "to_dict"):
        return node.to_dict()
    return node


def _data_files(basic: dict) -> list[str]:
    spec = basic.get("dataset")
    specs = spec if isinstance(spec, (list, tuple)) else [spec] if spec else []
    files: list[str] = []
    for s in specs:
        found = sorted(glob.glob(str(s))) if any(c in str(s) for c in "*?[") else [str(s)]
        files += found
    return files


def _file_stat(path: str) -> list:
    try:
        st = os.stat(path)
    except OSError:
        return [os.path.abspath(path), None, None]
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def _folder_hashes(folder: str) -> Any:
    """{file name: sha256} of a processor / tokenizer folder's files under MAX_HASHED_FILE (weights skipped)."""
    if not folder or not os.path.isdir(folder):
        return folder
    out = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or os.path.getsize(path) > MAX_HASHED_FILE:
            continue
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
        out[name] = digest.hexdigest()
    return out


def index_inputs(dataset_param: Any, seq_length: int, dataset: Any, constants: dict[str, int]) -> dict:
    """Everything the index's content depends on (see the module docstring), as plain JSON."""
    param = _as_dict(dataset_param)
    basics = param.get("basic_parameters")
    basics = [_as_dict(b) for b in basics] if isinstance(basics, (list, tuple)) else [_as_dict(basics or {})]
    preprocess = _as_dict(param.get("preprocess_parameters") or {})
    return {"format": FORMAT,
            "data_files": [_file_stat(f) for b in basics for f in _data_files(b)],
            "processor": _folder_hashes(str(preprocess.get("model_name_or_path") or "")),
            "dataset_type": param.get("dataset_type"),
            "preprocess_parameters": preprocess, "basic_parameters": basics,
            "attr": _as_dict(param.get("attr")), "seq_length": int(seq_length), "constants": constants,
            "samples": len(dataset), "fingerprint": getattr(dataset, "_fingerprint", None)}


def index_key(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def index_folder(dataset_param: Any) -> Path:
    """Where the index lives: MSF_FLOW_INDEX_DIR, else beside MindSpeed-MM's data set cache."""
    override = os.environ.get("MSF_FLOW_INDEX_DIR")
    if override:
        return Path(override)
    basics = _as_dict(_as_dict(dataset_param).get("basic_parameters") or {})
    basic = _as_dict(basics[0]) if isinstance(basics, (list, tuple)) and basics else basics
    cache = basic.get("cache_dir") if isinstance(basic, dict) else None
    if not cache:
        try:
            from datasets import config  # optional: datasets

            cache = str(config.HF_DATASETS_CACHE)
        except ImportError:
            cache = os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "datasets")
    return Path(cache) / INDEX_FOLDER


# ------------------------------------------------------------------------------------------ building


class _Described(torch.utils.data.Dataset):
    """Sample i's metadata, for a DataLoader's worker processes to build the index in parallel."""

    def __init__(self, describe: Callable[[int], SampleMeta], n: int) -> None:
        self.describe, self.n = describe, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> SampleMeta:
        return self.describe(i)


def build_index(describe: Callable[[int], SampleMeta], n: int, key: str, workers: int = 0) -> MetadataIndex:
    if workers > 0:
        loader = torch.utils.data.DataLoader(_Described(describe, n), batch_size=64, num_workers=workers,
                                             collate_fn=list)
        metas = [m for chunk in loader for m in chunk]
    else:
        metas = [describe(i) for i in range(n)]
    return MetadataIndex.from_metas(metas, key)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def load_or_build(folder: Path, inputs: dict, describe: Callable[[int], SampleMeta], n: int, *, workers: int = 0,
                  log: Callable[[str], None] = print) -> MetadataIndex:
    """The index for `inputs`: read from `folder` when a rank built it before, else built (once, under a file lock
    that the other ranks wait on) and written there."""
    key = index_key(inputs)
    path = folder / f"index-{key[:24]}.pt"
    found = MetadataIndex.load(path, key)
    if found is not None:
        log(f"metadata index: reused {path} ({len(found)} samples)")
        return found
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = _exclusive(folder / f"index-{key[:24]}.lock")
        lock.__enter__()
    except OSError as err:
        start = time.perf_counter()
        index = build_index(describe, n, key, workers)
        log(f"metadata index: built {n} samples in memory in {time.perf_counter() - start:.1f} s ({folder} is not "
            f"writable: {err}; every rank builds its own)")
        return index
    try:
        found = MetadataIndex.load(path, key)  # another rank may have built it while this one waited
        if found is not None:
            log(f"metadata index: reused {path} ({len(found)} samples, built by another rank)")
            return found
        start = time.perf_counter()
        index = build_index(describe, n, key, workers)
        index.save(path)
        (folder / f"index-{key[:24]}.json").write_text(json.dumps(inputs, indent=1, sort_keys=True, default=str))
        index.path = path
        log(f"metadata index: built {n} samples in {time.perf_counter() - start:.1f} s -> {path}")
        return index
    finally:
        lock.__exit__(None, None, None)
