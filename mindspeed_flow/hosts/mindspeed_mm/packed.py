"""Packed (THD) decoder microbatches for the MindSpeed-MM flow job: several samples in one row, each attending only
to itself.

A planned microbatch of k samples becomes one row of their concatenated tokens (plus a tail of padding, in a
segment of its own, when sequence parallelism needs the length to be a multiple of the TP size), with:
- per-sample position ids: MindSpeed-MM's own rope-index function (mrope for Qwen2.5-VL) run on each sample
  alone, so positions restart at every sample exactly as in the sample's own padded row;
- labels that never cross a sample boundary: each sample's first label is ignored (it would be the target of the
  previous sample's last token);
- `PackedSeqParams(qkv_format="thd")` whose cumulative lengths are host lists of sequence ends (MindSpeed's
  convention for `npu_fusion_attention`'s `actual_seq_qlen`, TND layout; host lists need no device read).
Everything is built on the host from the step plan: no device synchronisation.

MindSpeed-MM's VLMModel never hands `packed_seq_params` to its text decoder and always builds a dense [s, s]
causal mask, and its Qwen2.5-VL LLM attention squeezes q/k/v to [t, heads, dim] before applying mrope, whose
cos/sin stay [t, 1, 1, dim] (the product broadcasts to [t, t, heads, dim]). The three wrappers below (registered in
`patches/flow.py`) close those gaps while a packed forward is active (the rank's flow context holds its
`PackedSeqParams`: `packed_forward`), and are inert otherwise:
- `positions_and_mask_wrapper`: the packed microbatch brings its position ids, and no dense mask is built (MindSpeed's
  flash attention takes its 2048 x 2048 compressed causal mask with sparse_mode 2: causal within each sequence);
- `decoder_forward_wrapper`: the text decoder gets the microbatch's `PackedSeqParams`;
- `multimodal_rope_wrapper`: mrope is applied on [t, 1, heads, dim] and squeezed afterwards.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from mindspeed_flow.hosts.mindspeed_mm import context as flow_context

IGNORE_INDEX = -100


def active_params() -> Optional[Any]:
    """The PackedSeqParams of the packed forward in progress on this rank, or None."""
    ctx = flow_context.current()
    return None if ctx is None else ctx.packed_params


@contextlib.contextmanager
def packed_forward(holder: Any, params: Any) -> Iterator[None]:
    """Inside: the model's forward is the packed microbatch's (see the module docstring). `holder` keeps the
    params where the wrappers look (the rank's FlowContext: `active_params`)."""
    saved, holder.packed_params = holder.packed_params, params
    try:
        yield
    finally:
        holder.packed_params = saved


def padded_length(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple if multiple > 1 else length


@dataclass
class PackedRow:
    """One packed microbatch on the host: the batch MindSpeed-MM's forward step takes, and its segments."""

    batch: dict[str, torch.Tensor]
    segments: list[int]  # tokens per segment: each sample's, then the padding tail if any
    samples: int  # segments that are samples (the rest is padding)

    @property
    def cu_seqlens(self) -> list[int]:
        """Cumulative sequence ends (no leading 0): torch_npu's `actual_seq_qlen` for the TND layout."""
        out, total = [], 0
        for n in self.segments:
            total += n
            out.append(total)
        return out

    def packed_seq_params(self) -> Any:
        from megatron.core.packed_seq_params import PackedSeqParams  # optional: megatron

        ends = self.cu_seqlens
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=ends, cu_seqlens_kv=ends,
                               max_seqlen_q=max(self.segments), max_seqlen_kv=max(self.segments))

    def token_weights(self, sample_weights: Sequence[float]) -> torch.Tensor:
        """[1, tokens - 1]: the weight of each shifted position's loss (the sample it lies in; 0 on padding)."""
        weights = list(sample_weights) + [0.0] * (len(self.segments) - self.samples)
        per_token = torch.repeat_interleave(torch.tensor(weights, dtype=torch.float32),
                                            torch.tensor(self.segments))
        return per_token[:-1].reshape(1, -1)


def pack_samples(ids: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], positions: Sequence[torch.Tensor],
                 *, pad_id: int = 0, pad_multiple: int = 1) -> PackedRow:
    """Concatenate samples into one row (`positions[i]`: [3, len_i] or [len_i]).

    An empty list gives one padding segment that carries no loss, so a rank the plan gave fewer samples than
    microbatches still runs the schedule's microbatch count."""
    lengths = [int(t.numel()) for t in ids]
    total = sum(lengths)
    pad = padded_length(max(total, 1), pad_multiple) - total
    rope_dims = positions[0].shape[0] if positions and positions[0].dim() == 2 else 0
    id_parts, label_parts, pos_parts = list(ids), [], list(positions)
    for lab in labels:
        lab = lab.clone()
        lab[0] = IGNORE_INDEX  # the previous sample's last token must not learn to predict this one
        label_parts.append(lab)
    if pad:
        id_parts.append(torch.full((pad,), pad_id, dtype=torch.long))
        label_parts.append(torch.full((pad,), IGNORE_INDEX, dtype=torch.long))
        tail = torch.arange(pad, dtype=torch.long)
        pos_parts.append(tail.expand(rope_dims, -1) if rope_dims else tail)
    batch = {"input_ids": torch.cat(id_parts).reshape(1, -1),
             "labels": torch.cat(label_parts).reshape(1, -1)}
    pos = torch.cat(pos_parts, dim=-1)
    batch["position_ids"] = pos.reshape(rope_dims, 1, -1) if rope_dims else pos.reshape(1, -1)
    return PackedRow(batch, lengths + ([pad] if pad else []), len(lengths))


def rope_positions_fn(model_cfg: Any) -> Callable[..., torch.Tensor]:
    """The job's own position-id function for one sample: MindSpeed-MM's rope index of its text decoder
    (`attention_mask_list[text_decoder.model_id]`'s `pos_func`), on the host. Returns (config, ids [len],
    grid [images or videos, 3] or None, seconds [videos] or None) -> [3, len]; `seconds` is the sample's
    second_per_grid_ts, which the unpatched job's batch passes on to the rope index for video tokens."""
    from mindspeed_mm.models.vision import vlm_attentionmask_for_llm as masks  # optional: mindspeed_mm

    model_id = getattr(model_cfg.text_decoder, "model_id", None)
    builder = masks.attention_mask_list.get(model_id)
    pos_func = getattr(builder, "keywords", {}).get("pos_func") if builder is not None else None
    if pos_func is None:
        raise ValueError(f"text_decoder.model_id={model_id!r}: MindSpeed-MM has no rope-index function for it, so "
                         "a packed microbatch cannot restart positions per sample; use packing.layout: rows")

    def positions(config: Any, ids: torch.Tensor, grid: Optional[torch.Tensor],
                  seconds: Optional[torch.Tensor] = None) -> torch.Tensor:
        extra = {} if seconds is None else {"second_per_grid_ts": [float(t) for t in seconds]}
        pos, _ = pos_func(config, ids.reshape(1, -1), image_grid_thw=grid, **extra)
        return pos[:, 0, :]

    return positions


# ------------------------------------------------------------------------------------------ wrappers


def positions_and_mask_wrapper(fn: Callable, packed_of: Callable[[], Optional[Any]] = active_params) -> Callable:
    """Wrap `prepare_positionsids_mask_for_llm(config, input_ids, inference_params, attention_mask, position_ids,
    ...)`: in a packed forward, no dense mask and the row's own position ids."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if packed_of() is None:
            return fn(*args, **kwargs)
        position_ids = kwargs.get("position_ids", args[4] if len(args) > 4 else None)
        if position_ids is None:
            raise RuntimeError("a packed microbatch reached the LLM without its per-sample position ids")
        # No mask: MindSpeed's flash attention then takes its compressed causal mask with sparse_mode 2 (causal
        # within each TND sequence). It builds that mask once from the config it is given, and the LLM layers'
        # config (read from model.json) lacks the flash-attention fields, so it is built here from the job's.
        from mindspeed.core.transformer.flash_attention.generate_mask.generate_mask import (  # optional: mindspeed
            get_attention_mask)

        get_attention_mask(kwargs.get("config", args[0] if args else None))
        return None, position_ids

    return wrapped


def decoder_forward_wrapper(forward: Callable, packed_of: Callable[[], Optional[Any]] = active_params) -> Callable:
    """Wrap `MMGPTModel.forward(self, input_ids, position_ids, attention_mask, ..., packed_seq_params=None)`."""

    @functools.wraps(forward)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        # VLMModel calls its text decoder with keywords only, packed_seq_params never among them.
        params = packed_of()
        if params is not None and kwargs.get("packed_seq_params") is None:
            kwargs["packed_seq_params"] = params
        return forward(self, *args, **kwargs)

    return wrapped


def multimodal_rope_wrapper(apply: Callable) -> Callable:
    """Wrap `apply_multimodal_rotary_pos_emb(q, k, cos, sin, use_fused_rope)`: packed q/k ([t, heads, dim]) get
    their batch dim back for the rope ([t, 1, heads, dim], as cos/sin are laid out) and lose it after."""

    @functools.wraps(apply)
    def wrapped(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if q.dim() != 3:
            return apply(q, k, cos, sin, *args, **kwargs)
        q_out, k_out = apply(q.unsqueeze(1), k.unsqueeze(1), cos, sin, *args, **kwargs)
        return q_out.squeeze(1), k_out.squeeze(1)

    return wrapped
