"""Tensor parallelism for the torch host's parts, applied in place by one small function per module family.

Megatron's split, on the HF modules themselves (torchtitan style: the model code is untouched, its linears are
swapped for the overlap layer's sharded ones):
- attention: q/k/v (or a ViT's fused qkv) column-parallel, so each TP rank owns a contiguous block of heads; the
  output projection row-parallel (its all-reduce is the only forward collective of the block);
- MLP: gate/up (or fc1) column-parallel, down (or fc2) row-parallel;
- norms, embeddings, the LM head, rotary tables and the Qwen merger stay replicated.
Activations between blocks are replicated over the TP group (no sequence parallelism in this host: the HF layers
take whole sequences), so every TP rank computes the same loss and the same gradient for every replicated
parameter, and the embedding gradient that flows back to the encoder is the same on every TP rank.

HF attention modules view q/k/v with -1 heads, so they run on the local heads as they are; modules that read a
head count attribute (the Qwen ViT, CLIP) get the local count. The overlap implementation (MC2 / chunked / plain)
is chosen per call by the part's `OverlapContext`, which logs its choice and reasons once.
"""
from __future__ import annotations

import logging
import types
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mindspeed_flow.hosts.torch import hf_compat
from mindspeed_flow.hosts.torch.omni import AudioEncoderPart
from mindspeed_flow.hosts.torch.split import BackbonePart, EncoderPart
from mindspeed_flow.overlap import TP_DIM_ATTR, ColumnParallelLinear, OverlapContext, RowParallelLinear

log = logging.getLogger(__name__)


class TensorParallelError(ValueError):
    """A model that cannot be split over this TP size (names the module and the rule)."""


def _swap(parent: nn.Module, name: str, cls: type, ctx: OverlapContext, fused: int = 1) -> None:
    linear = getattr(parent, name)
    if not isinstance(linear, nn.Linear):
        raise TensorParallelError(f"{type(parent).__name__}.{name} is {type(linear).__name__}, expected nn.Linear")
    setattr(parent, name, cls.from_linear(linear, ctx, fused=fused))


def _local_heads(what: str, heads: int, tp: int) -> int:
    if heads % tp:
        raise TensorParallelError(f"{what}: {heads} heads are not divisible by tp={tp}")
    return heads // tp


def _set_local_head_counts(attn: nn.Module, tp: int, names: Iterable[str]) -> None:
    """Divide the head-count attributes a module keeps (those its forward may read) by tp."""
    for name in names:
        if hasattr(attn, name):
            setattr(attn, name, _local_heads(f"{type(attn).__name__}.{name}", getattr(attn, name), tp))


def _decoder_layer(layer: nn.Module, ctx: OverlapContext, heads: int, kv_heads: int) -> None:
    """A Qwen2 / Llama decoder layer (every family's language model here)."""
    tp = ctx.world
    _local_heads("language model attention", heads, tp)
    _local_heads("language model key/value", kv_heads, tp)  # each rank keeps whole KV groups of its heads
    attn, mlp = layer.self_attn, layer.mlp
    for name in ("q_proj", "k_proj", "v_proj"):
        _swap(attn, name, ColumnParallelLinear, ctx)
    _swap(attn, "o_proj", RowParallelLinear, ctx)
    _set_local_head_counts(attn, tp, ("num_heads", "num_key_value_heads"))
    for name in ("gate_proj", "up_proj"):
        _swap(mlp, name, ColumnParallelLinear, ctx)
    _swap(mlp, "down_proj", RowParallelLinear, ctx)


def parallelize_language_model(layers: Iterable[nn.Module], text_config: object, ctx: OverlapContext) -> None:
    heads = int(getattr(text_config, "num_attention_heads"))
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    for layer in layers:
        _decoder_layer(layer, ctx, heads, kv_heads)


def _qwen_vision_block(block: nn.Module, ctx: OverlapContext) -> None:
    """Qwen2-VL / Qwen2.5-VL ViT block: fused qkv (separate q/k/v in the Qwen2.5-Omni thinker's ViT) + proj;
    fc1/fc2 (Qwen2-VL) or gate/up/down (Qwen2.5-VL, Omni)."""
    attn, mlp = block.attn, block.mlp
    if hasattr(attn, "qkv"):
        _swap(attn, "qkv", ColumnParallelLinear, ctx, fused=3)
    else:
        for name in ("q", "k", "v"):
            _swap(attn, name, ColumnParallelLinear, ctx)
    _swap(attn, "proj", RowParallelLinear, ctx)
    _set_local_head_counts(attn, ctx.world, ("num_heads",))
    if hasattr(mlp, "fc1"):
        _swap(mlp, "fc1", ColumnParallelLinear, ctx)
        _swap(mlp, "fc2", RowParallelLinear, ctx)
    else:
        for name in ("gate_proj", "up_proj"):
            _swap(mlp, name, ColumnParallelLinear, ctx)
        _swap(mlp, "down_proj", RowParallelLinear, ctx)


def _clip_attention_forward(self: nn.Module, hidden_states: torch.Tensor,
                            attention_mask: Optional[torch.Tensor] = None,
                            causal_attention_mask: Optional[torch.Tensor] = None,
                            output_attentions: Optional[bool] = False, **_: object
                            ) -> tuple[torch.Tensor, None]:
    """CLIP attention on this rank's heads. Some transformers releases reshape the attention output to the
    input's full width before out_proj, which a head shard does not have; this forward keeps the local width."""
    if output_attentions:
        raise TensorParallelError("output_attentions is not available with tensor parallelism")
    b, s, _ = hidden_states.shape
    q, k, v = (proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
               for proj in (self.q_proj, self.k_proj, self.v_proj))
    mask = attention_mask
    if causal_attention_mask is not None:
        mask = causal_attention_mask if mask is None else mask + causal_attention_mask
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
    return self.out_proj(out.transpose(1, 2).reshape(b, s, -1)), None


def _clip_layer(layer: nn.Module, ctx: OverlapContext) -> None:
    """CLIP / SigLIP encoder layer (LLaVA's vision tower)."""
    attn, mlp = layer.self_attn, layer.mlp
    for name in ("q_proj", "k_proj", "v_proj"):
        _swap(attn, name, ColumnParallelLinear, ctx)
    _swap(attn, "out_proj", RowParallelLinear, ctx)
    _set_local_head_counts(attn, ctx.world, ("num_heads",))
    attn.forward = types.MethodType(_clip_attention_forward, attn)
    _swap(mlp, "fc1", ColumnParallelLinear, ctx)
    _swap(mlp, "fc2", RowParallelLinear, ctx)


def _audio_layer(layer: nn.Module, ctx: OverlapContext) -> None:
    """Qwen2.5-Omni audio tower layer (Whisper style): q/k/v column-parallel, out_proj row-parallel (its
    attention reshapes by `num_heads` and the output by -1, so the local heads suffice); fc1/fc2."""
    attn = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        _swap(attn, name, ColumnParallelLinear, ctx)
    _swap(attn, "out_proj", RowParallelLinear, ctx)
    _set_local_head_counts(attn, ctx.world, ("num_heads",))
    _swap(layer, "fc1", ColumnParallelLinear, ctx)
    _swap(layer, "fc2", RowParallelLinear, ctx)


def parallelize_encoder_modules(modules: dict[str, nn.Module], family: str, ctx: OverlapContext) -> None:
    """The encoder part's modules as `hf_compat.vision_modules` names them."""
    if family in hf_compat.MROPE_FAMILIES:
        for block in modules["visual"].blocks:
            _qwen_vision_block(block, ctx)
        return
    tower = modules["vision_tower"]
    encoder = getattr(getattr(tower, "vision_model", tower), "encoder")
    for layer in encoder.layers:
        _clip_layer(layer, ctx)
    projector = modules["projector"]
    _swap(projector, "linear_1", ColumnParallelLinear, ctx)
    _swap(projector, "linear_2", RowParallelLinear, ctx)


def apply_tensor_parallel(part: nn.Module, group: Optional[dist.ProcessGroup], *, impl: str = "auto",
                          chunks: int = 2, announce: Optional[Callable[[str], None]] = None
                          ) -> Optional[OverlapContext]:
    """Split an EncoderPart, AudioEncoderPart or BackbonePart over `group` in place; returns the part's overlap
    context (None when the group has one rank: nothing to split). `announce` receives the overlap choices, once
    each."""

    if group is None or dist.get_world_size(group) == 1:
        return None
    ctx = OverlapContext(group, impl=impl, chunks=chunks, announce=announce)
    if isinstance(part, BackbonePart):
        # Every HF attention module keeps its (text) config: the head counts come from there.
        parallelize_language_model(part.layers, part.layers[0].self_attn.config, ctx)
    elif isinstance(part, EncoderPart):
        modules = dict(part.named_children())
        parallelize_encoder_modules(modules, part.family, ctx)
    elif isinstance(part, AudioEncoderPart):
        for layer in part.audio_tower.layers:
            _audio_layer(layer, ctx)
    else:
        raise TensorParallelError(f"tensor parallelism applies to EncoderPart / AudioEncoderPart / BackbonePart, "
                                  f"not {type(part)}")
    n_sharded = sum(1 for p in part.parameters() if hasattr(p, TP_DIM_ATTR))
    log.info("tensor parallel %s over %d ranks: %d sharded parameters, overlap impl=%s chunks=%d",
             type(part).__name__, ctx.world, n_sharded, impl, chunks)
    return ctx


def is_tp_sharded(param: nn.Parameter) -> bool:
    return hasattr(param, TP_DIM_ATTR)


# ------------------------------------------------------------------------------------------------ TP peers' inputs
# Only TP rank 0 of a part talks to the pool (the pool's bridges pair TP leaders); its TP peers need the same
# embeddings (backbone) or the same returned gradients (encoder), which cross the TP group by broadcast.
def _leader(group: dist.ProcessGroup) -> int:
    return dist.get_global_rank(group, 0)


def broadcast_rows(tensors: Optional[list[torch.Tensor]], n: int, group: dist.ProcessGroup, *, width: int,
                   dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """The TP leader's `n` tensors of shape [rows_i, width] on every rank of `group`, in order: one broadcast of
    the row counts, one of all rows together (few large messages instead of one pair per sample)."""
    if n == 0:
        return []
    leader = dist.get_rank(group) == 0
    if leader and (tensors is None or len(tensors) != n):
        raise ValueError(f"broadcast_rows: the TP leader holds {0 if tensors is None else len(tensors)} tensors, "
                         f"expected {n}")
    counts = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64, device=device) if leader else \
        torch.empty(n, dtype=torch.int64, device=device)
    dist.broadcast(counts, src=_leader(group), group=group)
    sizes = [int(c) for c in counts.tolist()]
    flat = torch.cat([t.reshape(-1, width).to(device=device, dtype=dtype) for t in tensors]) if leader else \
        torch.empty(sum(sizes), width, dtype=dtype, device=device)
    dist.broadcast(flat, src=_leader(group), group=group)
    return list(flat.split(sizes))


def broadcast_like(tensor: Optional[torch.Tensor], like: tuple[torch.Size, torch.dtype, torch.device],
                   group: dist.ProcessGroup) -> torch.Tensor:
    """The TP leader's `tensor` on every rank of `group`; `like` is its (shape, dtype, device) on this rank."""
    shape, dtype, device = like
    out = tensor.to(device=device, dtype=dtype).contiguous() if dist.get_rank(group) == 0 else \
        torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(out, src=_leader(group), group=group)
    return out
