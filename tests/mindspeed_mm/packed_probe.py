"""Probe of a packed (THD) microbatch on MindSpeed-MM's own Qwen2.5-VL, run as a job script by
`mindspeed-flow emulate --nproc 1 -- packed_probe.py <pretrain_vlm.py args>` (see test_packed.py).

It runs MindSpeed-MM's `pretrain_vlm.py` unchanged, with its forward step wrapped: at the first microbatch (of
several samples) the probe cuts the loader's padded batch back into samples, packs them into one row the way the
flow decoder does (`hosts.mindspeed_mm.packed`), and runs the whole model (ViT, projector, LLM with MindSpeed's
flash attention in TND layout) on it, then:
- again with one sample's text tokens changed: every other sample's logits must be unchanged (isolation);
- on each sample alone, as an unpadded row: its logits must match its slice of the packed row (same computation).
It prints one `PROBE {json}` line with the figures and lets the job train its iteration.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import torch


class _Holder:
    """Where the probe's packed forward keeps its PackedSeqParams (a flow job keeps them on its FlowContext)."""

    packed_params = None


HOLDER = _Holder()


def _install_packed_wrappers() -> None:
    """The flow patch set's packed wrappers, put in place directly (this probe runs without a flow recipe), reading
    the probe's holder instead of a flow context."""
    from mindspeed_mm.models import vlm_model
    from mindspeed_mm.models.common import mm_gpt_model
    from mindspeed_mm.models.vision.vision_encoders import qwen2vl_vit_model

    from mindspeed_flow.hosts.mindspeed_mm import packed

    packed_of = lambda: HOLDER.packed_params  # noqa: E731
    vlm_model.prepare_positionsids_mask_for_llm = packed.positions_and_mask_wrapper(
        vlm_model.prepare_positionsids_mask_for_llm, packed_of)
    mm_gpt_model.MMGPTModel.forward = packed.decoder_forward_wrapper(mm_gpt_model.MMGPTModel.forward, packed_of)
    qwen2vl_vit_model.apply_multimodal_rotary_pos_emb = packed.multimodal_rope_wrapper(
        qwen2vl_vit_model.apply_multimodal_rotary_pos_emb)


def _probe(batch: dict, model) -> dict:
    from megatron.training import get_args

    from mindspeed_flow.hosts.mindspeed_mm.data import split_batch
    from mindspeed_flow.hosts.mindspeed_mm.packed import pack_samples, packed_forward, rope_positions_fn

    args = get_args()
    cfg = args.mm.model
    vlm = model
    while hasattr(vlm, "module"):
        vlm = vlm.module
    host = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    samples = split_batch(host, 0, int(cfg.vision_start_token_id), int(cfg.img_context_token_id),
                          int(getattr(cfg.image_encoder.vision_encoder, "spatial_merge_size", 2)))
    assert len(samples) >= 3, f"the probe needs a microbatch of >= 3 samples, got {len(samples)}"
    positions = rope_positions_fn(cfg)
    for s in samples:
        s.position_ids = positions(vlm.config, s.input_ids, s.image_grid_thw)
    device = torch.zeros(1).cuda().device

    def logits_of(group, ids_override=None) -> list[torch.Tensor]:
        ids = [ids_override.get(s.sample_id, s.input_ids) if ids_override else s.input_ids for s in group]
        row = pack_samples(ids, [s.labels for s in group], [s.position_ids for s in group])
        feed = {k: v.to(device) for k, v in row.batch.items() if k != "labels"}
        pix = [s.pixel_values for s in group if s.pixel_values is not None]
        if pix:
            feed["pixel_values"] = torch.cat(pix).to(device=device, dtype=args.params_dtype)
            feed["image_grid_thw"] = torch.cat([s.image_grid_thw for s in group
                                                if s.image_grid_thw is not None]).to(device)
        with torch.no_grad(), packed_forward(HOLDER, row.packed_seq_params()):
            out = model(**feed)
        logits = out["logits"][0].float().cpu()
        return list(torch.split(logits, row.segments[:row.samples]))

    base = logits_of(samples)
    # Change sample 1's text tokens (not its image tokens, whose count the grid fixes).
    changed = samples[1].input_ids.clone()
    text = (changed != int(cfg.img_context_token_id)) & (changed != int(cfg.vision_start_token_id))
    text[0] = False
    changed[text] = changed[text].roll(1)  # the sample's own text ids in another order: valid ids, other tokens
    after = logits_of(samples, {samples[1].sample_id: changed})
    others = [i for i in range(len(samples)) if i != 1]
    alone = [logits_of([s])[0] for s in samples]
    return {
        "samples": len(samples), "lengths": [int(s.input_ids.numel()) for s in samples],
        "images": [s.image_tokens for s in samples],
        "other_max_abs_diff": max(float((after[i] - base[i]).abs().max()) for i in others),
        "changed_max_abs_diff": float((after[1] - base[1]).abs().max()),
        "alone_max_abs_diff": max(float((alone[i] - base[i]).abs().max()) for i in range(len(samples))),
        "logit_scale": max(float(b.abs().max()) for b in base),
    }


def main() -> None:
    import mindspeed.megatron_adaptor  # noqa: F401  (MindSpeed's patches first, as in pretrain_vlm.py)
    import mindspeed_mm.training as training

    _install_packed_wrappers()
    original_pretrain = training.pretrain
    done = []

    def probing_pretrain(datasets, model_provider, model_type, forward_step, *a, **k):
        def probing_forward_step(data_iterator, model):
            if not done:
                batch = next(data_iterator)
                report = _probe(dict(batch), model)
                print("PROBE " + json.dumps(report), flush=True)
                done.append(True)
                data_iterator = iter([batch])
            return forward_step(data_iterator, model)

        return original_pretrain(datasets, model_provider, model_type, probing_forward_step, *a, **k)

    training.pretrain = probing_pretrain
    script = Path("pretrain_vlm.py").resolve()  # the emulated job runs in MindSpeed-MM's root
    if not script.is_file():
        script = Path(os.environ["MINDSPEED_MM_HOME"]) / "pretrain_vlm.py"
    sys.argv[0] = str(script)
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
