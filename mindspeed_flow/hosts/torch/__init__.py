"""The torch host: HF transformers VLMs split into an encoder part and a backbone part, run on packed
microbatches, with backbone pipeline parallelism (torch.distributed.pipelining) and data parallelism (DDP or
FSDP2).

Public API of the models (what the trainer, trainer.py, calls):
    build_vlm(family, hf_config, *, seed, dtype, pretrained_path, attn_implementation, parts) -> HF model with
        only `parts` ("encoder", "backbone") materialised, the rest on meta                      (build.py)
    split_vlm(model) -> (EncoderPart, BackbonePart)
    Segments / varlen_attention: packed attention over sequence boundaries, no T x T mask      (attention.py)
    EncoderPart.forward(pixel_values, image_grid_thw) -> [n_image_tokens, H]
    BackbonePart.pack(samples, image_embeds, token_budget) -> PackedBatch
    BackbonePart.embed(packed, image_embeds) / .image_dense(...) / .forward(packed, image_embeds) -> (loss_sum, n)
    build_backbone_stage(backbone, pp_rank, pp_size, pp_group, device, layer_split, wrap) -> (module, stage)
    make_schedule(stage, n_microbatches, loss_fn, kind="1f1b"|"gpipe")
    BackboneStage.feed = (k -> dense image tensor); pipeline_step(schedule, module, packs)     (pipeline.py)
    apply_ddp(module, dp_group) / apply_fsdp(module, dp_group); grad_sync(module, enabled); dp_loss_scale(group)
    allreduce_grads_(params, dp_group); grad_sq_sum(module, *, replicated_over) -> share of ||g||^2
    global_grad_norm(shares, group) -> device scalar; clip_grads_(params, total_norm, max_norm) -> device factor;
    check_finite_norm(norm) -> float  (data_parallel.py)
"""
# transformers' vision models import torchvision: PyPI's torchvision wheel next to a CPU torch (the `emulate`
# extra's environment) must still import, as under `mindspeed-flow emulate`. Before anything imports transformers.
from mindspeed_flow.utils.torchvision_compat import allow_missing_ops

allow_missing_ops()

from mindspeed_flow.hosts.torch.build import build_vlm
from mindspeed_flow.hosts.torch.data_parallel import (allreduce_grads_, apply_ddp, apply_fsdp, clip_grads_,
                                                      check_finite_norm, dp_loss_scale, global_grad_norm, grad_sq_sum,
                                                      grad_sync)
from mindspeed_flow.hosts.torch.packed import PackedBatch
from mindspeed_flow.hosts.torch.pipeline import (BackboneStage, build_backbone_stage, make_schedule, pipeline_step,
                                                 split_layers)
from mindspeed_flow.hosts.torch.split import BackbonePart, EncoderPart, split_vlm, token_loss_sum

__all__ = ["build_vlm", "split_vlm", "EncoderPart", "BackbonePart", "PackedBatch", "token_loss_sum",
           "BackboneStage", "build_backbone_stage", "make_schedule", "pipeline_step", "split_layers", "apply_ddp",
           "apply_fsdp", "grad_sync", "dp_loss_scale",
           "allreduce_grads_", "grad_sq_sum", "global_grad_norm", "clip_grads_", "check_finite_norm"]
