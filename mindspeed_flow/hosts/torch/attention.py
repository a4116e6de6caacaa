"""Varlen attention for packed microbatches: the kernel takes the sequence boundaries, never a T x T mask.

A packed microbatch is several causal sequences laid end to end. The HF decoder layers compute attention
through transformers' `AttentionInterface`; `install` registers one extra implementation per base
implementation ("sdpa" / "eager") and points the language model's config at it. That implementation:

- with `segments=Segments(...)` among the layer's keyword arguments (what `BackbonePart.run_layers` passes),
  runs a varlen kernel over the segment boundaries;
- without it (the whole HF model's own forward, the coupled reference) is exactly the base implementation,
  with the base implementation's mask function, so installing it changes nothing for the whole model.

Kernels, chosen per device type by `mindspeed_flow.accelerator.varlen_attention_kernel`:

- "sdpa_segments": one `scaled_dot_product_attention(is_causal=True)` per segment. Without a mask argument
  SDPA takes its flash / memory-efficient kernels (on CPU too), so memory is O(T) in the sequence and the
  score matrix of the largest segment is the most any backend may hold. FlexAttention with a document mask
  would be one call, but eager FlexAttention (no torch.compile, which CPU CI and torch 2.7 cannot rely on)
  materialises the full score matrix, which is what this module removes.
- "npu_fusion_attention": torch_npu's fused kernel in the varlen TND layout (`actual_seq_qlen` /
  `actual_seq_kvlen` are cumulative ends; sparse_mode 3 with the compressed 2048 x 2048 causal triangle
  generates the causal shape per sequence).

Every kernel returns [B, T, N, D], the layout HF attention implementations return.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mindspeed_flow.accelerator import varlen_attention_kernel

PREFIX = "msf_varlen_"
BASE_IMPLEMENTATIONS = ("sdpa", "eager")
_NPU_CAUSAL_SIZE = 2048  # torch_npu's compressed mask for sparse_mode 2/3 is always 2048 x 2048


@dataclass(frozen=True)
class Segments:
    """Boundaries of the sequences of one packed microbatch (batch dimension 1).

    `bounds` are host integers 0 = b_0 < b_1 < ... < b_n = T (a padding tail is one more segment, so every
    query row attends to at least one key); `kernel` None lets the accelerator choose by the query's device.
    """

    bounds: tuple[int, ...]
    kernel: Optional[str] = None

    def __post_init__(self) -> None:
        b = self.bounds
        if len(b) < 2 or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"Segments.bounds={b} must start at 0 and strictly increase")

    @staticmethod
    def from_lengths(lengths: Sequence[int], kernel: Optional[str] = None) -> "Segments":
        bounds = [0]
        for n in lengths:
            if n > 0:
                bounds.append(bounds[-1] + int(n))
        return Segments(tuple(bounds), kernel)

    @staticmethod
    def from_segment_ids(segment_ids: torch.Tensor, kernel: Optional[str] = None) -> "Segments":
        """From a [1, T] segment index (one small host transfer: the run lengths)."""
        if segment_ids.dim() == 2 and segment_ids.shape[0] != 1:
            raise ValueError(f"varlen attention takes one packed microbatch (batch 1), got segment_ids of shape "
                             f"{tuple(segment_ids.shape)}")
        _, counts = torch.unique_consecutive(segment_ids.reshape(-1), return_counts=True)
        return Segments.from_lengths(counts.tolist(), kernel)

    @property
    def total(self) -> int:
        return self.bounds[-1]

    @property
    def lengths(self) -> list[int]:
        return [y - x for x, y in zip(self.bounds, self.bounds[1:])]

    @cached_property
    def cumulative_ends(self) -> list[int]:
        return list(self.bounds[1:])


# ---- kernels: q [1, N, T, D], k/v [1, N_kv, T, D] -> [1, T, N, D] --------------------------------------------
def _repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """GQA: each key/value head serves n_heads / n_kv consecutive query heads (HF's repeat_kv order)."""
    n_kv = x.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"varlen attention: {n_heads} query heads is not a multiple of {n_kv} key/value heads")
    return x if n_kv == n_heads else x.repeat_interleave(n_heads // n_kv, dim=1)


def sdpa_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments, scale: Optional[float],
                  dropout: float) -> torch.Tensor:
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    outs = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], dropout_p=dropout,
                                           is_causal=True, scale=scale)
            for a, b in zip(segments.bounds, segments.bounds[1:])]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2)


def npu_fusion_attention_tnd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments,
                             scale: Optional[float], dropout: float) -> torch.Tensor:
    torch_npu = sys.modules["torch_npu"]  # an npu tensor exists only once accelerator.py has imported torch_npu
    n_heads, head_dim = q.shape[1], q.shape[-1]
    causal = torch.ones(_NPU_CAUSAL_SIZE, _NPU_CAUSAL_SIZE, dtype=torch.bool, device=q.device).triu_(1)
    ends = segments.cumulative_ends
    out = torch_npu.npu_fusion_attention(
        q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), n_heads, "TND",
        atten_mask=causal, scale=head_dim ** -0.5 if scale is None else scale, keep_prob=1.0 - dropout,
        actual_seq_qlen=ends, actual_seq_kvlen=ends, sparse_mode=3)[0]
    return out.unsqueeze(0)


KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "sdpa_segments": sdpa_segments,
    "npu_fusion_attention": npu_fusion_attention_tnd,
}


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments,
                     scale: Optional[float] = None, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention within each segment: q [1, N, T, D], k/v [1, N_kv, T, D] -> [1, T, N, D]."""
    if q.shape[0] != 1 or q.shape[2] != segments.total:
        raise ValueError(f"varlen attention: query of shape {tuple(q.shape)} does not match one packed "
                         f"microbatch of {segments.total} tokens (batch 1)")
    name = segments.kernel or varlen_attention_kernel(q.device.type)
    if name not in KERNELS:
        raise ValueError(f"varlen attention kernel {name!r} is unknown; choose one of {sorted(KERNELS)}")
    return KERNELS[name](q, k, v, segments, scale, dropout)


# ---- the HF attention implementation ----------------------------------------------------------------------
def _base_function(module: nn.Module, base: str) -> Callable[..., Any]:
    if base == "eager":  # each modeling file defines its own eager function
        return getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # optional: transformers

    return ALL_ATTENTION_FUNCTIONS[base]


def _implementation(base: str) -> Callable[..., Any]:
    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                  segments: Optional[Segments] = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        if segments is None or (base == "sdpa" and len(segments.bounds) == 2):
            # No boundaries (the whole model), or one causal sequence: the base call itself, so that a sample
            # packed alone is bit-identical to the whole model (same GQA handling and kernel).
            return _base_function(module, base)(module, query, key, value, attention_mask, dropout=dropout,
                                                 scaling=scaling, **kwargs)
        if kwargs.get("sliding_window") is not None:
            raise NotImplementedError(f"{type(module).__name__}: sliding-window attention with packed "
                                      f"microbatches is not supported (set use_sliding_window=false)")
        return varlen_attention(query, key, value, segments, scaling, dropout), None

    attention.__name__ = f"{PREFIX}{base}"
    return attention


def install(text_config: Any) -> str:
    """Point the language model's config at the varlen implementation over its current one; returns the base.

    Idempotent (a config already pointing at it keeps it). Only "sdpa" and "eager" bases are supported: the
    others (flash_attention_2, flex_attention) would need their own mask conventions.
    """
    from transformers import AttentionInterface  # optional: transformers
    from transformers.masking_utils import (  # optional: transformers
        ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface)

    current = text_config._attn_implementation or "eager"
    base = current[len(PREFIX):] if current.startswith(PREFIX) else current
    if base not in BASE_IMPLEMENTATIONS:
        raise ValueError(f"model.attn_implementation={base!r} is not supported by the torch host; choose one of "
                         f"{BASE_IMPLEMENTATIONS} (packed microbatches run a varlen kernel over either)")
    name = PREFIX + base
    AttentionInterface.register(name, _implementation(base))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    text_config._attn_implementation = name
    return base
