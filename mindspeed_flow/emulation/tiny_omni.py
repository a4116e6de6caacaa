"""Tiny Qwen2.5-Omni assets for MindSpeed-MM's `pretrain_vlm.py` under emulation: tokenizer, processor, samples with
a video and an audio clip each, and model / data files made from MindSpeed-MM's own Omni example.

MindSpeed-MM's example (`examples/qwen2.5omni/finetune_qwen2_5_omni_7b.sh`) launches `pretrain_vlm.py` with
`model_7b.json` (an image encoder, an `audio_encoder` and the `qwen2_5_omni_thinker` text decoder, encoders frozen)
and `data_7b.json` (the `qwen2_omni` chat template over samples with `videos` and `audios`). This module writes those
two files with the example's keys and tiny widths, next to:

- a tokenizer of Qwen2.5-Omni's real size whose special tokens sit at Qwen2.5-Omni's real ids, because MindSpeed-MM
  hard-codes them (the audio scatter at 151646 in `vlm_model.py`, the rope index's image / video / audio ids);
- transformers' `Qwen2_5OmniProcessor` around it (Qwen2-VL image and video processors, a Whisper feature extractor
  with 16 mel bins and 4-second windows, so a tiny audio encoder reads few frames);
- captioning samples: one tiny MPEG-4 video (as `tiny.write_video_samples`) and one WAV tone per sample, whose
  pitch follows the square's colour (read by MindSpeed-MM with librosa).

    python -m mindspeed_flow.emulation.tiny_omni WORKDIR [--samples 16] [--iters 10]
    # then: mindspeed-flow emulate --nproc 3 --flow-recipe FLOW.yaml -- <the printed job>
    # or, the audio encoder on its own two ranks (three parts):
    # mindspeed-flow emulate --nproc 4 --flow-recipe recipes/mindspeed_mm/tiny_omni_three_parts.yaml -- <the job>
"""
from __future__ import annotations

import argparse
import json
import math
import random
import struct
import wave
from pathlib import Path
from typing import Any, Sequence

from mindspeed_flow.emulation import tiny

EXAMPLE_DIR = "examples/qwen2.5omni"
EXAMPLE_MODEL = f"{EXAMPLE_DIR}/model_7b.json"
EXAMPLE_DATA = f"{EXAMPLE_DIR}/data_7b.json"
# Qwen2.5-Omni's special tokens from <|endoftext|> (151643) on, in id order: the ids MindSpeed-MM's Omni code uses.
OMNI_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
               "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_bos|>", "<|vision_eos|>",
               "<|vision_pad|>", "<|IMAGE|>", "<|VIDEO|>")
FIRST_SPECIAL_ID = 151643
OMNI_IDS = {name: FIRST_SPECIAL_ID + i for i, name in enumerate(OMNI_TOKENS)}
EXTRA_SPECIAL_TOKENS = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
                        "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
                        "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
AUDIO_TOKEN_ID = OMNI_IDS["<|AUDIO|>"]  # 151646, vlm_model.py's audio scatter
# model_7b.json's text_decoder.vocab_size (and the example script's --vocab-size): the tokenizer's 151,657 ids
# padded, as Qwen2.5-Omni-7B pads its embedding.
VOCAB_SIZE = 152064
SAMPLE_RATE = 16000
PITCH_HZ = {color: 220.0 * 2 ** (i / 3) for i, color in enumerate(sorted(tiny.COLORS))}


def build_processor(out_dir: Path) -> Path:
    """The tokenizer (real Omni ids) and transformers' Qwen2_5OmniProcessor in `out_dir`."""
    from mindspeed_flow.utils import torchvision_compat  # lazy: torch

    out_dir.mkdir(parents=True, exist_ok=True)
    tiny.build_tokenizer(out_dir, special_tokens=OMNI_TOKENS, expected_ids=OMNI_IDS,
                         vocab_size=FIRST_SPECIAL_ID + len(OMNI_TOKENS))
    # Qwen2.5-Omni's tokenizer names its multimodal tokens; its processor reads them from the tokenizer.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["extra_special_tokens"] = EXTRA_SPECIAL_TOKENS
    cfg_path.write_text(json.dumps(cfg, indent=2))
    torchvision_compat.install()  # transformers' vision modules import torchvision (CUDA wheel next to CPU torch)
    from transformers import (AutoTokenizer, Qwen2_5OmniProcessor, Qwen2VLImageProcessor,  # lazy: after the fix
                              Qwen2VLVideoProcessor, WhisperFeatureExtractor)

    tokenizer = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    pixels = dict(min_pixels=56 * 56, max_pixels=112 * 112)
    image = Qwen2VLImageProcessor(patch_size=14, temporal_patch_size=2, merge_size=2, **pixels)
    audio = WhisperFeatureExtractor(feature_size=16, chunk_length=4, sampling_rate=SAMPLE_RATE)
    Qwen2_5OmniProcessor(image_processor=image, video_processor=Qwen2VLVideoProcessor(**pixels),
                         feature_extractor=audio, tokenizer=tokenizer).save_pretrained(str(out_dir))
    # The image processor and the feature extractor both save to preprocessor_config.json, the second over the
    # first; Qwen2.5-Omni's checkpoint holds both in that one file, which AutoProcessor reads for each.
    merged = {**image.to_dict(), **audio.to_dict(), "processor_class": "Qwen2_5OmniProcessor"}
    (out_dir / "preprocessor_config.json").write_text(json.dumps(merged, indent=2))
    return out_dir


def _write_tone(path: Path, hz: float, seconds: float) -> None:
    """A mono 16-bit WAV tone (with a short fade so its start and end carry no click)."""
    n = int(SAMPLE_RATE * seconds)
    fade = SAMPLE_RATE // 50
    frames = bytearray()
    for t in range(n):
        envelope = min(1.0, t / fade, (n - 1 - t) / fade)
        frames += struct.pack("<h", int(12000 * envelope * math.sin(2 * math.pi * hz * t / SAMPLE_RATE)))
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE)
        out.writeframes(bytes(frames))


def write_samples(data_dir: Path, n_samples: int, seed: int = 0, videos_per_sample: Sequence[int] = (1,),
                  audios_per_sample: Sequence[int] = (1,), images_per_sample: Sequence[int] = (0,)) -> Path:
    """`n_samples` samples, sample i holding `images_per_sample[i % len]` still images of a square (as
    `tiny.write_samples` draws them), `videos_per_sample[i % len]` videos (a square sliding over a background) and
    `audios_per_sample[i % len]` tones of 0.5-1.5 s whose pitch follows the square's colour (so the audio tokens
    vary in number); returns samples.json."""
    rng = random.Random(seed)
    samples = []
    for i in range(n_samples):
        color, background = rng.sample(sorted(tiny.COLORS), 2)
        direction = rng.choice(("left", "right"))
        images, videos, audios = [], [], []
        for k in range(images_per_sample[i % len(images_per_sample)]):
            images.append(data_dir / "images" / f"{i:04d}_{k}.png")
            images[-1].parent.mkdir(parents=True, exist_ok=True)
            tiny._draw(color, "square", background, tiny.IMAGE_SIZES[(i + k) % len(tiny.IMAGE_SIZES)]).save(images[-1])
        for k in range(videos_per_sample[i % len(videos_per_sample)]):
            videos.append(data_dir / "videos" / f"{i:04d}_{k}.mp4")
            tiny._write_video(videos[-1], color, background, direction)
        for k in range(audios_per_sample[i % len(audios_per_sample)]):
            audios.append(data_dir / "audios" / f"{i:04d}_{k}.wav")
            _write_tone(audios[-1], PITCH_HZ[color], 0.5 + ((i + k) % 3) * 0.5)
        caption = (f"a {color} square on a {background} background" if images
                   else f"a {color} square moving {direction} on a {background} background")
        sample = {"messages": [{"role": "user",
                                "content": "<image>" * len(images) + "<video>" * len(videos) + "<audio>" * len(audios)
                                + ("Describe the image." if images else "Describe the video.")},
                               {"role": "assistant", "content": caption}],
                  "videos": [str(v) for v in videos], "audios": [str(a) for a in audios]}
        if any(images_per_sample):
            sample["images"] = [str(p) for p in images]
        samples.append(sample)
    out = data_dir / "samples.json"
    out.write_text(json.dumps(samples, indent=1))
    return out


def model_json(example: dict[str, Any]) -> dict[str, Any]:
    """model_7b.json with tiny widths; every key, token id, freeze flag and model id kept."""
    model = json.loads(json.dumps(example))
    model["image_encoder"]["vision_encoder"].update(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, intermediate_size=64, llm_hidden_size=64,
        num_attention_heads=2, pipeline_num_layers=[2], window_attn_size=56, fullatt_block_indexes=[1])
    model["image_encoder"]["vision_projector"].update(input_size=32, hidden_size=64, ffn_hidden_size=128)
    model["audio_encoder"]["audio_encoder"].update(
        num_layers=2, hidden_size=32, d_model=32, ffn_hidden_size=64, num_attention_heads=2, num_mel_bins=16,
        output_dim=64, pipeline_num_layers=[2])
    # 4 heads of 16: mrope's sections cover the 8 rotary frequency pairs of a head.
    model["text_decoder"].update(num_layers=2, pipeline_num_layers=[2], hidden_size=64, ffn_hidden_size=128,
                                 num_attention_heads=4, num_query_groups=2, seq_length=256,
                                 max_position_embeddings=4096, mrope_section=[2, 3, 3], vocab_size=VOCAB_SIZE)
    return model


def data_json(example: dict[str, Any], workdir: Path, processor_dir: Path) -> dict[str, Any]:
    """data_7b.json pointing at the tiny processor and samples."""
    data = json.loads(json.dumps(example))
    pre = data["dataset_param"]["preprocess_parameters"]
    pre["model_name_or_path"] = str(processor_dir)
    basic = data["dataset_param"]["basic_parameters"]
    basic.update(dataset_dir=str(workdir / "data"), dataset=str(workdir / "data" / "samples.json"),
                 cache_dir=str(workdir / "data" / "cache_dir"), preprocessing_batch_size=64,
                 preprocessing_num_workers=1)
    data["dataloader_param"]["pin_memory"] = False
    return data


def prepare_omni_workdir(workdir: str | Path, mm_root: Path, n_samples: int = 16,
                         videos_per_sample: Sequence[int] = (1,), audios_per_sample: Sequence[int] = (1,),
                         shuffle: bool = True, images_per_sample: Sequence[int] = (0,)) -> dict[str, Path]:
    """Build (once) the processor and samples under `workdir`, and write fresh model / data files from the
    example's in `mm_root` (MindSpeed-MM's sources). `shuffle`: data_7b.json's dataloader shuffle.

    With images (`images_per_sample`), data_7b.json's `attr.images` names the samples' `images` key and model.json's
    `img_context_token_id` is the image pad, <|IMAGE|>: MindSpeed-MM scatters the ViT's rows at that one id (the
    example points it at <|VIDEO|>), so one data set holds images or videos, not both."""
    if any(images_per_sample) and any(videos_per_sample):
        raise ValueError("images and videos in one Omni data set: MindSpeed-MM's model.json scatters the vision rows "
                         "at one token id (img_context_token_id), the image pad or the video pad")
    workdir = Path(workdir).resolve()
    processor_dir = workdir / "processor"
    if not (processor_dir / "preprocessor_config.json").exists():
        build_processor(processor_dir)
    samples = write_samples(workdir / "data", n_samples, videos_per_sample=videos_per_sample,
                            audios_per_sample=audios_per_sample, images_per_sample=images_per_sample)
    model_path, data_path = workdir / "model_omni.json", workdir / "data_omni.json"
    model = model_json(json.loads((mm_root / EXAMPLE_MODEL).read_text()))
    data = data_json(json.loads((mm_root / EXAMPLE_DATA).read_text()), workdir, processor_dir)
    if any(images_per_sample):
        model["img_context_token_id"] = OMNI_IDS["<|IMAGE|>"]
        data["dataset_param"]["attr"].update(images="images", videos=None)
    model_path.write_text(json.dumps(model, indent=4))
    data["dataloader_param"]["shuffle"] = shuffle
    data_path.write_text(json.dumps(data, indent=4))
    return {"workdir": workdir, "processor": processor_dir, "samples": samples, "model_json": model_path,
            "data_json": data_path}


# The example script's flags that matter to the tiny job: per-token loss, variable lengths, and the distributed
# optimizer its frozen encoders need.
JOB_FLAGS = ("--calculate-per-token-loss", "--variable-seq-lengths", "--use-distributed-optimizer")


def omni_job(paths: dict[str, Path], iters: int, *, more: Sequence[str] = (), **kw: Any) -> Any:
    """The tiny job (`jobs.TinyJob`: its `argv()` follows `mindspeed-flow emulate --`) with `JOB_FLAGS` and `more`;
    `kw` sets any other TinyJob field (checkpoints, micro-batch size...)."""
    from mindspeed_flow.emulation.jobs import TinyJob  # lazy: startup

    return TinyJob(paths["model_json"], paths["data_json"], train_iters=iters, global_batch_size=4, seq_length=256,
                   vocab_size=VOCAB_SIZE, extra=[*JOB_FLAGS, *more], **kw)


def main(argv: list[str] | None = None) -> int:
    import shlex  # lazy: startup

    from mindspeed_flow.emulation.sources import SourceError, find_sources  # lazy: startup

    parser = argparse.ArgumentParser(prog="python -m mindspeed_flow.emulation.tiny_omni", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdir")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    try:
        mm_root = find_sources().mindspeed_mm.root
    except SourceError as err:
        parser.error(str(err))
    paths = prepare_omni_workdir(args.workdir, mm_root, args.samples)
    for key, value in paths.items():
        print(f"{key}: {value}")
    print("job: " + shlex.join(omni_job(paths, args.iters).argv()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
