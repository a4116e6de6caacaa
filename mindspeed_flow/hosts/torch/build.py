"""Build an HF vision-language model with only the parts a rank runs materialised (the rest on the meta device).

`build_vlm(..., parts=("encoder",))` constructs the whole model with its parameters on the meta device (no
memory; buffers such as rotary frequencies are computed for real, they are small), then materialises and fills
only the parameters of the parts asked for:

- from a local checkpoint (config.json + safetensors): only those parameters' tensors are read, through the
  safetensors index (`model.safetensors.index.json`) or the single `model.safetensors`; the files are
  memory-mapped, so the other parts' bytes are never read. Training jobs never reach the hub.
- from a config dict (tiny presets): each part is initialised by the model's own `_init_weights` (dispatched to
  the owning sub-model, as HF does for composite models) under its own seeded RNG stream, in module order. A
  part's weights therefore depend on the seed and the part only: an encoder-only rank, a backbone-only rank
  and a whole (coupled) model get bit-identical parameters. The caller's RNG state is left untouched.

Weights are filled in fp32 and cast to the requested dtype. The parts are those of `split.split_vlm`.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn

from mindspeed_flow.hosts.torch import hf_compat
from mindspeed_flow.specs import encoder_parts

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
PARTS = ("encoder", "backbone")
_SEED_STRIDE = 1_000_003  # part k initialises under seed * stride + k: distinct streams for distinct parts


def _check_attn(attn_implementation: str) -> None:
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"model.attn_implementation={attn_implementation!r} is not supported by the torch host; "
                         f"choose one of {ATTN_IMPLEMENTATIONS} (the whole model's attention; packed "
                         f"microbatches run a varlen kernel over either)")


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device; buffers stay real (they are computed in
    __init__, e.g. rotary inverse frequencies, and are not in checkpoints)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_vlm(family: str, hf_config: Mapping[str, Any], *, seed: int, dtype: torch.dtype = torch.float32,
              pretrained_path: Optional[str] = None, attn_implementation: str = "sdpa",
              parts: Optional[Sequence[str]] = None) -> nn.Module:
    """The HF model (Qwen2VL / Qwen2_5_VL / Llava ...ForConditionalGeneration, the Qwen2.5-Omni thinker) in train
    mode, with the parameters of `parts` (a subset of `parts_of(family)`, default all) on the CPU and every other
    parameter on meta.

    `pretrained_path`: a local directory with config.json and safetensors weights; `hf_config` is then ignored.
    """
    _check_attn(attn_implementation)
    all_parts = parts_of(family)
    parts = all_parts if parts is None else parts
    unknown = [p for p in parts if p not in all_parts]
    if unknown or not parts:
        raise ValueError(f"build_vlm parts={list(parts)}: choose one or more of {all_parts}")
    model_cls, config_cls = hf_compat.family_classes(family)
    config = config_cls.from_dict(_read_config(family, pretrained_path) if pretrained_path else dict(hf_config))
    with torch.random.fork_rng(devices=[]), parameters_on_meta():  # HF's own init on meta: no memory, no RNG
        model = model_cls._from_config(config, attn_implementation=attn_implementation)
    hf_compat.family_of(model)
    by_part = part_parameters(model, family)
    for k, part in enumerate(all_parts):
        if part not in parts:
            continue
        modules, materialized = _materialize(model, {id(p) for p in by_part[part]})
        if pretrained_path is not None:
            _load_part(model, materialized, pretrained_path)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed * _SEED_STRIDE + k)
                _init_part(model, modules)
    if dtype != torch.float32:
        for p in model.parameters():
            if p.device.type != "meta":
                p.data = p.data.to(dtype)
    model.train()
    return model


def parts_of(family: str) -> tuple[str, ...]:
    """A family's parts in build order (the order sets each part's seed stream): encoder part(s), backbone."""
    return encoder_parts(family) + ("backbone",)


def part_parameters(model: nn.Module, family: str) -> dict[str, list[nn.Parameter]]:
    """Parameters per part: each encoder part's modules, and everything else (the backbone)."""
    out: dict[str, list[nn.Parameter]] = {}
    for part, modules in hf_compat.encoder_modules(model, family).items():
        out[part] = [p for m in modules.values() for p in m.parameters()]
    enc_ids = {id(p) for ps in out.values() for p in ps}
    out["backbone"] = [p for p in model.parameters() if id(p) not in enc_ids]
    return out


def _materialize(model: nn.Module, wanted: set[int]) -> tuple[list[nn.Module], set[int]]:
    """Replace the wanted meta parameters by empty CPU ones (a tied parameter stays one object); returns the
    modules whose parameters (recursively) are all new, the ones the part's initialisation visits, and the
    new parameters' ids."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in wanted:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                module._parameters[name] = new[id(p)]
    new_ids = {id(p) for p in new.values()}
    modules = [m for m in model.modules() if (params := list(m.parameters())) and all(id(p) in new_ids for p in params)]
    return modules, new_ids


def _init_part(model: nn.Module, modules: list[nn.Module]) -> None:
    """HF's composite-model initialisation (children first, each module by its nearest PreTrainedModel's
    `_init_weights`), restricted to the part's modules."""
    from transformers import PreTrainedModel  # optional: transformers

    keep = {id(m) for m in modules}

    def visit(module: nn.Module, owner: Any) -> None:
        for child in module.children():
            visit(child, child if isinstance(child, PreTrainedModel) else owner)
        if id(module) in keep:
            owner._init_weights(module)

    with torch.no_grad():
        visit(model, model)


def _read_config(family: str, path: str) -> dict:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model.pretrained_path={path!r} is not a directory (expected config.json and "
                                f"*.safetensors from save_pretrained)")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model.pretrained_path={path!r} has no config.json")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if config.get("model_type") != family:
        raise ValueError(f"model.pretrained_path={path!r} holds model_type={config.get('model_type')!r} but "
                         f"model.family={family!r}")
    return config


def checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index (sharded checkpoints) or the single file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"model.pretrained_path={path!r} has neither model.safetensors.index.json nor "
                                f"model.safetensors")
    from safetensors import safe_open  # optional: safetensors

    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}


def _load_part(model: nn.Module, wanted: set[int], path: str) -> None:
    """Copy the wanted parameters' tensors (and only those) out of the checkpoint's safetensors files."""
    from safetensors import safe_open  # optional: safetensors

    files = checkpoint_files(path)
    names = hf_compat.model_names_of_checkpoint(model, list(files))
    todo: dict[str, list[tuple[str, nn.Parameter]]] = {}
    filled: set[int] = set()
    unfound: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in wanted or id(p) in filled:
            continue
        key = names.get(name)
        if key is None:  # a tied parameter may be stored under its other name only
            unfound.setdefault(id(p), name)
            continue
        filled.add(id(p))
        todo.setdefault(files[key], []).append((key, p))
    missing = [n for i, n in unfound.items() if i not in filled]
    if not missing and len(filled) != len(wanted):
        raise RuntimeError(f"loaded {len(filled)} of this part's {len(wanted)} parameters from {path!r}")
    if missing:
        raise ValueError(f"model.pretrained_path={path!r}: the checkpoint has no tensor for {missing[:5]} "
                         f"({len(missing)} parameters of this rank's part)")
    with torch.no_grad():
        for file, items in todo.items():
            with safe_open(file, framework="pt") as f:
                for key, p in items:
                    t = f.get_tensor(key)
                    if tuple(t.shape) != tuple(p.shape):
                        raise ValueError(f"{file}: tensor {key} has shape {tuple(t.shape)}, the model expects "
                                         f"{tuple(p.shape)}")
                    p.copy_(t)
