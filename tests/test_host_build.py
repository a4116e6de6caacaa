"""Part-only build: a rank materialises only its part (the rest stays on meta), from a seeded init or from a
local safetensors checkpoint, bit-identical to the whole model's part; an encoder rank's peak memory holds no
backbone parameter."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from mindspeed_flow.bench import build as bench
from mindspeed_flow.hosts.torch.build import build_vlm, part_parameters
from mindspeed_flow.model_presets import hf_config_dict

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "llava"]


def _real(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.device.type != "meta"}


def _check_parts_equal_whole(family: str, **kwargs) -> None:
    whole = _real(build_vlm(family, hf_config_dict(family, "tiny"), seed=0, **kwargs))
    for part in ("encoder", "backbone"):
        model = build_vlm(family, hf_config_dict(family, "tiny"), seed=0, parts=(part,), **kwargs)
        owned = {id(p) for p in part_parameters(model, family)[part]}
        real = _real(model)
        assert real and {id(p) for p in real.values()} == owned  # exactly this part is materialised
        assert all(p.device.type == "meta" for n, p in model.named_parameters() if n not in real)
        for n, p in real.items():
            assert torch.equal(p, whole[n]), (part, n)


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_parts_equal_the_whole_model(family):
    _check_parts_equal_whole(family)
    other = _real(build_vlm(family, hf_config_dict(family, "tiny"), seed=1, parts=("encoder",)))
    assert any(not torch.equal(p, _real(build_vlm(family, hf_config_dict(family, "tiny"), seed=0,
                                                  parts=("encoder",)))[n]) for n, p in other.items())


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_parts_read_only_their_tensors(tmp_path, family):
    source = build_vlm(family, hf_config_dict(family, "tiny"), seed=7)
    source.save_pretrained(tmp_path)
    ref = _real(source)
    for parts in (("encoder",), ("backbone",), ("encoder", "backbone")):
        got = _real(build_vlm(family, {}, seed=0, pretrained_path=str(tmp_path), parts=parts))
        assert got and all(torch.equal(p, ref[n]) for n, p in got.items()), parts
    # bf16: filled in fp32, then cast
    half = _real(build_vlm(family, {}, seed=0, pretrained_path=str(tmp_path), dtype=torch.bfloat16,
                           parts=("encoder",)))
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, ref[n].to(torch.bfloat16)) for n, p in half.items())


def test_missing_checkpoint_tensor_is_named(tmp_path):
    build_vlm("qwen2_vl", hf_config_dict("qwen2_vl", "tiny"), seed=0).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    dropped = next(k for k in tensors if "patch_embed" in k)
    del tensors[dropped]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    # the backbone part does not need the dropped encoder tensor
    build_vlm("qwen2_vl", {}, seed=0, pretrained_path=str(tmp_path), parts=("backbone",))
    with pytest.raises(ValueError, match="patch_embed"):
        build_vlm("qwen2_vl", {}, seed=0, pretrained_path=str(tmp_path), parts=("encoder",))
    with pytest.raises(ValueError, match="parts"):
        build_vlm("qwen2_vl", {}, seed=0, parts=("vision",))


def test_encoder_rank_peak_memory_holds_no_backbone_parameter():
    """Measured in fresh processes from a checkpoint whose backbone is ~96 MiB: the encoder-only build peaks far
    below one backbone copy, the whole build above it (the measurement sees parameters)."""
    args = bench.parse_args(["--text-intermediate", "32768", "--builds", "whole,encoder"])
    report = bench.measure(args)
    backbone = report["part_bytes"]["backbone"]
    enc, whole = report["builds"]["encoder"], report["builds"]["whole"]
    assert enc["materialized_bytes"] == report["part_bytes"]["encoder"]
    assert enc["peak_bytes"] < 0.25 * backbone, (enc, backbone)
    assert whole["peak_bytes"] > backbone, (whole, backbone)
