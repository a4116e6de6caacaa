"""Image processing and token specs: exact against transformers' Qwen2-VL processor (slow/PIL path)."""
from __future__ import annotations

import importlib
from typing import Callable

import numpy as np
import pytest
import torch

from mindspeed_flow.data.image import (CLIP_MEAN, CLIP_STD, patchify_qwen2, process_pil_llava, process_pil_qwen2,
                                       smart_resize)
from mindspeed_flow.data.sample import TokenSpec
from mindspeed_flow.data.tokens import (LLAVA_DEFAULT_VISION_END_ID, LLAVA_DEFAULT_VISION_START_ID, ByteTokenizer,
                                        build_conversation, template_text_tokens,
                                        token_spec_from_hf_config)
from mindspeed_flow.model_presets import hf_config_dict

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

QWEN_SPEC = TokenSpec(380, 381, 382, 383, 384)


def _hf_slow_qwen2() -> tuple[type, Callable]:
    """transformers' slow (PIL) Qwen2-VL processor and its smart_resize: `*_pil_qwen2_vl` on 5.x, plain on 4.x."""
    try:
        mod = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
        return mod.Qwen2VLImageProcessorPil, mod.smart_resize
    except ImportError:
        mod = pytest.importorskip("transformers.models.qwen2_vl.image_processing_qwen2_vl")
        return mod.Qwen2VLImageProcessor, mod.smart_resize


def _hf_pil_processor(min_pixels: int, max_pixels: int) -> object:
    return _hf_slow_qwen2()[0](min_pixels=min_pixels, max_pixels=max_pixels)


def test_smart_resize_matches_transformers_on_many_sizes() -> None:
    hf_smart_resize = _hf_slow_qwen2()[1]
    rng = np.random.default_rng(0)
    limits = [(4 * 28 * 28, 64 * 28 * 28), (56 * 56, 1280 * 28 * 28), (3136, 12845056)]
    for _ in range(400):
        h, w = (int(x) for x in rng.integers(1, 10000, size=2))
        if max(h, w) / min(h, w) > 200:
            continue
        lo, hi = limits[int(rng.integers(len(limits)))]
        assert smart_resize(h, w, 28, lo, hi) == hf_smart_resize(h, w, factor=28, min_pixels=lo, max_pixels=hi), (h, w)
    # Exact halves: Python's round-half-to-even must be kept (14/28 = 0.5 -> 0 -> clamped by min_pixels).
    assert smart_resize(42, 70, 28, 1, 10**9) == hf_smart_resize(42, 70, factor=28, min_pixels=1, max_pixels=10**9)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2500)
    with pytest.raises(ValueError, match="positive"):
        smart_resize(0, 100)


@pytest.mark.parametrize("size,limits", [
    ((300, 100), (4 * 28 * 28, 64 * 28 * 28)),      # tall, downscaled to the tiny demo's cap
    ((57, 999), (4 * 28 * 28, 64 * 28 * 28)),       # wide, odd sizes
    ((40, 30), (4 * 28 * 28, 64 * 28 * 28)),        # upscaled to min_pixels
    ((1500, 520), (56 * 56, 1280 * 28 * 28)),       # InfoVQA-like at Qwen2-VL's usual cap
])
def test_qwen2_processing_matches_hf_pil_processor(size: tuple[int, int], limits: tuple[int, int]) -> None:
    processor = _hf_pil_processor(*limits)
    rng = np.random.default_rng(sum(size))
    h, w = size
    # Smooth content plus noise: exercises bicubic interpolation, not only noise.
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(yy * 255 // max(h - 1, 1)), (xx * 255 // max(w - 1, 1)), ((yy + xx) % 256)], axis=-1)
    arr = np.clip(base + rng.integers(-40, 40, size=(h, w, 3)), 0, 255).astype(np.uint8)
    img = Image.fromarray(arr)
    ref = processor(images=[img], return_tensors="np")
    pixels, grid = process_pil_qwen2(img, QWEN_SPEC, *limits)
    assert list(grid) == ref["image_grid_thw"][0].tolist()
    assert tuple(pixels.shape) == ref["pixel_values"].shape
    np.testing.assert_allclose(pixels.numpy(), ref["pixel_values"], rtol=0, atol=1e-5)


def test_patchify_layout_from_first_principles() -> None:
    """Independent of transformers: encode (channel, y, x) in the pixel value and check where it lands."""
    p, m, tp = 14, 2, 2
    height, width = 2 * p * m, 3 * p * m  # 4 x 6 patches, 2 x 3 merge windows
    c, y, x = torch.meshgrid(torch.arange(3), torch.arange(height), torch.arange(width), indexing="ij")
    image = (c * 1_000_000 + y * 1000 + x).double()
    pixels, grid = patchify_qwen2(image, p, tp, m)
    assert grid == (1, 4, 6) and tuple(pixels.shape) == (24, 3 * tp * p * p)
    row = pixels.view(24, 3, tp, p, p)

    def patch_origin(r: int) -> tuple[int, int]:
        v = row[r, 0, 0, 0, 0].item()
        return int(v // 1000) % 1000, int(v) % 1000

    # Rows walk merge windows in raster order, and the 2x2 patches of a window are consecutive.
    assert [patch_origin(r) for r in range(6)] == [(0, 0), (0, 14), (14, 0), (14, 14), (0, 28), (0, 42)]
    assert patch_origin(4 * 3) == (28, 0)  # the second row of windows starts after 3 windows of 4 patches
    assert torch.equal(row[:, :, 0], row[:, :, 1])  # a still image is repeated over the temporal patch
    assert row[5, 2, 1, 3, 7].item() == 2_000_000 + 3 * 1000 + 42 + 7  # channel-major, then row, col in a patch
    with pytest.raises(ValueError, match="multiple of patch\\*merge"):
        patchify_qwen2(torch.zeros(3, 30, 28))


def test_patchify_clip_keeps_frames_in_time_order() -> None:
    frames = torch.arange(4, dtype=torch.float64).view(4, 1, 1, 1).expand(4, 3, 28, 28)
    pixels, grid = patchify_qwen2(frames, 14, 2, 2)
    assert grid == (2, 2, 2)
    rows = pixels.view(8, 3, 2, 14, 14)
    assert rows[0, 0, :, 0, 0].tolist() == [0.0, 1.0] and rows[4, 0, :, 0, 0].tolist() == [2.0, 3.0]


def test_llava_processing_normalizes_and_keeps_fixed_grid() -> None:
    spec = token_spec_from_hf_config(hf_config_dict("llava", "tiny"))
    img = Image.new("RGB", (100, 37), color=(255, 0, 128))
    pixels, grid = process_pil_llava(img, spec)
    assert tuple(pixels.shape) == (3, 56, 56) and grid == (1, 4, 4)
    expected = [(v / 255.0 - mu) / sd for v, mu, sd in zip((255, 0, 128), CLIP_MEAN, CLIP_STD)]
    torch.testing.assert_close(pixels.mean(dim=(1, 2)), torch.tensor(expected, dtype=torch.float32))


def test_token_spec_from_tiny_and_real_presets() -> None:
    tiny = token_spec_from_hf_config(hf_config_dict("qwen2_vl", "tiny"))
    assert (tiny.image_token_id, tiny.vision_start_id, tiny.vision_end_id, tiny.eos_id) == (380, 381, 382, 383)
    assert tiny.first_special_id == 380 and tiny.merge_size == 2 and tiny.image_format == "qwen2"
    real = token_spec_from_hf_config(hf_config_dict("qwen2_5_vl", "7b"))
    assert (real.image_token_id, real.vision_start_id, real.vision_end_id) == (151655, 151652, 151653)
    assert real.eos_id == 151645 and real.vocab_size == 152064
    llava = token_spec_from_hf_config(hf_config_dict("llava", "tiny"))
    assert llava.image_format == "llava" and llava.merge_size == 1 and llava.image_size == 56
    assert (llava.vision_start_id, llava.vision_end_id) == (LLAVA_DEFAULT_VISION_START_ID, LLAVA_DEFAULT_VISION_END_ID)


def test_token_spec_reads_older_top_level_layout_and_rejects_bad_configs() -> None:
    old = {"model_type": "qwen2_vl", "image_token_id": 151655, "vision_start_token_id": 151652,
           "vision_end_token_id": 151653, "eos_token_id": [151645, 151643], "vocab_size": 152064,
           "vision_config": {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}}
    assert token_spec_from_hf_config(old).eos_id == 151645
    with pytest.raises(ValueError, match="vision_start_token_id"):
        token_spec_from_hf_config({k: v for k, v in old.items() if k != "vision_start_token_id"})
    with pytest.raises(ValueError, match="vocab_size"):
        token_spec_from_hf_config({k: v for k, v in old.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="model_type='bert'"):
        token_spec_from_hf_config({"model_type": "bert"})
    with pytest.raises(ValueError, match="vision_feature_select_strategy='full'"):
        token_spec_from_hf_config({**hf_config_dict("llava", "tiny"), "vision_feature_select_strategy": "full"})
    with pytest.raises(ValueError, match="distinct"):
        token_spec_from_hf_config({**old, "vision_end_token_id": 151652})


def test_conversation_template_and_byte_tokenizer() -> None:
    tok = ByteTokenizer(QWEN_SPEC.first_special_id)
    assert tok("Hi é") == [72, 105, 32, 195, 169] and all(t < 380 for t in tok("ÿ" * 50))
    assert ByteTokenizer(100)("z") == [ord("z") % 100]
    ids, labels = build_conversation(QWEN_SPEC, [3], [([1, 2], [7]), ([], [8, 9])])
    assert ids.tolist() == [381, 380, 380, 380, 382, 1, 2, 7, 383, 8, 9, 383]
    assert labels.tolist() == [-100] * 7 + [7, 383, 8, 9, 383]
    assert len(ids) == 3 + template_text_tokens(1, [(2, 1), (0, 2)])  # image tokens + the template's text
