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

Weak on purpose: every rank reads the whole global batch (pixels included) through MindSpeed-MM's dataset; a
metadata index would let decoder ranks skip pixels and encoder ranks skip text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional

import torch

from mindspeed_flow.data.shapes import SampleShape
from mindspeed_flow.hosts.mindspeed_mm.packed import padded_length
from mindspeed_flow.packing import CostModel
from mindspeed_flow.step.plan import StepWork, plan_decoupled_step
from mindspeed_flow.topology import Bridge

IGNORE_INDEX = -100
# Batch keys of the video path (MindSpeed-MM's get_batch renames them to pixel_values / image_grid_thw).
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw")


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
    sample_id: int
    input_ids: torch.Tensor  # [len]
    labels: torch.Tensor  # [len]
    pixel_values: Optional[torch.Tensor]  # [patches, C] or None
    image_grid_thw: Optional[torch.Tensor]  # [images, 3] or None
    image_tokens: int
    loss_tokens: int = 0  # tokens whose (shifted) label counts in the loss
    batch_index: int = 0  # the loader batch (the unpatched job's microbatch) this sample came in
    batch_loss_tokens: int = 0  # loss tokens of that whole loader batch
    batch_samples: int = 1  # samples in that loader batch
    position_ids: Optional[torch.Tensor] = None  # [3, len]: its own rope positions (packed layout; set once)

    def shape(self, merge_size: int) -> SampleShape:
        grids = tuple(tuple(int(v) for v in g) for g in self.image_grid_thw) if self.image_grid_thw is not None \
            else ()
        return SampleShape(self.sample_id, int(self.input_ids.numel()) - self.image_tokens, grids, merge_size)


@dataclass
class FlowStep:
    """One global batch and its plan, as every rank sees it."""

    step: int
    samples: dict[int, FlowSample]
    work: StepWork
    counts: dict[str, float] = field(default_factory=dict)

    def microbatches(self, dp_rank: int) -> list[list[int]]:
        return [mb.sample_ids for mb in self.work.plan.microbatches[dp_rank]]


def split_batch(batch: dict[str, Any], first_id: int, vision_start_id: int, image_token_id: int,
                merge_size: int, batch_index: int = 0) -> list[FlowSample]:
    """Cut a collated MindSpeed-MM batch ([b, s], right padding) back into its samples."""
    videos = [k for k in VIDEO_KEYS if batch.get(k) is not None]
    if videos:
        raise FlowDataError(f"samples {first_id}-{first_id + int(batch['input_ids'].shape[0]) - 1} carry video "
                            f"({', '.join(videos)}): a flow job decouples images only; train video samples with the "
                            "unpatched job (drop --flow-recipe) or remove them from the data set")
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    pixels, grids = batch.get("pixel_values"), batch.get("image_grid_thw")
    out, img_ptr, pix_ptr = [], 0, 0
    for b in range(ids.shape[0]):
        keep = mask[b].bool()
        sample_ids, sample_labels = ids[b][keep].clone(), labels[b][keep].clone()
        n_images = int((sample_ids == vision_start_id).sum())
        grid = pix = None
        if n_images and grids is not None:
            grid = grids[img_ptr:img_ptr + n_images].clone()
            patches = int(grid.prod(dim=1).sum())
            pix = pixels[pix_ptr:pix_ptr + patches].clone()
            img_ptr, pix_ptr = img_ptr + n_images, pix_ptr + patches
        image_tokens = int((sample_ids == image_token_id).sum())
        if grid is not None and image_tokens != int(grid.prod(dim=1).sum()) // (merge_size * merge_size):
            raise ValueError(f"sample {first_id + b}: {image_tokens} image tokens but image_grid_thw "
                             f"{grid.tolist()} gives {int(grid.prod(dim=1).sum()) // merge_size ** 2}")
        loss_tokens = int((sample_labels[1:] != IGNORE_INDEX).sum())
        out.append(FlowSample(first_id + b, sample_ids, sample_labels, pix, grid, image_tokens, loss_tokens,
                              batch_index))
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


def collate_rows(samples: list[FlowSample], pad_id: int = 0, pad_multiple: int = 1) -> dict[str, torch.Tensor]:
    """A decoder microbatch: one row per sample, right-padded to the longest (rounded up to `pad_multiple`),
    padding masked out of the loss. An empty microbatch (the plan gave this DP rank fewer samples than
    microbatches) is one padding row that attends to itself and carries no loss, so every rank still runs the
    schedule's microbatch count."""
    if not samples:
        length = padded_length(1, pad_multiple)
        return {"input_ids": torch.full((1, length), pad_id, dtype=torch.long),
                "labels": torch.full((1, length), IGNORE_INDEX, dtype=torch.long),
                "attention_mask": torch.ones((1, length), dtype=torch.long)}
    length = padded_length(max(int(s.input_ids.numel()) for s in samples), pad_multiple)
    ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(samples), length), dtype=torch.long)
    for i, s in enumerate(samples):
        n = int(s.input_ids.numel())
        ids[i, :n], labels[i, :n], mask[i, :n] = s.input_ids, s.labels, 1
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    grids = [s.image_grid_thw for s in samples if s.image_grid_thw is not None]
    if grids:
        batch["image_grid_thw"] = torch.cat(grids, dim=0)
    return batch


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


class FlowStepSource:
    """Yields one `FlowStep` per iteration from MindSpeed-MM's loaders (one per decoder DP replica)."""

    def __init__(self, loaders: list[Any], *, global_batch_size: int, micro_batch_size: int, bridge: Bridge,
                 token_budget: int, cost_model: CostModel, scheduler: str, min_microbatches: int,
                 oversize_policy: str, vision_start_id: int, image_token_id: int, merge_size: int,
                 first_step: int = 0, layout: str = LAYOUT_ROWS, pad_multiple: int = 1,
                 encoder_flops_scale: float = 1.0) -> None:
        if global_batch_size % (micro_batch_size * len(loaders)):
            raise FlowDataError(f"--global-batch-size {global_batch_size} is not a multiple of --micro-batch-size "
                                f"{micro_batch_size} x {len(loaders)} decoder DP replicas")
        self.loaders = loaders
        self._its = [cycle_passes(loader) for loader in loaders]
        self.batches_per_replica = global_batch_size // (micro_batch_size * len(loaders))
        self.bridge = bridge
        self.token_budget = token_budget
        self.cost_model = cost_model
        self.scheduler = scheduler
        self.min_microbatches = min_microbatches
        self.oversize_policy = oversize_policy
        self.vision_start_id = vision_start_id
        self.image_token_id = image_token_id
        self.merge_size = merge_size
        self.layout = layout
        self.pad_multiple = pad_multiple
        # What this rank has read through MindSpeed-MM's loaders (every rank reads whole global batches today).
        self.samples_read = 0
        self.pixel_bytes_read = 0
        # The cost model's encoder FLOPs are forward + backward; a frozen ViT runs forward only (x 1/3), for MFU.
        self.encoder_flops_scale = encoder_flops_scale
        # The iteration this step is (after a resume: the checkpoint's), so step numbers on the wire and in
        # messages match an uninterrupted run.
        self.step = first_step

    def __iter__(self) -> Iterator[FlowStep]:
        return self

    def __next__(self) -> FlowStep:
        samples: list[FlowSample] = []
        index = 0
        for it in self._its:  # replica after replica, each its next micro-batches: the unpatched job's batches
            for _ in range(self.batches_per_replica):
                batch = split_batch(next(it), len(samples), self.vision_start_id, self.image_token_id,
                                    self.merge_size, batch_index=index)
                samples += batch
                index += 1
        self.samples_read += len(samples)
        self.pixel_bytes_read += sum(s.pixel_values.numel() * s.pixel_values.element_size() for s in samples
                                     if s.pixel_values is not None)
        shapes = [s.shape(self.merge_size) for s in samples]
        work = plan_decoupled_step(self.step, shapes, bridge=self.bridge, token_budget=self.token_budget,
                                   cost_model=self.cost_model, scheduler=self.scheduler,
                                   min_microbatches=self.min_microbatches, oversize_policy=self.oversize_policy)
        step = FlowStep(self.step, {s.sample_id: s for s in samples}, work)
        plan = work.plan
        padded = sum(microbatch_tokens([int(samples[i].input_ids.numel()) for i in mb.sample_ids], self.layout,
                                       self.pad_multiple)
                     for row in plan.microbatches for mb in row)
        # Model FLOPs actually trained this step (padding excluded, oversize samples skipped), for the metrics' MFU.
        skipped = {sid for sid, _ in plan.oversize}
        trained = [sh for sh in shapes if sh.sample_id not in skipped]
        flops = sum(self.cost_model.sample_cost(sh.llm_tokens)
                    + self.encoder_flops_scale * self.cost_model.encoder_cost(sh) for sh in trained)
        step.counts = {"real_tokens": float(plan.real_tokens), "padded_tokens": float(padded),
                       "microbatches_per_rank": float(plan.num_slots), "samples": float(len(trained)),
                       "microbatches": float(sum(len(row) for row in plan.microbatches)), "model_flops": float(flops)}
        self.step += 1
        return step
