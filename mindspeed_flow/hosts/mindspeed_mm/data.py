"""Flow data for a MindSpeed-MM job: the same global batches as the unpatched job, planned by the packing scheduler.

Every rank builds MindSpeed-MM's own dataset and, for each decoder DP replica, MindSpeed-MM's own loader and sampler
(`build_mm_dataset`, `build_mm_dataloader` from the job's data.json) seen as that replica of the decoder's DP
(`ReplicaView`), and takes each global batch as the unpatched job's DP ranks would: each replica's next
`global_batch_size / (micro_batch_size x DP)` micro-batches, replica after replica. So each iteration yields exactly
the samples the unpatched job (with the decoder's DP) trains on, whatever the sampler. Each sample is cut back to its real tokens, and every rank plans the step from
metadata alone (text length, `image_grid_thw`) with `plan_decoupled_step`: the packing scheduler assigns samples
to (decoder DP rank, microbatch) by LLM cost, and the encoder-side balance gives each encoder replica its images in
the order the decoder consumes them. All ranks compute the same plan, so no rank asks another what to do.

Epochs: each replica's loader is cycled exactly as MindSpeed-MM's own `build_iterations` cycles it (a finished pass
starts the next one, whose order the sampler derives from the samples consumed so far), so a global batch that
straddles an epoch boundary holds the same samples as in the unpatched job, including the samples MindSpeed-MM's
sampler drops at the end of an epoch when DP x micro-batch does not divide the data set. On resume every sampler
starts at the checkpoint's consumed samples, as in the unpatched job. The replicas' loaders share the job's
`--num-workers` (each gets its share, rounded up), so the flow job starts no more loader processes than it must.

Decoder microbatches come in one of two layouts (`packing.layout`): packed (`packed.py`: one row of the
microbatch's samples back to back, each attending only to itself through the TND flash-attention kernel; the
default when the job runs flash attention) or rows (a microbatch of k samples is a [k, longest] batch with right
padding, its attention mask and -100 labels on padding, which MindSpeed-MM's Qwen2.5-VL path masks). Either is
padded to a multiple of the tensor-parallel size under sequence parallelism (which splits the sequence over TP
ranks), and no further.

Each sample also keeps what the job's loss definition needs to weigh it the way the unpatched job does: its own
loss tokens, and the loader batch (the unpatched job's microbatch) it came in with its token and sample counts.

What each rank reads (`IndexedReads`, the default for a map-style data set): the samplers' batches are taken as
lists of data set indices (each replica loader's own `batch_sampler`, cycled as above; the loaders themselves are
never iterated) and every rank plans the step from the metadata index (`index.py`: token counts, image grids,
loss tokens, built once per data set and cached beside MindSpeed-MM's data set cache). Then each rank loads only
what its side uses, through MindSpeed-MM's own code:

- encoder ranks: the pixels of the samples their replica encodes (`encode_order` of their bridge rank), each
  sample's item through the job's own collator alone (MindSpeed-MM's processor path); no token ids, no labels;
- decoder ranks: the token ids of their DP rank's microbatches, from the data set's item (the tokenized text that
  MindSpeed-MM's `map` preprocessing holds; the index build checked that the collator keeps it as it is), on
  every TP rank and pipeline stage (the embedding on the first stage, MindSpeed-MM's mrope positions on every
  stage, in both layouts, need them), labels only on the last stage (the loss), grids from the index, no pixels.

Video samples are decoupled as MindSpeed-MM's Megatron path trains them: its `get_batch` renames a batch's
`pixel_values_videos` / `video_grid_thw` to `pixel_values` / `image_grid_thw`, so the ViT encodes a video as an image
of several temporal patches, and its model scatters the embeddings only at model.json's `img_context_token_id`,
which a video data set therefore sets to the `<|video_pad|>` id (MindSpeed-MM's Qwen2.5-VL README). The flow job
renames the same way (`as_vision_batch`), counts vision tokens at that id, and carries each video's
`second_per_grid_ts`, which MindSpeed-MM's mrope reads for video tokens. A batch with both images and videos is
refused: MindSpeed-MM's rename replaces the images' pixels with the videos', so the unpatched job cannot train it.

A streaming (iterable) data set has no indices to plan from: it is read as before (`WholeBatchReads`: every rank
reads the whole global batch, pixels included, through the loaders), and the launch says so.
`MSF_FLOW_DATA_READS=whole` forces that path for comparison (`mindspeed-flow bench msmm`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from mindspeed_flow.data.shapes import SampleShape
from mindspeed_flow.hosts.mindspeed_mm.context import StepCounts
from mindspeed_flow.hosts.mindspeed_mm.index import MetadataIndex, SampleMeta
from mindspeed_flow.hosts.mindspeed_mm.packed import padded_length
from mindspeed_flow.packing import CostModel
from mindspeed_flow.step.layout import AUDIO, ENCODER, Bridge
from mindspeed_flow.step.plan import StepWork, encoder_costs, plan_decoupled_step

IGNORE_INDEX = -100
# Batch keys of the video path (MindSpeed-MM's get_batch renames them to pixel_values / image_grid_thw).
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw")
IMAGE_KEYS = ("pixel_values", "image_grid_thw")
# Per video of a batch: seconds per temporal grid step, read by MindSpeed-MM's Qwen2.5-VL mrope for video tokens
# (a list of floats); Qwen2.5-Omni's collator names it video_second_per_grid (a tensor).
SECONDS_KEY = "second_per_grid_ts"
OMNI_SECONDS_KEY = "video_second_per_grid"
# Audio clips of a batch (Qwen2.5-Omni): log-mel features [clips, mel bins, frames] padded to the feature
# extractor's window, and which frames are real [clips, frames]. A sample's clips each open with <|audio_bos|>.
AUDIO_KEYS = ("input_features", "feature_attention_mask")
AUDIO_START_ID = 151647  # MindSpeed-MM's default model.json audio_start_token_id (Qwen2.5-Omni's <|audio_bos|>)
AUDIO_TOKEN_ID = 151646  # Qwen2.5-Omni's <|AUDIO|>: MindSpeed-MM scatters the audio encoder's rows there (fixed)


class FlowDataError(ValueError):
    """A batch the flow job cannot train as the unpatched job would; the message names the sample and the rule."""


@dataclass(frozen=True)
class ReplicaView:
    """What MindSpeed-MM's sampler asks of a process group (`size()`, `rank()`): replica `index` of `replicas`."""

    replicas: int
    index: int

    def size(self) -> int:
        return self.replicas

    def rank(self) -> int:
        return self.index


@dataclass
class FlowSample:
    """One sample of a global batch. Its metadata (length, tokens, grid, loss counts) is on every rank; its content
    (token ids, labels, pixels) only where a rank's side uses it (None elsewhere)."""

    sample_id: int  # its place in the global batch
    input_ids: Optional[torch.Tensor]  # [len]
    labels: Optional[torch.Tensor]  # [len]
    pixel_values: Optional[torch.Tensor]  # [patches, C] or None
    image_grid_thw: Optional[torch.Tensor]  # [images or videos, 3] or None
    image_tokens: int  # tokens at model.json's img_context_token_id (a video's, in a video data set)
    loss_tokens: int = 0  # tokens whose (shifted) label counts in the loss
    batch_index: int = 0  # the loader batch (the unpatched job's microbatch) this sample came in
    batch_loss_tokens: int = 0  # loss tokens of that whole loader batch
    batch_samples: int = 1  # samples in that loader batch
    position_ids: Optional[torch.Tensor] = None  # [3, len]: its own rope positions (packed layout; set once)
    length: int = -1  # tokens (from input_ids when not given)
    dataset_index: int = -1  # its index in MindSpeed-MM's data set (index reads)
    second_per_grid_ts: Optional[torch.Tensor] = None  # [videos] float64: a video sample's, else None
    audio_features: Optional[torch.Tensor] = None  # [clips, mel bins, frames]: its audio (Qwen2.5-Omni), else None
    audio_mask: Optional[torch.Tensor] = None  # [clips, frames]
    audio_tokens: int = 0  # its <|AUDIO|> tokens: the rows its clips encode to

    def __post_init__(self) -> None:
        if self.length < 0 and self.input_ids is not None:
            self.length = int(self.input_ids.numel())

    def shape(self, merge_size: int) -> SampleShape:
        grids = tuple(tuple(int(v) for v in g) for g in self.image_grid_thw) if self.image_grid_thw is not None \
            else ()
        return SampleShape(self.sample_id, self.length - self.image_tokens, grids, merge_size)

    def labels_or_ignored(self) -> torch.Tensor:
        """Its labels; -100 everywhere on a rank that computes no loss (a decoder stage before the last)."""
        if self.labels is not None:
            return self.labels
        return torch.full_like(self.input_ids, IGNORE_INDEX)


@dataclass
class FlowStep:
    """One global batch and its plan, as every rank sees it."""

    step: int
    samples: dict[int, FlowSample]
    work: StepWork
    counts: StepCounts = field(default_factory=StepCounts)

    def microbatches(self, dp_rank: int) -> list[list[int]]:
        return [mb.sample_ids for mb in self.work.plan.microbatches[dp_rank]]


def mixed_error(which: str) -> FlowDataError:
    return FlowDataError(f"{which} carry both images and videos: MindSpeed-MM's get_batch (pretrain_vlm.py) replaces "
                         "pixel_values with pixel_values_videos and scatters at one img_context_token_id, so the "
                         "unpatched job cannot train them; keep images and videos in separate data sets")


def as_vision_batch(batch: dict[str, Any], which: str) -> tuple[dict[str, Any], bool]:
    """(the batch with its video keys renamed to the image keys as MindSpeed-MM's get_batch renames them, whether
    it carried video). Refuses a batch with both (see `mixed_error`)."""
    if not any(batch.get(k) is not None for k in VIDEO_KEYS):
        return batch, False
    if any(batch.get(k) is not None for k in IMAGE_KEYS):
        raise mixed_error(which)
    renamed = {k: v for k, v in batch.items() if k not in VIDEO_KEYS}
    renamed["pixel_values"], renamed["image_grid_thw"] = batch["pixel_values_videos"], batch["video_grid_thw"]
    return renamed, True


def split_batch(batch: dict[str, Any], first_id: int, vision_start_id: int, image_token_id: int,
                merge_size: int, batch_index: int = 0) -> list[FlowSample]:
    """Cut a collated MindSpeed-MM batch ([b, s], right padding) back into its samples."""
    which = f"samples {first_id}-{first_id + int(batch['input_ids'].shape[0]) - 1}"
    batch, video = as_vision_batch(batch, which)
    seconds = batch.get(SECONDS_KEY, batch.get(OMNI_SECONDS_KEY)) if video else None
    if video and seconds is not None:
        seconds = torch.as_tensor(seconds, dtype=torch.float64).reshape(-1)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    pixels, grids = batch.get("pixel_values"), batch.get("image_grid_thw")
    features, feature_mask = (batch.get(k) for k in AUDIO_KEYS)
    out, img_ptr, pix_ptr, clip_ptr = [], 0, 0, 0
    for b in range(ids.shape[0]):
        keep = mask[b].bool()
        sample_ids, sample_labels = ids[b][keep].clone(), labels[b][keep].clone()
        n_images = int((sample_ids == vision_start_id).sum())
        grid = pix = secs = None
        if n_images and grids is not None:
            grid = grids[img_ptr:img_ptr + n_images].clone()
            patches = int(grid.prod(dim=1).sum())
            pix = pixels[pix_ptr:pix_ptr + patches].clone()
            if seconds is not None:
                secs = seconds[img_ptr:img_ptr + n_images].clone()
            img_ptr, pix_ptr = img_ptr + n_images, pix_ptr + patches
        image_tokens = int((sample_ids == image_token_id).sum())
        if grid is not None and image_tokens != int(grid.prod(dim=1).sum()) // (merge_size * merge_size):
            # MindSpeed-MM scatters the ViT's rows at img_context_token_id alone (vlm_model.py), so a video data
            # set must name the video token there; the unpatched job fails on this sample with a shape mismatch.
            hint = (f" at img_context_token_id {image_token_id}: a video data set needs model.json's "
                    "img_context_token_id set to the <|video_pad|> id (MindSpeed-MM scatters video embeddings "
                    "there only)") if video else ""
            raise ValueError(f"sample {first_id + b}: {image_tokens} {'vision' if video else 'image'} tokens{hint} "
                             f"but {'video' if video else 'image'}_grid_thw {grid.tolist()} gives "
                             f"{int(grid.prod(dim=1).sum()) // merge_size ** 2}")
        loss_tokens = int((sample_labels[1:] != IGNORE_INDEX).sum())
        sample = FlowSample(first_id + b, sample_ids, sample_labels, pix, grid, image_tokens, loss_tokens,
                            batch_index, second_per_grid_ts=secs,
                            audio_tokens=int((sample_ids == AUDIO_TOKEN_ID).sum()))
        clips = int((sample_ids == AUDIO_START_ID).sum()) if features is not None else 0
        if clips:
            sample.audio_features = features[clip_ptr:clip_ptr + clips].clone()
            sample.audio_mask = feature_mask[clip_ptr:clip_ptr + clips].clone()
            clip_ptr += clips
        out.append(sample)
    batch_tokens = sum(s.loss_tokens for s in out)
    for s in out:
        s.batch_loss_tokens, s.batch_samples = batch_tokens, len(out)
    return out


LAYOUT_ROWS, LAYOUT_PACKED = "rows", "packed"


def microbatch_tokens(lengths: list[int], layout: str, pad_multiple: int) -> int:
    """Tokens a decoder microbatch of samples of these lengths computes on, padding included."""
    if layout == LAYOUT_PACKED:
        return padded_length(max(sum(lengths), 1), pad_multiple)
    return max(len(lengths), 1) * padded_length(max(lengths, default=1), pad_multiple)


def collate_rows(samples: list[FlowSample], pad_id: int = 0, pad_multiple: int = 1,
                 seconds_key: str = SECONDS_KEY, audio: bool = False) -> dict[str, Any]:
    """A decoder microbatch: one row per sample, right-padded to the longest (rounded up to `pad_multiple`),
    padding masked out of the loss. An empty microbatch (the plan gave this DP rank fewer samples than
    microbatches) is one padding row that attends to itself and carries no loss, so every rank still runs the
    schedule's microbatch count. `seconds_key`: the batch key the model's rope index reads the videos' seconds
    per grid step from; `audio`: the model has an audio encoder (`add_audio`)."""
    if not samples:
        length = padded_length(1, pad_multiple)
        batch: dict[str, Any] = {"input_ids": torch.full((1, length), pad_id, dtype=torch.long),
                                 "labels": torch.full((1, length), IGNORE_INDEX, dtype=torch.long),
                                 "attention_mask": torch.ones((1, length), dtype=torch.long)}
        return add_audio(batch, samples) if audio else batch
    length = padded_length(max(int(s.input_ids.numel()) for s in samples), pad_multiple)
    ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(samples), length), dtype=torch.long)
    for i, s in enumerate(samples):
        n = int(s.input_ids.numel())
        ids[i, :n], labels[i, :n], mask[i, :n] = s.input_ids, s.labels_or_ignored(), 1
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    grids = [s.image_grid_thw for s in samples if s.image_grid_thw is not None]
    if grids:
        batch["image_grid_thw"] = torch.cat(grids, dim=0)
    seconds = microbatch_seconds(samples)
    if seconds is not None:
        batch[seconds_key] = seconds if seconds_key == SECONDS_KEY else torch.tensor(seconds)
    return add_audio(batch, samples) if audio else batch


def add_audio(batch: dict[str, Any], samples: list[FlowSample]) -> dict[str, Any]:
    """The microbatch's audio clips in sample order, as MindSpeed-MM's collator batches them. Qwen2.5-Omni's rope
    index sums feature_attention_mask in every microbatch, so one without audio carries an empty one (and no
    input_features: the model runs its audio encoder only when they are there)."""
    clips = [s for s in samples if s.audio_mask is not None]
    if not clips:
        batch["feature_attention_mask"] = torch.zeros((0, 1), dtype=torch.long)
        return batch
    # Each sample's clips come padded by its own collator call; a batch pads them to its widest (the features are
    # read through the mask, so the width changes no value).
    width = max(int(s.audio_mask.shape[1]) for s in clips)
    batch["feature_attention_mask"] = torch.cat([_pad_last(s.audio_mask, width) for s in clips], dim=0)
    if all(s.audio_features is not None for s in clips):  # the audio encoder runs here (else: on its own part)
        batch["input_features"] = torch.cat([_pad_last(s.audio_features, width) for s in clips], dim=0)
    return batch


def _pad_last(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if int(t.shape[-1]) == width else torch.nn.functional.pad(t, (0, width - int(t.shape[-1])))


def microbatch_seconds(samples: list[FlowSample]) -> Optional[list[float]]:
    """The microbatch's seconds per video grid step (one per video, in sample order), or None without videos. A
    microbatch never mixes images and videos (`as_vision_batch`)."""
    seconds = [float(t) for s in samples if s.second_per_grid_ts is not None for t in s.second_per_grid_ts]
    return seconds or None


def cycle_passes(loader: Iterable[Any]) -> Iterator[Any]:
    """Endless passes over `loader`, as MindSpeed-MM's `build_iterations(..., iterator_type="cyclic")` makes them:
    each pass calls `iter(loader)` again, so the sampler starts its next epoch where the samples consumed say."""
    while True:
        yielded = False
        for batch in loader:
            yielded = True
            yield batch
        if not yielded:
            raise FlowDataError("the training data loader yielded no batch in a whole pass (data set smaller than "
                                "one micro-batch, or every sample filtered out?)")


def part_tokens(sample: FlowSample, part: str) -> int:
    """The rows an encoder part produces for a sample: its audio tokens for the audio part, else its vision
    tokens (0: nothing for that part to encode)."""
    return sample.audio_tokens if part == AUDIO else sample.image_tokens


@dataclass(frozen=True)
class SideNeeds:
    """What one rank's side uses of a planned step: encoder ranks the pixels (or, in an audio part, the clips) of
    the samples their replica encodes (`encoder_leader`: the replica's bridge rank, which keys the plan's encode
    order); decoder ranks the token ids of their DP rank's microbatches, and labels on the last pipeline stage."""

    encoder_leader: Optional[int] = None
    decoder_dp: Optional[int] = None
    labels: bool = False
    encoder_part: str = ENCODER
    clip_features: bool = False  # decoder ranks that run the audio encoder (on their first stage) read clips

    def pixels_of(self, step: "FlowStep") -> list[int]:
        if self.encoder_leader is None:
            return []
        return [sid for sid in step.work.encode_order.get(self.encoder_leader, [])
                if part_tokens(step.samples[sid], self.encoder_part) > 0]

    def text_of(self, step: "FlowStep") -> list[int]:
        if self.decoder_dp is None:
            return []
        return [sid for ids in step.microbatches(self.decoder_dp) for sid in ids]


def sample_meta(dataset: Any, collate: Callable[[list], dict], vision_start_id: int, image_token_id: int,
                merge_size: int, i: int) -> SampleMeta:
    """Sample i's index entry, by MindSpeed-MM's own path: its item through the job's collator alone, cut back as a
    loader batch is. Checks that the collator keeps the item's token ids and labels (decoder ranks take them from
    the item, without the collator's pixel path)."""
    item = dataset[i]
    ids = torch.as_tensor(item["input_ids"], dtype=torch.long)
    labels = torch.as_tensor(item["labels"], dtype=torch.long)
    batch = collate([item])
    video = any(batch.get(k) is not None for k in VIDEO_KEYS)
    s = split_batch(batch, i, vision_start_id, image_token_id, merge_size)[0]
    if not (torch.equal(s.input_ids, ids) and torch.equal(s.labels, labels)):
        raise FlowDataError(f"data set sample {i}: MindSpeed-MM's collator changes its token ids or labels, so decoder "
                            "ranks cannot take them from the data set's item; read whole batches with "
                            "MSF_FLOW_DATA_READS=whole")
    return SampleMeta(s.length, s.image_tokens, s.loss_tokens, video, s.image_grid_thw, s.second_per_grid_ts,
                      s.audio_tokens, clip_frames(s.audio_mask, i))


def clip_frames(mask: Optional[torch.Tensor], index: int) -> Optional[torch.Tensor]:
    """[clips, 2]: each clip's real frames and its mask's padded width, from MindSpeed-MM's feature mask (right
    padding: ones, then zeros), or None without clips."""
    if mask is None:
        return None
    frames = mask.sum(dim=1).to(torch.long)
    clips = torch.stack([frames, torch.full_like(frames, int(mask.shape[1]))], dim=1)
    if not torch.equal(mask.to(torch.long), clip_mask(clips)):
        raise FlowDataError(f"data set sample {index}: its audio feature mask is not right-padded; read whole "
                            "batches with MSF_FLOW_DATA_READS=whole")
    return clips


def clip_mask(clips: torch.Tensor) -> torch.Tensor:
    """The feature mask of clips given as [clips, 2] (real frames, padded width): what the collator gave them."""
    width = int(clips[:, 1].max()) if clips.numel() else 1
    return (torch.arange(width).unsqueeze(0) < clips[:, :1]).to(torch.long)


class _ReplicaBatches:
    """Each global batch as the unpatched job's DP ranks take it: replica after replica, each replica's next
    micro-batches from its own (cycled) source: MindSpeed-MM's loader, or its sampler's batches of indices."""

    def __init__(self, sources: list[Iterable[Any]], vision_start_id: int, image_token_id: int,
                 merge_size: int) -> None:
        self.replicas = len(sources)
        self._its = [cycle_passes(source) for source in sources]
        self._ids = (vision_start_id, image_token_id, merge_size)
        self.clip_bytes = 0  # bytes of audio features (log-mel) this rank has read

    def _samples(self, batch: Any, first_id: int, batch_index: int) -> list[FlowSample]:
        raise NotImplementedError

    def global_batch(self, batches_per_replica: int) -> list[FlowSample]:
        samples: list[FlowSample] = []
        index = 0
        for it in self._its:
            for _ in range(batches_per_replica):
                samples += self._samples(next(it), len(samples), index)
                index += 1
        return samples


class WholeBatchReads(_ReplicaBatches):
    """Every rank reads each global batch whole, pixels included, through MindSpeed-MM's loaders (one per decoder
    DP replica): the path of a streaming data set, and of MSF_FLOW_DATA_READS=whole."""

    def _samples(self, batch: Any, first_id: int, batch_index: int) -> list[FlowSample]:
        return split_batch(batch, first_id, *self._ids, batch_index=batch_index)

    def load(self, step: "FlowStep") -> tuple[int, int]:
        """(samples, bytes of pixels) read for this step: all of them, already."""
        self.clip_bytes += sum(s.audio_features.numel() * s.audio_features.element_size()
                               for s in step.samples.values() if s.audio_features is not None)
        return len(step.samples), sum(s.pixel_values.numel() * s.pixel_values.element_size()
                                      for s in step.samples.values() if s.pixel_values is not None)


class IndexedReads(_ReplicaBatches):
    """Global batches as data set indices from MindSpeed-MM's samplers, planned from the metadata index; each rank
    then loads only what its side uses (`SideNeeds`), through MindSpeed-MM's data set item and collator. Taking a
    batch loads nothing."""

    def __init__(self, dataset: Any, collate: Callable[[list], dict], batch_samplers: list[Iterable[list[int]]],
                 index: MetadataIndex, needs: SideNeeds, vision_start_id: int, image_token_id: int,
                 merge_size: int) -> None:
        super().__init__(batch_samplers, vision_start_id, image_token_id, merge_size)
        self.dataset, self.collate, self.index, self.needs = dataset, collate, index, needs

    def _samples(self, indices: list[int], first_id: int, batch_index: int) -> list[FlowSample]:
        batch = []
        metas = [self.index.meta(int(di)) for di in indices]
        if any(m.has_video for m in metas) and any(not m.has_video and m.grid is not None for m in metas):
            # The unpatched job's microbatch would hold both, and its rename drops the images' pixels.
            raise mixed_error(f"data set samples {[int(di) for di in indices]} (one micro-batch)")
        for di, m in zip(indices, metas):
            batch.append(FlowSample(first_id + len(batch), None, None, None, m.grid, m.image_tokens, m.loss_tokens,
                                    batch_index, length=m.length, dataset_index=int(di), second_per_grid_ts=m.seconds,
                                    audio_tokens=m.audio_tokens,
                                    audio_mask=clip_mask(m.clips) if m.clips is not None else None))
        tokens = sum(s.loss_tokens for s in batch)
        for s in batch:
            s.batch_loss_tokens, s.batch_samples = tokens, len(batch)
        return batch

    def load(self, step: "FlowStep") -> tuple[int, int]:
        """Fill in what this rank's side uses of the step; (samples, bytes of pixels) loaded."""
        pixels, text = self.needs.pixels_of(step), self.needs.text_of(step)
        nbytes = 0
        for sid in pixels:
            if self.needs.encoder_part == AUDIO:
                self._load_clips(step.samples[sid], self.dataset[step.samples[sid].dataset_index])
            else:
                nbytes += self._load_pixels(step.samples[sid])
        for sid in text:
            self._load_text(step.samples[sid])
        return len(set(pixels) | set(text)), nbytes

    def _stale(self, s: FlowSample, what: str) -> FlowDataError:
        return FlowDataError(f"data set sample {s.dataset_index}: {what} differs from the metadata index "
                             f"{self.index.path or '(in memory)'} (its data or images changed after the index was "
                             "built): delete that file and start again to rebuild it")

    def _load_pixels(self, s: FlowSample) -> int:
        batch = self.collate([self.dataset[s.dataset_index]])
        try:
            got = split_batch(batch, s.sample_id, *self._ids)[0]
        except ValueError as err:  # its image tokens no longer match its images
            raise self._stale(s, f"what its images give ({err})") from err
        grid = got.image_grid_thw
        if grid is None or s.image_grid_thw is None or not torch.equal(grid, s.image_grid_thw):
            raise self._stale(s, f"its image_grid_thw {None if grid is None else grid.tolist()}")
        s.pixel_values = got.pixel_values
        return s.pixel_values.numel() * s.pixel_values.element_size()

    def _load_text(self, s: FlowSample) -> None:
        item = self.dataset[s.dataset_index]
        s.input_ids = torch.as_tensor(item["input_ids"], dtype=torch.long)
        if int(s.input_ids.numel()) != s.length:
            raise self._stale(s, f"its length {int(s.input_ids.numel())}")
        if self.needs.labels:
            s.labels = torch.as_tensor(item["labels"], dtype=torch.long)
        if item.get("audios") and self.needs.clip_features:
            # The audio encoder runs on the decoder's first stage: it reads the clips' log-mel features. (Omni's
            # rope index reads only each clip's frame count, which the index holds: with an audio part the
            # decoder reads no clip.)
            self._load_clips(s, item)

    def _load_clips(self, s: FlowSample, item: dict) -> None:
        """A sample's log-mel features and frame mask, from MindSpeed-MM's collator (which reads the clips), as
        the unpatched job's are. Without the item's images and videos, so that no rank outside the image
        encoder decodes a frame (the collator stands a blank image in for them)."""
        batch = self.collate([dict(item, images=[], videos=[])])
        features, mask = (batch[k] for k in AUDIO_KEYS)
        if int(features.shape[0]) != len(item.get("audios") or []):
            raise self._stale(s, f"its clips ({int(features.shape[0])} from the collator, "
                                 f"{len(item.get('audios') or [])} in the data set)")
        if s.audio_mask is not None and not torch.equal(mask.to(torch.long), s.audio_mask):
            raise self._stale(s, f"its clips' frames {mask.sum(dim=1).tolist()}")
        s.audio_features, s.audio_mask = features, mask
        self.clip_bytes += features.numel() * features.element_size()


class FlowStepSource:
    """Yields one `FlowStep` per iteration: the unpatched job's global batch (`reads`), planned, with what this
    rank's side uses loaded."""

    def __init__(self, reads: Any, *, global_batch_size: int, micro_batch_size: int, bridges: dict[str, Bridge],
                 token_budget: int, cost_model: CostModel, scheduler: str, min_microbatches: int,
                 oversize_policy: str, merge_size: int, first_step: int = 0, layout: str = LAYOUT_ROWS,
                 pad_multiple: int = 1, flops_model: Optional[CostModel] = None) -> None:
        if global_batch_size % (micro_batch_size * reads.replicas):
            raise FlowDataError(f"--global-batch-size {global_batch_size} is not a multiple of --micro-batch-size "
                                f"{micro_batch_size} x {reads.replicas} decoder DP replicas")
        self.reads = reads
        self.batches_per_replica = global_batch_size // (micro_batch_size * reads.replicas)
        self.bridges = bridges  # encoder part -> its bridge to the decoder's first-stage replicas
        self.token_budget = token_budget
        self.cost_model = cost_model
        self.scheduler = scheduler
        self.min_microbatches = min_microbatches
        self.oversize_policy = oversize_policy
        self.merge_size = merge_size
        self.layout = layout
        self.pad_multiple = pad_multiple
        # What this rank has loaded (samples with any content, bytes of pixels): its exit line.
        self.samples_read = 0
        self.pixel_bytes_read = 0
        # Model FLOPs for the metrics' MFU (the scheduler's `cost_model` may hold profiled seconds instead).
        self.flops_model = flops_model or cost_model
        # The iteration this step is (after a resume: the checkpoint's), so step numbers on the wire and in
        # messages match an uninterrupted run.
        self.step = first_step

    def __iter__(self) -> Iterator[FlowStep]:
        return self

    def __next__(self) -> FlowStep:
        samples = self.reads.global_batch(self.batches_per_replica)
        shapes = [s.shape(self.merge_size) for s in samples]
        by_id = {s.sample_id: s for s in samples}
        # Each encoder part balances its own work: the ViT's by its cost model, the audio encoder's by audio tokens.
        costs = encoder_costs(self.bridges, {sh.sample_id: sh for sh in shapes}.__getitem__, self.cost_model,
                              audio_cost=lambda sid: float(by_id[sid].audio_tokens))
        work = plan_decoupled_step(self.step, shapes, bridges=self.bridges, token_budget=self.token_budget,
                                   cost_model=self.cost_model, scheduler=self.scheduler,
                                   min_microbatches=self.min_microbatches, oversize_policy=self.oversize_policy,
                                   part_costs=costs)
        step = FlowStep(self.step, {s.sample_id: s for s in samples}, work)
        n, nbytes = self.reads.load(step)
        self.samples_read += n
        self.pixel_bytes_read += nbytes
        plan = work.plan
        padded = sum(microbatch_tokens([samples[i].length for i in mb.sample_ids], self.layout, self.pad_multiple)
                     for row in plan.microbatches for mb in row)
        # Model FLOPs actually trained this step (padding excluded, oversize samples skipped), for the metrics' MFU.
        skipped = {sid for sid, _ in plan.oversize}
        trained = [sh for sh in shapes if sh.sample_id not in skipped]
        flops = sum(self.flops_model.sample_cost(sh.llm_tokens) + self.flops_model.encoder_cost(sh) for sh in trained)
        step.counts = StepCounts(samples=len(trained), real_tokens=int(plan.real_tokens), padded_tokens=int(padded),
                                 microbatches=sum(len(row) for row in plan.microbatches),
                                 microbatches_per_rank=int(plan.num_slots), model_flops=float(flops))
        self.step += 1
        return step
