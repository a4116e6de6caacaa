"""Tiny GLM-4.5V assets for MindSpeed-MM's `pretrain_transformers.py` under emulation.

MindSpeed-MM's GLM-4.5V example (`examples/glm4.5v/finetune_glm4_5v_106B.sh`) launches `pretrain_transformers.py`
with its arguments on the command line and names three files: `model_106B.json` (model id, which parts are frozen,
the loss), `data_106B.json` (a LLaMA-Factory-style data set under the `glm4v_moe` chat template) and
`fsdp2_config.yaml`. The model itself comes from the HF folder `init_from_hf_path` names. This module writes a tiny
HF folder (tokenizer with GLM's special tokens, transformers' Glm4vProcessor, config.json from the `glm4v_moe` tiny
preset, seeded weights), the three files made from MindSpeed-MM's own by substituting values (keys unchanged), and
the launch arguments read from the example script's GPT_ARGS / MM_ARGS / OUTPUT_ARGS blocks with the tiny job's
values put in.

    python -m mindspeed_flow.emulation.tiny_glm45v WORKDIR      # prints the pretrain_transformers.py command line
    python -m mindspeed_flow.emulation.tiny_glm45v WORKDIR --iters 12 --name resumed --load WORKDIR/save_glm
                                                                # the same job resumed from its iteration-10 save

Needs transformers 4.57 (MindSpeed-MM's pin, with the Glm4vMoe classes) and the `emulate` extra.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from mindspeed_flow.emulation import tiny
from mindspeed_flow.model_presets import hf_config_dict
from mindspeed_flow.model_presets.tiny import GLM_TOKENS

EXAMPLE_DIR = "examples/glm4.5v"
EXAMPLE_SCRIPT = f"{EXAMPLE_DIR}/finetune_glm4_5v_106B.sh"
EXAMPLE_MODEL = f"{EXAMPLE_DIR}/model_106B.json"
EXAMPLE_DATA = f"{EXAMPLE_DIR}/data_106B.json"
EXAMPLE_FSDP2 = f"{EXAMPLE_DIR}/fsdp2_config.yaml"
# GLM-4.5V's chat template (MindSpeed-MM's `glm4v_moe`) ends an assistant turn with the tokenizer's eos.
_EOS = "<|endoftext|>"


def build_hf_dir(out_dir: Path) -> Path:
    """Tokenizer, Glm4vProcessor and config.json of the tiny GLM-4.5V in `out_dir` (no weights)."""
    from mindspeed_flow.utils import torchvision_compat  # lazy: torch

    torchvision_compat.install()  # transformers' GLM-4V processors import torchvision (a CUDA wheel)
    import transformers  # lazy: transformers 4.57, after the fix
    from transformers import AutoTokenizer, Glm4vImageProcessor, Glm4vProcessor
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

    out_dir.mkdir(parents=True, exist_ok=True)
    tiny.build_tokenizer(out_dir, special_tokens=tuple(GLM_TOKENS), expected_ids=GLM_TOKENS, eos_token=_EOS,
                         pad_token=_EOS, tokenizer_class="PreTrainedTokenizerFast")
    tok = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    # Images of 56-112 px: 4-8 patches of 14 px a side, merged 2x2 into 4-16 LLM tokens each.
    image = Glm4vImageProcessor(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112}, patch_size=14,
                                temporal_patch_size=2, merge_size=2)
    video = Glm4vVideoProcessor(patch_size=14, temporal_patch_size=2, merge_size=2)
    Glm4vProcessor(image_processor=image, tokenizer=tok, video_processor=video).save_pretrained(str(out_dir))
    config = transformers.Glm4vMoeConfig.from_dict(hf_config_dict("glm4v_moe", "tiny"))
    config.architectures = ["Glm4vMoeForConditionalGeneration"]
    config.save_pretrained(str(out_dir))
    return out_dir


def write_weights(hf_dir: Path, seed: int = 1234) -> Path:
    """model.safetensors of the tiny model, initialised by transformers from `seed` (what both jobs start from)."""
    import torch  # lazy: torch
    import transformers  # lazy: transformers 4.57

    config = transformers.Glm4vMoeConfig.from_pretrained(str(hf_dir))
    torch.manual_seed(seed)
    model = transformers.Glm4vMoeForConditionalGeneration(config)
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    return hf_dir / "model.safetensors"


def convert_checkpoint(hf_dir: Path, out_dir: Path, mm_root: Path) -> Path:
    """The example's first step: MindSpeed-MM's own converter (`mm-convert ExpertMergeDcpConverter hf_to_dcp`)
    merges each MoE layer's experts into the stacked weights its fused model trains and writes the DCP checkpoint
    that `--load` reads (`--init-model-with-meta-device` builds the model empty and needs it)."""
    if (out_dir / "latest_checkpointed_iteration.txt").exists():
        return out_dir
    code = ("import sys\nfrom checkpoint.convert_cli import main\n"
            "sys.argv = ['mm-convert', 'ExpertMergeDcpConverter', 'hf_to_dcp', '--hf_dir', sys.argv[1], "
            "'--save_dir', sys.argv[2]]\nmain()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(mm_root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code, str(hf_dir), str(out_dir)], cwd=str(mm_root), env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"mm-convert ExpertMergeDcpConverter hf_to_dcp failed:\n{proc.stderr[-3000:]}")
    return out_dir


@dataclass
class GlmJob:
    """What changes in MindSpeed-MM's GLM-4.5V example for a tiny CPU job; everything else is the example's."""

    hf_dir: Path
    data_dir: Path
    cache_dir: Path
    save_dir: Path
    workdir: Path
    train_iters: int = 10
    global_batch_size: int = 2
    micro_batch_size: int = 1
    seq_length: int = 512
    max_samples: int = 14
    clip_grad: float = 0.0
    lr: float = 1e-3
    train_vision: bool = False
    # The samples hold videos too: the example's `"videos": null` becomes `"videos": "videos"`.
    videos: bool = False
    load_dir: Optional[Path] = None
    extra: list[str] = field(default_factory=list)


def model_json(example: dict[str, Any], job: GlmJob) -> dict[str, Any]:
    """model_106B.json with the tiny HF folder and the tiny sizes (the sizes are read from config.json; MindSpeed-MM
    keeps them in model.json for reference)."""
    cfg = hf_config_dict("glm4v_moe", "tiny")
    out = json.loads(json.dumps(example))
    out["init_from_hf_path"] = str(job.hf_dir)
    vision, text = out["image_encoder"]["vision_encoder"], out["text_decoder"]
    vcfg, tcfg = cfg["vision_config"], cfg["text_config"]
    vision.update(num_layers=vcfg["depth"], hidden_size=vcfg["hidden_size"], num_attention_heads=vcfg["num_heads"])
    text.update(num_layers=tcfg["num_hidden_layers"], hidden_size=tcfg["hidden_size"],
                num_attention_heads=tcfg["num_attention_heads"], max_position_embeddings=tcfg["max_position_embeddings"])
    if job.train_vision:
        vision["freeze"] = False
        out["image_encoder"]["vision_projector"]["freeze"] = False
    return out


def data_json(example: dict[str, Any], job: GlmJob) -> dict[str, Any]:
    """data_106B.json over the tiny samples: small pixel bounds, one preprocessing worker, no pinned memory."""
    out = json.loads(json.dumps(example))
    pre = out["dataset_param"]["preprocess_parameters"]
    pre.update(model_name_or_path=str(job.hf_dir), image_max_pixels=112 * 112, image_min_pixels=56 * 56,
               video_max_pixels=112 * 112)
    basic = out["dataset_param"]["basic_parameters"]
    basic.update(dataset_dir=str(job.data_dir), dataset=str(job.data_dir / "samples.json"),
                 cache_dir=str(job.cache_dir), preprocessing_num_workers=1, max_samples=job.max_samples)
    out["dataloader_param"]["pin_memory"] = False
    if job.videos:
        out["dataset_param"]["attr"]["videos"] = "videos"
    return out


def script_blocks(text: str, source: str = EXAMPLE_SCRIPT) -> dict[str, list[str]]:
    """The example script's `NAME="..."` argument blocks (GPT_ARGS, MM_ARGS, OUTPUT_ARGS, DISTRIBUTED_ARGS), each
    as the words the shell would pass."""
    # The script's plain assignments (`MM_TOOL="./mindspeed_mm/tools/tools.json"`), put in where a block names them;
    # computed ones (`$(($WORLD_SIZE/$TP))`) are the values `launch_args` sets.
    assigned = dict(re.findall(r'(?m)^([A-Z_][A-Z0-9_]*)="?([^"$\n]*)"?\s*$', text))

    def resolve(word: str) -> str:
        return re.sub(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", lambda m: assigned.get(m.group(1), m.group(0)), word)

    blocks = {name: [resolve(w) for w in shlex.split(body.replace("\\\n", " "))]
              for name, body in re.findall(r'(?ms)^([A-Z_]+_ARGS)="(.*?)"', text)}
    for name in ("GPT_ARGS", "MM_ARGS", "OUTPUT_ARGS"):
        if name not in blocks:
            raise ValueError(f"{source}: no {name}=\"...\" block")
    return blocks


def _set(words: list[str], flag: str, value: Optional[str], source: str) -> None:
    """Put `flag value` in `words` (replacing the example's value; value None drops the flag)."""
    if flag in words:
        at = words.index(flag)
        has_value = at + 1 < len(words) and not words[at + 1].startswith("--")
        del words[at:at + (2 if has_value else 1)]
    elif value is None:
        raise ValueError(f"{source}: no {flag} to drop")
    if value is not None:
        words += [flag] if value == "" else [flag, value]


def launch_args(script_text: str, job: GlmJob, model: Path, data: Path, fsdp2: Path,
                source: str = EXAMPLE_SCRIPT) -> list[str]:
    """`pretrain_transformers.py` and its arguments as the example script passes them, with the tiny job's values."""
    blocks = script_blocks(script_text, source)
    words = blocks["GPT_ARGS"] + blocks["MM_ARGS"] + blocks["OUTPUT_ARGS"]
    subs = {"--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "1",
            "--context-parallel-size": "1", "--micro-batch-size": str(job.micro_batch_size),
            "--global-batch-size": str(job.global_batch_size), "--vocab-size": str(tiny.TINY_VOCAB),
            "--seq-length": str(job.seq_length), "--train-iters": str(job.train_iters), "--lr": str(job.lr),
            "--clip-grad": str(job.clip_grad), "--fsdp2-config-path": str(fsdp2), "--mm-data": str(data),
            "--mm-model": str(model), "--save": str(job.save_dir), "--load": str(job.load_dir),
            # A few CPU cores: no loader workers.
            "--num-workers": "0", "--eval-iters": "0",
            # The example warms the learning rate up over 10% of 10,000 iterations; a 10-iteration job would
            # train at nearly zero learning rate. A constant one shows the parts' gradients at work.
            "--lr-decay-style": "constant", "--lr-warmup-fraction": None}
    for flag, value in subs.items():
        _set(words, flag, value, source)
    # Megatron's backend flag follows the blocks on the example's command line.
    return ["pretrain_transformers.py"] + words + ["--distributed-backend", "nccl"] + list(job.extra)


def prepare_glm_workdir(workdir: str | Path, mm_root: Path, *, n_samples: int = 14,
                        images_per_sample: tuple[int, ...] = (1,), videos_per_sample: tuple[int, ...] = (0,),
                        name: str = "glm", **job_kwargs: Any) -> dict[str, Any]:
    """The tiny HF folder with seeded weights, its conversion for MindSpeed-MM (the job's `--load`, unless
    `load_dir` says otherwise), samples, and a fresh model / data / fsdp2 file set named `name`;
    returns {"argv": the pretrain_transformers.py command line, "hf_dir", "save", ...}."""
    workdir = Path(workdir).resolve()
    hf_dir = workdir / "hf_glm45v"
    if not (hf_dir / "config.json").exists():
        build_hf_dir(hf_dir)
    if not (hf_dir / "model.safetensors").exists():
        write_weights(hf_dir)
    converted = convert_checkpoint(hf_dir, workdir / "mm_glm45v", mm_root)
    job_kwargs.setdefault("load_dir", converted)
    videos = any(videos_per_sample)
    data_dir = workdir / ("data_glm_" + "".join(map(str, images_per_sample))
                          + ("_v" + "".join(map(str, videos_per_sample)) if videos else ""))
    samples = data_dir / "samples.json"
    if not samples.exists() or len(json.loads(samples.read_text())) != n_samples:
        tiny.write_samples(data_dir, n_samples, images_per_sample=images_per_sample,
                           videos_per_sample=videos_per_sample)
    job = GlmJob(hf_dir=hf_dir, data_dir=data_dir, cache_dir=workdir / f"cache_{name}", workdir=workdir,
                 save_dir=workdir / f"save_{name}", max_samples=n_samples, videos=videos, **job_kwargs)
    model = workdir / f"{name}_model.json"
    data = workdir / f"{name}_data.json"
    fsdp2 = workdir / f"{name}_fsdp2_config.yaml"
    model.write_text(json.dumps(model_json(json.loads((mm_root / EXAMPLE_MODEL).read_text()), job), indent=4))
    data.write_text(json.dumps(data_json(json.loads((mm_root / EXAMPLE_DATA).read_text()), job), indent=4))
    fsdp2.write_text((mm_root / EXAMPLE_FSDP2).read_text())
    argv = launch_args((mm_root / EXAMPLE_SCRIPT).read_text(), job, model, data, fsdp2)
    return {"argv": argv, "hf_dir": hf_dir, "converted": converted, "samples": samples, "save": job.save_dir,
            "model": model, "data": data, "workdir": workdir}


def main(argv: list[str] | None = None) -> int:
    from mindspeed_flow.emulation.sources import SourceError, find_sources  # lazy: startup

    parser = argparse.ArgumentParser(prog="python -m mindspeed_flow.emulation.tiny_glm45v", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdir")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--samples", type=int, default=14)
    parser.add_argument("--name", default="glm", help="the job's files and save folder are named after it")
    parser.add_argument("--load", default=None,
                        help="resume from this save folder (default: the converted weights, iteration 0)")
    args = parser.parse_args(argv)
    try:
        sources = find_sources()
    except SourceError as err:
        print(f"tiny_glm45v: {err}", file=sys.stderr)
        return 2
    extra = {"load_dir": Path(args.load).resolve()} if args.load else {}
    out = prepare_glm_workdir(args.workdir, sources.mindspeed_mm.root, n_samples=args.samples, name=args.name,
                              train_iters=args.iters, **extra)
    print(shlex.join(out["argv"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
