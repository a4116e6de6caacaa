"""Tiny Qwen3-VL / Qwen3-VL-MoE assets for MindSpeed-MM's FSDP2 trainer under emulation.

`mindspeed_mm/fsdp/train/trainer.py CONFIG.yaml` loads a HuggingFace model directory (tokenizer, processor,
config.json; no weights: `init_model_with_meta_device` initialises them) and a sharegpt-style dataset. This module
writes both, sized to train in seconds per iteration on CPU, and a CONFIG.yaml made from MindSpeed-MM's own example
(`examples/qwen3vl/qwen3vl_30B_config_v1.yaml`, read from the source tree at run time) by substituting values in
place, so its keys, anchors and comments stay MindSpeed-MM's.

    python -m mindspeed_flow.emulation.tiny_qwen3vl WORKDIR [--dense] [--ep 2] [--iters 10]

Needs transformers 4.57 (MindSpeed-MM's pin, with the Qwen3-VL classes) and the `emulate` extra.
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from mindspeed_flow.emulation import tiny
from mindspeed_flow.model_presets import hf_config_dict
from mindspeed_flow.model_presets.tiny import TINY_VOCAB

EXAMPLE_YAML = "examples/qwen3vl/qwen3vl_30B_config_v1.yaml"

# The model is the torch host's tiny preset (`mindspeed_flow.model_presets.tiny`): a 3-block ViT (patch 16) whose
# blocks 0 and 1 feed deepstack maps, a 4-layer interleaved-mrope LLM (hidden 64, head_dim 16); MoE: 4 experts,
# top 2, every layer sparse, so expert parallelism over 2 ranks puts two experts on each.
_FAMILY = {True: ("qwen3_vl_moe", "Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
           False: ("qwen3_vl", "Qwen3VLConfig", "Qwen3VLForConditionalGeneration")}


def build_hf_dir(out_dir: Path, moe: bool = True, pad_token: bool = True) -> Path:
    """Tokenizer, Qwen3VLProcessor and config.json of a tiny Qwen3-VL(-MoE) in `out_dir` (no weights).

    `pad_token=False` leaves `pad_token_id` out of the text config, for `pretrain_transformers.py`: with one,
    transformers' weight init zeroes the padding row (`weight.data[padding_idx].zero_()`), which DTensor on torch
    2.7 has no sharding rule for (aten.select.int), so MindSpeed-MM's meta-device init under torch FSDP2 stops
    before training (measured; the device would fail the same way)."""
    from mindspeed_flow.utils import torchvision_compat  # lazy: torch

    torchvision_compat.install()  # transformers' Qwen3-VL processors import torchvision (a CUDA wheel)
    from transformers import AutoTokenizer, Qwen2VLImageProcessorFast, Qwen3VLProcessor  # lazy: after the fix
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    out_dir.mkdir(parents=True, exist_ok=True)
    tiny.build_tokenizer(out_dir)
    tok = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    # Images of 56-112 px: a few 16-px patches each, merged 2x2 into one or two LLM tokens per row.
    image = Qwen2VLImageProcessorFast(min_pixels=64 * 64, max_pixels=128 * 128, patch_size=16,
                                      temporal_patch_size=2, merge_size=2)
    video = Qwen3VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2)
    Qwen3VLProcessor(image_processor=image, tokenizer=tok, video_processor=video).save_pretrained(str(out_dir))
    family, config_class, architecture = _FAMILY[moe]
    import transformers  # lazy: transformers 4.57

    config_dict = copy.deepcopy(hf_config_dict(family, "tiny"))
    if not pad_token:
        config_dict["text_config"].pop("pad_token_id", None)
    config = getattr(transformers, config_class).from_dict(config_dict)
    config.architectures = [architecture]
    config.save_pretrained(str(out_dir))
    return out_dir


def write_weights(hf_dir: Path, moe: bool = True, seed: int = 1234) -> Path:
    """model.safetensors of the tiny model in `hf_dir`, initialised by transformers from `seed`: what a user
    fine-tunes from (`training.load`), so that jobs on different layouts start from the same weights."""
    import torch  # lazy: torch
    import transformers  # lazy: transformers 4.57

    _, config_class, architecture = _FAMILY[moe]
    config = getattr(transformers, config_class).from_pretrained(str(hf_dir))
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config)
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    return hf_dir / "model.safetensors"


@dataclass
class YamlEdits:
    """What `write_config` changes in MindSpeed-MM's example, and why (each is what a user on CPU would do)."""

    hf_dir: Path
    data_dir: Path
    cache_dir: Path
    train_iters: int = 10
    expert_parallel_size: int = 1
    # The example's 1e-5 is a fine-tuning rate for trained weights; randomly initialised tiny weights need more for
    # the loss to fall visibly within 10 iterations.
    lr: float = 1e-3
    # fp32 so that the later decoupled run can be compared with this one at fp32 tolerances (bf16 on CPU is also
    # several times slower). Not a CPU limitation.
    param_dtype: str = "fp32"
    # None keeps the example's flash_attention_2: with NON_MEGATRON=true MindSpeed-MM registers its own
    # flash_attention_2 (fsdp/ops/flash_attn/flash_attn.py) on torch_npu.npu_fusion_attention, which the emulator
    # has; "eager" or "sdpa" take transformers' plain paths (same losses on the tiny job).
    attn_implementation: str | None = None
    # MindSpeed-MM selects range(max_samples) (qwen2vl_dataset.py), which fails on a dataset smaller than that.
    max_samples: int = 32
    # The example freezes the vision tower (`model.freeze: [model.visual]`, fine-tuning the LLM only); False trains
    # it too, so that a decoupled run's gradients also cross back to the encoder ranks.
    freeze_vision: bool = True
    # Start from the HF weights in hf_dir (`training.load`, HF format: weights only) instead of a random init.
    load_weights: bool = False
    # Checkpoints (DCP): `training.save` every `save_interval` iterations; `resume_from` loads a saved run
    # (`training.load` at its save directory, with optimizer and RNG state: how MindSpeed-MM resumes).
    save_dir: Path | None = None
    save_interval: int = 10000
    resume_from: Path | None = None
    # `training.save_async: true` (not in the example: MindSpeed-MM's default is false), added after save_interval.
    save_async: bool = False
    # None keeps the example's values (no clipping, no router auxiliary loss); a job that sets them checks that
    # clipping uses the one gradient norm over all ranks and that the auxiliary loss is counted once.
    clip_grad: float | None = None
    router_aux_loss_coef: float | None = None
    gradient_accumulation_steps: int = 1
    # The data set's samples hold videos too: the example's commented `# videos: null` becomes `videos: videos`.
    videos: bool = False


def _substitute(text: str, key: str, value: str, count: int = 1, source: str = EXAMPLE_YAML) -> str:
    """Replace the value of `key:` (keeping indentation, a YAML anchor and a trailing comment) `count` times.

    Lines whose value is an alias (`*NAME`) are left alone: they follow their anchor."""
    pattern = re.compile(rf"^(?P<lead>[ \t]*{re.escape(key)}:(?![ \t]*\*)[ \t]*)"
                         rf"(?P<anchor>&\S+[ \t]+)?(?P<value>[^#\n]*?)"
                         rf"(?P<trail>[ \t]*(?:#.*)?)$", re.MULTILINE)
    found = len(pattern.findall(text))
    if found != count:
        # MindSpeed-MM changed its example: fail loudly rather than train another configuration.
        raise ValueError(f"{source}: expected {count} line(s) '{key}:', found {found}")
    return pattern.sub(lambda m: f"{m['lead']}{m['anchor'] or ''}{value}{m['trail']}", text)


def _uncomment(text: str, key: str, *lines: str) -> str:
    """Replace the example's commented `# KEY: KEY_path` line by `lines` (same indentation)."""
    commented = re.compile(rf"^(?P<lead>[ \t]*)# {key}: {key}_path[ \t]*$", re.MULTILINE)
    if len(commented.findall(text)) != 1:
        raise ValueError(f"{EXAMPLE_YAML}: expected one '# {key}: {key}_path' line")
    return commented.sub(lambda m: "\n".join(m["lead"] + line for line in lines), text)


def config_text(example: str, edits: YamlEdits) -> str:
    """MindSpeed-MM's example YAML text with the tiny job's values substituted (keys and layout unchanged)."""
    subs: list[tuple[str, str, int]] = [
        ("param_dtype", edits.param_dtype, 1),
        ("expert_parallel_size", str(edits.expert_parallel_size), 1),
        ("model_name_or_path", str(edits.hf_dir), 1),  # the data side's anchor; the model side aliases it
        ("dataset_dir", f"{edits.data_dir}/", 1),
        ("dataset", str(edits.data_dir / "samples.json"), 1),
        ("cache_dir", f"{edits.cache_dir}/", 1),
        ("max_samples", str(edits.max_samples), 1),
        # A laptop's few cores: no worker processes for preprocessing or loading.
        ("preprocessing_num_workers", "1", 1),
        ("num_workers", "0", 1),
        # Pinned host memory only helps copies to an accelerator; the emulated NPU's memory is host memory.
        ("pin_memory", "false", 1),
        ("train_iters", str(edits.train_iters), 1),
        ("lr", f"{edits.lr:.1e}", 1),
        ("gradient_accumulation_steps", str(edits.gradient_accumulation_steps), 1),
    ]
    if edits.attn_implementation is not None:
        subs.append(("attn_implementation", edits.attn_implementation, 1))
    if edits.clip_grad is not None:
        subs.append(("clip_grad", str(edits.clip_grad), 1))
    if edits.router_aux_loss_coef is not None:
        subs.append(("router_aux_loss_coef", str(edits.router_aux_loss_coef), 1))
    for key, value, count in subs:
        example = _substitute(example, key, value, count)
    example = _substitute(example, "save_interval", str(edits.save_interval))
    if edits.save_async:
        example = re.sub(r"^(?P<lead>[ \t]*)(?P<line>save_interval:.*)$",
                         lambda m: f"{m['lead']}{m['line']}\n{m['lead']}save_async: true", example, count=1,
                         flags=re.MULTILINE)
    if edits.resume_from is not None:
        example = _uncomment(example, "load", f"load: {edits.resume_from}")
    elif edits.load_weights:
        example = _uncomment(example, "load", f"load: {edits.hf_dir}", "no_load_optim: true", "no_load_rng: true")
    if edits.save_dir is not None:
        example = _uncomment(example, "save", f"save: {edits.save_dir}")
    if edits.videos:
        commented = re.compile(r"^(?P<lead>[ \t]*)# videos: null[ \t]*$", re.MULTILINE)
        if len(commented.findall(example)) != 1:
            raise ValueError(f"{EXAMPLE_YAML}: expected one '# videos: null' line")
        example = commented.sub(lambda m: f"{m['lead']}videos: videos", example)
    if not edits.freeze_vision:
        frozen = re.compile(r"^(?P<lead>[ \t]*)freeze:[ \t]*\n[ \t]*- model\.visual[ \t]*\n", re.MULTILINE)
        if len(frozen.findall(example)) != 1:
            raise ValueError(f"{EXAMPLE_YAML}: expected one 'freeze:' list holding model.visual")
        example = frozen.sub(lambda m: f"{m['lead']}freeze: []\n", example)
    return example


def write_config(mm_root: Path, out: Path, edits: YamlEdits) -> Path:
    """Write the FSDP2 trainer's CONFIG.yaml for the tiny job, from MindSpeed-MM's example under `mm_root`."""
    example = (mm_root / EXAMPLE_YAML).read_text(encoding="utf-8")
    out.write_text(config_text(example, edits), encoding="utf-8")
    return out


# ---------------------------------------------------------------- pretrain_transformers.py (Megatron loop, FSDP2)
SFT_EXAMPLE_YAML = "examples/qwen3vl/qwen3vl_full_sft_8B.yaml"
# The MoE example (Qwen3-VL-30B-A3B) differs from the dense one in model_id, global batch and the Megatron check
# values only; the experts stay inside each FSDP shard (its fsdp2 config: "only support expert_parallel_size = 1").
SFT_MOE_EXAMPLE_YAML = "examples/qwen3vl/qwen3vl_full_sft_30B.yaml"


@dataclass
class SftEdits:
    """What `sft_config_text` changes in MindSpeed-MM's `qwen3vl_full_sft_8B.yaml` / `_30B.yaml`
    (`pretrain_transformers.py CONFIG.yaml`, its Qwen3-VL-8B and 30B-A3B full fine-tuning examples). Everything else stays the example's: the vision tower
    and projector frozen, the fsdp2 config it names (bf16 parameters, fp32 reductions), lr 1e-5 with cosine decay,
    no clipping, no optimizer or RNG state saved or loaded, `bridge_patch` loading the HF weights."""

    hf_dir: Path
    data_dir: Path
    cache_dir: Path
    save_dir: Path
    train_iters: int = 10
    # The examples' 8 (16) is one (two) sample(s) per rank on 8 NPUs; 2 is one per rank on 2, two steps on one.
    global_batch_size: int = 2
    max_samples: int = 32
    # A user's variations on the example: the vision tower and its projector trained (the example freezes both, and
    # then runs the whole tower under no_grad), gradient clipping (the example's 0.0 is none).
    train_vision: bool = False
    clip_grad: float = 0.0
    # `load`: the HF folder (the bridge loads its weights), or a job's save folder to continue from.
    load_dir: Optional[Path] = None
    # The samples hold videos too: the example's `videos: null` becomes `videos: videos`.
    videos: bool = False


def _train_vision(example: str, source: str) -> str:
    """`freeze: false` for the vision encoder and the projector (the two `freeze:` lines under image_encoder)."""
    model_at = example.index("\nmodel:")
    image_at = example.index("image_encoder:", model_at)
    text_at = example.index("text_decoder:", image_at)
    block, n = re.subn(r"(?m)^([ \t]*freeze:[ \t]*)true\b", r"\1false", example[image_at:text_at])
    if n != 2:
        raise ValueError(f"{source}: expected two 'freeze: true' lines under image_encoder, found {n}")
    return example[:image_at] + block + example[text_at:]


def sft_config_text(example: str, edits: SftEdits, source: str = SFT_EXAMPLE_YAML) -> str:
    """The example's YAML text with the tiny job's values (keys, anchors and comments unchanged)."""
    subs = [
        ("HF_MODEL_LOAD_PATH", str(edits.hf_dir)),
        # The example loads a converted checkpoint; MindSpeed-MM's bridge patch loads an HF folder just as well
        # (`load` holding safetensors), which is how a user fine-tunes from released weights without converting.
        ("MM_MODEL_LOAD_PATH", str(edits.load_dir or edits.hf_dir)),
        ("DATASET_PATH", str(edits.data_dir / "samples.json")),
        ("SAVE_PATH", str(edits.save_dir)),
        ("global_batch_size", str(edits.global_batch_size)),
        ("train_iters", str(edits.train_iters)),
        ("vocab_size", str(TINY_VOCAB)),
        ("dataset_dir", f"{edits.data_dir}/"),
        ("cache_dir", f"{edits.cache_dir}/"),
        ("max_samples", str(edits.max_samples)),
        # A laptop's few cores: no worker processes for preprocessing or loading.
        ("preprocessing_num_workers", "1"),
        ("num_workers", "0"),
        # Pinned host memory only helps copies to an accelerator; the emulated NPU's memory is host memory.
        ("pin_memory", "false"),
        ("clip_grad", str(edits.clip_grad)),
    ]
    if edits.videos:
        subs.append(("videos", "videos"))
    for key, value in subs:
        example = _substitute(example, key, value, 1, source=source)
    return _train_vision(example, source) if edits.train_vision else example


def prepare_sft_workdir(workdir: str | Path, mm_root: Path, *, moe: bool = False, n_samples: int = 14,
                        images_per_sample: tuple[int, ...] = (1,), videos_per_sample: tuple[int, ...] = (0,),
                        config_name: str = "sft.yaml", **edit_kwargs: Any) -> dict[str, Path]:
    """HF dir (tiny Qwen3-VL, dense or MoE, with seeded weights and no text pad token), samples (sample i with
    `images_per_sample[i % len]` images and `videos_per_sample[i % len]` videos) and a fresh CONFIG.yaml for
    `pretrain_transformers.py`, from MindSpeed-MM's `qwen3vl_full_sft_8B.yaml` (dense) or `qwen3vl_full_sft_30B.yaml`
    (MoE) under `mm_root`."""
    workdir = Path(workdir).resolve()
    hf_dir = workdir / ("hf_sft_moe" if moe else "hf_sft")
    if not (hf_dir / "config.json").exists():
        build_hf_dir(hf_dir, moe=moe, pad_token=False)
    if not (hf_dir / "model.safetensors").exists():
        write_weights(hf_dir, moe=moe)
    videos = any(videos_per_sample)
    data_dir = workdir / ("data_sft_" + "".join(map(str, images_per_sample)) +
                          ("_v" + "".join(map(str, videos_per_sample)) if videos else ""))
    samples = data_dir / "samples.json"
    if not samples.exists() or len(json.loads(samples.read_text())) != n_samples:
        tiny.write_samples(data_dir, n_samples, images_per_sample=images_per_sample,
                           videos_per_sample=videos_per_sample)
    edits = SftEdits(hf_dir=hf_dir, data_dir=data_dir, cache_dir=workdir / data_dir.name.replace("data", "cache", 1),
                     max_samples=n_samples, videos=videos, **edit_kwargs)
    source = SFT_MOE_EXAMPLE_YAML if moe else SFT_EXAMPLE_YAML
    example = (mm_root / source).read_text(encoding="utf-8")
    config = workdir / config_name
    config.write_text(sft_config_text(example, edits, source), encoding="utf-8")
    return {"workdir": workdir, "hf_dir": hf_dir, "samples": samples, "config": config}


def prepare_workdir(workdir: str | Path, mm_root: Path, *, moe: bool = True, n_samples: int = 32,
                    config_name: str = "config.yaml", images_per_sample: tuple[int, ...] = (1,),
                    videos_per_sample: tuple[int, ...] = (0,), **edit_kwargs: Any) -> dict[str, Path]:
    """Build (once) the HF dir and the samples under `workdir`; write a fresh `config_name` there. Samples hold
    `images_per_sample[i % len]` images and `videos_per_sample[i % len]` videos each (one data folder per
    pattern)."""
    workdir = Path(workdir).resolve()
    hf_dir = workdir / ("hf_moe" if moe else "hf")
    if not (hf_dir / "config.json").exists():
        build_hf_dir(hf_dir, moe=moe)
    if edit_kwargs.get("load_weights") and not (hf_dir / "model.safetensors").exists():
        write_weights(hf_dir, moe=moe)
    pattern = "" if images_per_sample == (1,) else "_" + "".join(map(str, images_per_sample))
    if any(videos_per_sample):
        pattern += "_v" + "".join(map(str, videos_per_sample))
    data_dir = workdir / ("data" + pattern)
    samples = data_dir / "samples.json"
    if not samples.exists() or len(json.loads(samples.read_text())) != n_samples:
        tiny.write_samples(data_dir, n_samples, images_per_sample=images_per_sample,
                           videos_per_sample=videos_per_sample)
    # MindSpeed-MM caches the tokenized data set in cache_dir: one per data folder.
    cache_dir = workdir / data_dir.name.replace("data", "cache", 1)
    edits = YamlEdits(hf_dir=hf_dir, data_dir=data_dir, cache_dir=cache_dir, max_samples=n_samples,
                      videos=any(videos_per_sample), **edit_kwargs)
    config = write_config(mm_root, workdir / config_name, edits)
    return {"workdir": workdir, "hf_dir": hf_dir, "samples": samples, "config": config}


def main(argv: list[str] | None = None) -> int:
    from mindspeed_flow.emulation.sources import SourceError, find_sources  # lazy: startup

    parser = argparse.ArgumentParser(prog="python -m mindspeed_flow.emulation.tiny_qwen3vl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdir")
    parser.add_argument("--dense", action="store_true", help="Qwen3-VL instead of Qwen3-VL-MoE")
    parser.add_argument("--ep", type=int, default=1, help="expert_parallel_size")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--samples", type=int, default=32)
    args = parser.parse_args(argv)
    try:  # the example YAML is read from the MindSpeed-MM checkout
        sources = find_sources()
    except SourceError as err:
        print(f"tiny_qwen3vl: {err}", file=sys.stderr)
        return 2
    paths = prepare_workdir(args.workdir, sources.mindspeed_mm.root, moe=not args.dense,
                            n_samples=args.samples, expert_parallel_size=args.ep, train_iters=args.iters)
    for key, value in paths.items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
