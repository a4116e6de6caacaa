"""Image processing in each family's pixel format: Qwen2-VL dynamic resolution and LLaVA fixed-size images.

Qwen2-VL (matches transformers' Qwen2VLImageProcessor, slow/PIL path, to float tolerance):
  1. `smart_resize`: each side to a multiple of patch*merge (28), the pixel count clamped to [min, max],
     keeping the aspect ratio; bicubic resize of the uint8 RGB image;
  2. rescale to [0, 1] and normalize with the CLIP mean/std;
  3. `patchify_qwen2`: a single frame is repeated temporal_patch_size times, and patches are emitted
     merge-window by merge-window (the 2x2 patches one merged LLM token covers are consecutive rows), each row
     laid out as [channel, time, patch_row, patch_col].
LLaVA: resize to image_size x image_size, normalize; [n, 3, S, S] and grid (1, S/p, S/p) (CLS dropped).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from mindspeed_flow.data.sample import TokenSpec

if TYPE_CHECKING:  # PIL is imported lazily: the synthetic path never needs it
    from PIL.Image import Image as PILImage

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200.0


def smart_resize_many(height: np.ndarray, width: np.ndarray, min_pixels: int, max_pixels: int,
                      factor: int = 28) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2-VL's target sizes, vectorised (a million samples' shapes at once): both sides multiples of
    `factor`, h*w within [min_pixels, max_pixels]. The one implementation of the rule; `smart_resize` is its
    checked scalar form."""
    h = np.asarray(height, dtype=np.float64)
    w = np.asarray(width, dtype=np.float64)
    # np.round is half to even, as Python's round() the reference processor uses
    hb, wb = np.round(h / factor) * factor, np.round(w / factor) * factor
    too_big = hb * wb > max_pixels
    too_small = ~too_big & (hb * wb < min_pixels)
    shrink = np.sqrt(h * w / max_pixels)
    grow = np.sqrt(min_pixels / (h * w))
    hb = np.where(too_big, np.maximum(factor, np.floor(h / shrink / factor) * factor), hb)
    wb = np.where(too_big, np.maximum(factor, np.floor(w / shrink / factor) * factor), wb)
    hb = np.where(too_small, np.ceil(h * grow / factor) * factor, hb)
    wb = np.where(too_small, np.ceil(w * grow / factor) * factor, wb)
    return hb.astype(np.int64), wb.astype(np.int64)


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """Qwen2-VL's target size of one image (see `smart_resize_many`), with its size checks."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image {height}x{width}: aspect ratio above {MAX_ASPECT_RATIO:.0f} is not supported")
    hb, wb = smart_resize_many(np.array([height]), np.array([width]), min_pixels, max_pixels, factor)
    return int(hb[0]), int(wb[0])


def qwen2_grid(height: int, width: int, spec: TokenSpec, min_pixels: int, max_pixels: int) -> tuple[int, int, int]:
    """The (t, h, w) ViT patch grid an image of this original size gets, without touching pixels."""
    factor = spec.patch_size * spec.merge_size
    h, w = smart_resize(height, width, factor, min_pixels, max_pixels)
    return 1, h // spec.patch_size, w // spec.patch_size


def llava_grid(spec: TokenSpec) -> tuple[int, int, int]:
    side = spec.image_size // spec.patch_size
    return 1, side, side


def normalize(image01: torch.Tensor, mean: tuple[float, ...] = CLIP_MEAN,
              std: tuple[float, ...] = CLIP_STD) -> torch.Tensor:
    """[..., 3, H, W] values in [0, 1] -> (x - mean) / std per channel."""
    m = torch.tensor(mean, dtype=image01.dtype).view(-1, 1, 1)
    s = torch.tensor(std, dtype=image01.dtype).view(-1, 1, 1)
    return (image01 - m) / s


def patchify_qwen2(image: torch.Tensor, patch_size: int = 14, temporal_patch_size: int = 2,
                   merge_size: int = 2) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Normalized image [3, H, W] (or frames [T, 3, H, W]) -> (pixel_values [t*h*w, 3*tp*p*p], grid (t, h, w))."""
    frames = image.unsqueeze(0) if image.dim() == 3 else image
    if frames.dim() != 4:
        raise ValueError(f"patchify_qwen2 expects [3, H, W] or [T, 3, H, W], got shape {tuple(image.shape)}")
    n_frames, channels, height, width = frames.shape
    factor = patch_size * merge_size
    if height % factor or width % factor:
        raise ValueError(f"image {height}x{width} is not a multiple of patch*merge={factor}; smart_resize it first")
    if n_frames % temporal_patch_size:
        # A still image (or a clip whose length is not a multiple) repeats its last frame, as the reference does.
        pad = temporal_patch_size - n_frames % temporal_patch_size
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)], dim=0)
    grid_t = frames.shape[0] // temporal_patch_size
    grid_h, grid_w = height // patch_size, width // patch_size
    x = frames.reshape(grid_t, temporal_patch_size, channels,
                       grid_h // merge_size, merge_size, patch_size,
                       grid_w // merge_size, merge_size, patch_size)
    # -> (t, h_blocks, w_blocks, h_in_block, w_in_block, channel, time, patch_row, patch_col)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    flat = x.reshape(grid_t * grid_h * grid_w, channels * temporal_patch_size * patch_size * patch_size)
    return flat.contiguous(), (grid_t, grid_h, grid_w)


def _pil_to_unit_tensor(img: "PILImage") -> torch.Tensor:
    """PIL RGB image -> float32 [3, H, W] in [0, 1]."""
    arr = np.asarray(img, dtype=np.uint8)
    return torch.from_numpy(arr.astype(np.float32) / np.float32(255.0)).permute(2, 0, 1).contiguous()


def process_pil_qwen2(img: "PILImage", spec: TokenSpec, min_pixels: int,
                      max_pixels: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A decoded PIL image -> Qwen2-VL (pixel_values, grid): smart resize, rescale, normalize, patchify."""
    from PIL import Image  # optional: PIL

    rgb = img.convert("RGB")
    factor = spec.patch_size * spec.merge_size
    h, w = smart_resize(rgb.height, rgb.width, factor, min_pixels, max_pixels)
    resized = rgb.resize((w, h), resample=Image.Resampling.BICUBIC)
    return patchify_qwen2(normalize(_pil_to_unit_tensor(resized)), spec.patch_size, spec.temporal_patch_size,
                          spec.merge_size)


def process_pil_llava(img: "PILImage", spec: TokenSpec) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A decoded PIL image -> LLaVA ([3, S, S] normalized, grid (1, S/p, S/p))."""
    from PIL import Image  # optional: PIL

    rgb = img.convert("RGB")
    side = spec.image_size
    resized = rgb.resize((side, side), resample=Image.Resampling.BICUBIC)
    return normalize(_pil_to_unit_tensor(resized)), llava_grid(spec)


def stack_pixels(spec: TokenSpec, per_image: list[torch.Tensor]) -> torch.Tensor | None:
    """Combine per-image pixels into the family format: qwen2 concatenates rows, llava stacks [n, 3, S, S]."""
    if not per_image:
        return None
    return torch.cat(per_image, dim=0) if spec.image_format == "qwen2" else torch.stack(per_image, dim=0)
