"""Flow data for a MindSpeed-MM job: the same global batches as the unpatched job, planned by the packing scheduler.

Every rank builds MindSpeed-MM's own dataset and sampler (`build_mm_dataset`, `build_mm_dataloader` from the
job's data.json) with a whole-batch view (one replica), so each iteration yields exactly the samples the coupled
job's DP ranks would have shared. Each sample is cut back to its real tokens, and every rank plans the step from
metadata alone (text length, `image_grid_thw`) with `plan_decoupled_step`: the packing scheduler assigns samples
to (decoder DP rank, microbatch) by LLM cost, and the encoder-side balance gives each encoder replica its images in
the order the decoder consumes them. All ranks compute the same plan, so no rank asks another what to do.

Decoder microbatches keep per-sample boundaries as rows: a microbatch of k samples is a [k, longest] batch with
right padding, its attention mask and -100 labels on padding, which MindSpeed-MM's Qwen2.5-VL path masks
(causal + padding mask, per-row mrope positions). MindSpeed-MM's remove-padding path (`use_remove_padding`) derives
sequence starts from position ids but its Megatron LLM attention only runs the TND varlen kernel when it gets
`packed_seq_params`, which this path never builds, so single-row packing would let samples attend to each other:
rows are the exact choice here.

Weak on purpose: every rank reads the whole global batch (pixels included) through MindSpeed-MM's dataset; a
metadata index would let decoder ranks skip pixels and encoder ranks skip text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

from mindspeed_flow.data.shapes import SampleShape
from mindspeed_flow.packing import CostModel
from mindspeed_flow.runtime.plan import StepWork, plan_decoupled_step
from mindspeed_flow.topology import Bridge

IGNORE_INDEX = -100


class WholeBatchView:
    """What MindSpeed-MM's sampler asks of a process group (`size()`, `rank()`): one replica sees every sample."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


@dataclass
class FlowSample:
    sample_id: int
    input_ids: torch.Tensor  # [len]
    labels: torch.Tensor  # [len]
    pixel_values: Optional[torch.Tensor]  # [patches, C] or None
    image_grid_thw: Optional[torch.Tensor]  # [images, 3] or None
    image_tokens: int

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
                merge_size: int) -> list[FlowSample]:
    """Cut a collated MindSpeed-MM batch ([b, s], right padding) back into its samples."""
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
        out.append(FlowSample(first_id + b, sample_ids, sample_labels, pix, grid, image_tokens))
    return out


def collate_rows(samples: list[FlowSample], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """A decoder microbatch: one row per sample, right-padded to the longest, padding masked out of the loss."""
    length = max(int(s.input_ids.numel()) for s in samples)
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


class FlowStepSource:
    """Yields one `FlowStep` per iteration from MindSpeed-MM's loader over the whole global batch."""

    def __init__(self, loader: Any, *, global_batch_size: int, micro_batch_size: int, bridge: Bridge,
                 token_budget: int, cost_model: CostModel, scheduler: str, min_microbatches: int,
                 oversize_policy: str, vision_start_id: int, image_token_id: int, merge_size: int) -> None:
        self.loader = loader
        self._it = iter(loader)
        self.batches_per_step = global_batch_size // micro_batch_size
        self.bridge = bridge
        self.token_budget = token_budget
        self.cost_model = cost_model
        self.scheduler = scheduler
        self.min_microbatches = min_microbatches
        self.oversize_policy = oversize_policy
        self.vision_start_id = vision_start_id
        self.image_token_id = image_token_id
        self.merge_size = merge_size
        self.step = 0

    def __iter__(self) -> Iterator[FlowStep]:
        return self

    def __next__(self) -> FlowStep:
        samples: list[FlowSample] = []
        for _ in range(self.batches_per_step):
            batch = next(self._it)
            samples += split_batch(batch, len(samples), self.vision_start_id, self.image_token_id, self.merge_size)
        shapes = [s.shape(self.merge_size) for s in samples]
        work = plan_decoupled_step(self.step, shapes, bridge=self.bridge, token_budget=self.token_budget,
                                   cost_model=self.cost_model, scheduler=self.scheduler,
                                   min_microbatches=self.min_microbatches, oversize_policy=self.oversize_policy)
        step = FlowStep(self.step, {s.sample_id: s for s in samples}, work)
        plan = work.plan
        padded = sum(len(mb.sample_ids) * max((samples[i].input_ids.numel() for i in mb.sample_ids), default=0)
                     for row in plan.microbatches for mb in row)
        step.counts = {"real_tokens": float(plan.real_tokens), "padded_tokens": float(padded),
                       "microbatches_per_rank": float(plan.num_slots)}
        self.step += 1
        return step
