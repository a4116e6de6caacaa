"""Offline tiny Qwen2.5-VL assets for MindSpeed-MM under emulation: tokenizer, processor, images, samples, configs.

Everything is generated locally in seconds (no hub access): a byte-level BPE tokenizer of exactly 384 ids whose
multimodal special tokens sit at the ids of `mindspeed_flow.model_presets.tiny` (image pad 380, vision start
381, vision end 382, `<|im_end|>` 383), a Qwen2-VL image processor, and a small captioning dataset whose
captions describe what the synthetic image shows (so a loss that falls means the model learns something).

    python -m mindspeed_flow.emulation.tiny WORKDIR [--samples 64] [--vision-pp 2,0 --text-pp 1,1]
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any, Sequence

from mindspeed_flow.model_presets.tiny import EOS_ID, IMAGE_TOKEN_ID, TINY_VOCAB, VISION_END_ID, VISION_START_ID

ASSETS = Path(__file__).resolve().parent / "assets"
# ids TINY_VOCAB-8 .. TINY_VOCAB-1, in this order (the BPE part fills ids 0 .. TINY_VOCAB-9).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|reserved_0|>", "<|video_pad|>", "<|image_pad|>",
                  "<|vision_start|>", "<|vision_end|>", "<|im_end|>")
_EXPECTED_IDS = {"<|image_pad|>": IMAGE_TOKEN_ID, "<|vision_start|>": VISION_START_ID,
                 "<|vision_end|>": VISION_END_ID, "<|im_end|>": EOS_ID}
COLORS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (240, 220, 40),
          "black": (10, 10, 10), "white": (245, 245, 245)}
SHAPES = ("square", "circle", "stripe")
IMAGE_SIZES = ((56, 56), (56, 112), (112, 56))


def _corpus() -> list[str]:
    words = [f"a {c} {s} on a {b} background" for c in COLORS for s in SHAPES for b in COLORS if b != c]
    return words + ["Describe the image.", "What is shown?", "user", "assistant", "system",
                    "You are a helpful assistant.", "\n"] * 20


def build_tokenizer(out_dir: Path, special_tokens: Sequence[str] = SPECIAL_TOKENS,
                    expected_ids: dict[str, int] | None = None, eos_token: str = "<|im_end|>",
                    pad_token: str = "<|endoftext|>", tokenizer_class: str = "Qwen2Tokenizer",
                    vocab_size: int = TINY_VOCAB) -> None:
    """Train a byte-level BPE (padded to `vocab_size` - len(special_tokens) ids) and append the special tokens at
    the top ids, in order (Qwen's 8 by default; another family passes its own and the ids its config names; a
    family whose MindSpeed-MM code hard-codes its real token ids passes its real vocabulary size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # optional: tokenizers
    from transformers import PreTrainedTokenizerFast  # optional: transformers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    n_bpe = vocab_size - len(special_tokens)
    trainer = trainers.BpeTrainer(vocab_size=min(n_bpe, TINY_VOCAB), show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # The tiny corpus supports fewer merges than ids available: fill the gap with unused vocabulary entries (no
    # merge ever produces them) so the special tokens land exactly on their ids.
    state = json.loads(tok.to_str())
    vocab = state["model"]["vocab"]
    trained = len(vocab)
    vocab.update({f"<|unused_{i}|>": trained + i for i in range(n_bpe - trained)})
    tok = Tokenizer.from_str(json.dumps(state))
    tok.add_special_tokens(list(special_tokens))
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tiny tokenizer: {tok.get_vocab_size()} ids, wanted {vocab_size}")
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, pad_token=pad_token,
                                      padding_side="right", model_max_length=4096)
    wrapped.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = tokenizer_class  # so AutoTokenizer/AutoProcessor give the family's classes
    cfg_path.write_text(json.dumps(cfg, indent=2))
    for name, want in (_EXPECTED_IDS if expected_ids is None else expected_ids).items():
        if tok.token_to_id(name) != want:
            raise RuntimeError(f"tiny tokenizer: {name} got id {tok.token_to_id(name)}, expected {want}")


def build_processor(out_dir: Path) -> None:
    """Qwen2.5-VL processor (Qwen2-VL image processor: patch 14, merge 2) around the saved tokenizer."""
    from mindspeed_flow.utils import torchvision_compat  # lazy: torch

    torchvision_compat.install()  # transformers' vision modules import torchvision (CUDA wheel next to CPU torch)
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLImageProcessor  # lazy: after torchvision_compat

    tokenizer = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14,
                                            temporal_patch_size=2, merge_size=2)
    kwargs: dict[str, Any] = {"image_processor": image_processor, "tokenizer": tokenizer}
    try:
        from transformers import Qwen2VLVideoProcessor  # lazy: after torchvision_compat

        kwargs["video_processor"] = Qwen2VLVideoProcessor(min_pixels=56 * 56, max_pixels=112 * 112)
    except (ImportError, AttributeError):  # transformers 5 without torchvision: images only
        pass
    Qwen2_5_VLProcessor(**kwargs).save_pretrained(str(out_dir))
    config = {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
              "image_token_id": IMAGE_TOKEN_ID, "video_token_id": IMAGE_TOKEN_ID - 1,
              "vision_start_token_id": VISION_START_ID, "vision_end_token_id": VISION_END_ID,
              "vocab_size": TINY_VOCAB}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def _draw(color: str, shape: str, background: str, size: tuple[int, int]) -> Any:
    from PIL import Image, ImageDraw  # optional: PIL

    w, h = size
    img = Image.new("RGB", size, COLORS[background])
    draw = ImageDraw.Draw(img)
    box = (w // 4, h // 4, 3 * w // 4, 3 * h // 4)
    if shape == "square":
        draw.rectangle(box, fill=COLORS[color])
    elif shape == "circle":
        draw.ellipse(box, fill=COLORS[color])
    else:
        draw.rectangle((0, h // 3, w, 2 * h // 3), fill=COLORS[color])
    return img


def write_samples(data_dir: Path, n_samples: int, seed: int = 0, images_per_sample: Sequence[int] = (1,),
                  videos_per_sample: Sequence[int] = (0,)) -> Path:
    """`n_samples` sharegpt-style captioning samples with synthetic PNGs, sample i holding
    `images_per_sample[i % len]` of them (the caption describes the first) and `videos_per_sample[i % len]` tiny
    videos (a sliding square, as `write_video_samples`; needs PyAV); returns samples.json."""
    rng = random.Random(seed)
    (data_dir / "images").mkdir(parents=True, exist_ok=True)
    samples = []
    for i in range(n_samples):
        color, background = rng.sample(sorted(COLORS), 2)
        shape = rng.choice(SHAPES)
        paths = []
        for k in range(images_per_sample[i % len(images_per_sample)]):
            path = data_dir / "images" / (f"{i:04d}.png" if k == 0 else f"{i:04d}_{k}.png")
            size = IMAGE_SIZES[(i + k) % len(IMAGE_SIZES)]
            _draw(color, shape, background, size).save(path)
            paths.append(str(path))
        videos = []
        for k in range(videos_per_sample[i % len(videos_per_sample)]):
            path = data_dir / "videos" / f"{i:04d}_{k}.mp4"
            _write_video(path, color, background, "right" if (i + k) % 2 else "left")
            videos.append(str(path))
        sample = {"messages": [{"role": "user",
                                "content": "<image>" * len(paths) + "<video>" * len(videos) + "Describe the image."},
                               {"role": "assistant", "content": f"a {color} {shape} on a {background} background"}],
                  "images": paths}
        if videos:
            sample["videos"] = videos
        samples.append(sample)
    out = data_dir / "samples.json"
    out.write_text(json.dumps(samples, indent=1))
    return out


def write_configs(workdir: Path, vision_pp: list[int] | None = None, text_pp: list[int] | None = None,
                  name: str = "model.json") -> tuple[Path, Path]:
    """model.json (pipeline split overridden when given) and data.json pointing into `workdir`."""
    model = json.loads((ASSETS / "model.json").read_text())
    if vision_pp is not None:
        model["image_encoder"]["vision_encoder"]["pipeline_num_layers"] = list(vision_pp)
    if text_pp is not None:
        model["text_decoder"]["pipeline_num_layers"] = list(text_pp)
    for key, split in (("vision", model["image_encoder"]["vision_encoder"]), ("text", model["text_decoder"])):
        if sum(split["pipeline_num_layers"]) != split["num_layers"]:
            raise ValueError(f"tiny model.json: {key} pipeline_num_layers {split['pipeline_num_layers']} must sum "
                             f"to num_layers={split['num_layers']}")
    model_path = workdir / name
    model_path.write_text(json.dumps(model, indent=2))
    data = (ASSETS / "data.json").read_text()
    data = data.replace("@PROCESSOR_DIR@", str(workdir / "processor")).replace("@DATA_DIR@", str(workdir / "data"))
    data_path = workdir / "data.json"
    data_path.write_text(data)
    return model_path, data_path


def ensure_processor(workdir: Path) -> Path:
    """WORKDIR/processor: the tiny tokenizer and processor, built once."""
    processor_dir = workdir / "processor"
    if not (processor_dir / "preprocessor_config.json").exists():
        processor_dir.mkdir(parents=True, exist_ok=True)
        build_tokenizer(processor_dir)
        build_processor(processor_dir)
    return processor_dir


def prepare_workdir(workdir: str | Path, n_samples: int = 64, vision_pp: list[int] | None = None,
                    text_pp: list[int] | None = None) -> dict[str, Path]:
    """Build (once) the processor and samples under `workdir`, and write fresh model/data configs."""
    workdir = Path(workdir).resolve()
    processor_dir = ensure_processor(workdir)
    samples = workdir / "data" / "samples.json"
    if not samples.exists() or len(json.loads(samples.read_text())) != n_samples:
        write_samples(workdir / "data", n_samples)
    model_path, data_path = write_configs(workdir, vision_pp, text_pp)
    return {"workdir": workdir, "processor": processor_dir, "samples": samples, "model_json": model_path,
            "data_json": data_path}


# The tiny tokenizer's <|video_pad|> (SPECIAL_TOKENS order: one below the image pad).
VIDEO_TOKEN_ID = IMAGE_TOKEN_ID - 1
VIDEO_SIZE, VIDEO_FRAMES, VIDEO_FPS = (56, 56), 4, 2


def _write_video(path: Path, color: str, background: str, direction: str) -> None:
    """One tiny MPEG-4 video: a square sliding `direction` over a background, 4 frames at 2 fps."""
    import av  # optional: PyAV, MindSpeed-MM's video reader
    import numpy as np  # lazy: with av

    path.parent.mkdir(parents=True, exist_ok=True)
    frame = np.array(_draw(color, "square", background, VIDEO_SIZE))
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=VIDEO_FPS)
        stream.width, stream.height, stream.pix_fmt = VIDEO_SIZE[0], VIDEO_SIZE[1], "yuv420p"
        for f in range(VIDEO_FRAMES):
            shifted = np.roll(frame, (6 if direction == "right" else -6) * f, axis=1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(shifted, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():  # flush
            container.mux(packet)


def write_video_samples(data_dir: Path, n_samples: int, seed: int = 0) -> Path:
    """`n_samples` captioning samples with one tiny MPEG-4 video each (a square sliding over a background, 4 frames
    at 2 fps, read by MindSpeed-MM's PyAV path); returns samples.json. Needs PyAV (`av`)."""
    rng = random.Random(seed)
    samples = []
    for i in range(n_samples):
        color, background = rng.sample(sorted(COLORS), 2)
        direction = rng.choice(("left", "right"))
        path = data_dir / "videos" / f"{i:04d}.mp4"
        _write_video(path, color, background, direction)
        samples.append({"messages": [{"role": "user", "content": "<video>Describe the video."},
                                     {"role": "assistant", "content": f"a {color} square moving {direction} on a "
                                                                      f"{background} background"}],
                        "videos": [str(path)]})
    out = data_dir / "samples.json"
    out.write_text(json.dumps(samples, indent=1))
    return out


def prepare_video_workdir(workdir: str | Path, n_samples: int = 16) -> dict[str, Path]:
    """A video data set as MindSpeed-MM's Qwen2.5-VL README sets one up: data.json's `attr.videos` (no images)
    and model.json's `img_context_token_id` at the video pad, where MindSpeed-MM scatters the ViT's rows."""
    workdir = Path(workdir).resolve()
    processor_dir = ensure_processor(workdir)
    samples = write_video_samples(workdir / "data", n_samples)
    model_path, data_path = write_configs(workdir)
    model = json.loads(model_path.read_text())
    model["img_context_token_id"] = VIDEO_TOKEN_ID
    model_path.write_text(json.dumps(model, indent=2))
    data = json.loads(data_path.read_text())
    data["dataset_param"]["attr"].update(images=None, videos="videos")
    data_path.write_text(json.dumps(data, indent=2))
    return {"workdir": workdir, "processor": processor_dir, "samples": samples, "model_json": model_path,
            "data_json": data_path}


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mindspeed_flow.emulation.tiny", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdir")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--vision-pp", type=_int_list, default=None, help="e.g. 2,0")
    parser.add_argument("--text-pp", type=_int_list, default=None, help="e.g. 1,1")
    args = parser.parse_args(argv)
    paths = prepare_workdir(args.workdir, args.samples, args.vision_pp, args.text_pp)
    for key, value in paths.items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
