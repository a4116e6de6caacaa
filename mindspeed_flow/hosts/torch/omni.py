"""The Qwen2.5-Omni thinker split into three parts: an audio encoder, a vision encoder and the LLM backbone.

Each sample may carry images and/or audio clips. The audio part turns each clip's log-mel features into one
LM-sized row per audio placeholder token (the HF audio tower, run through the model's own
`get_audio_features`); the vision part is the ordinary `EncoderPart` over the thinker's ViT; the backbone
scatters both kinds of rows into a packed microbatch at their placeholder ids, so autograd hands each encoder
part's rows their own gradient. Positions are the model's own 3-D rope index per sample, audio lengths included.

As in `split.py`, no parameter is copied: the parts hold the thinker's submodules and cover it exactly once.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn

from mindspeed_flow.data.sample import VLMSample
from mindspeed_flow.hosts.torch import hf_compat
from mindspeed_flow.hosts.torch.packed import PackedBatch, restart_positions
from mindspeed_flow.hosts.torch.split import BackbonePart, EncoderPart, token_loss_sum

OMNI_FAMILY = "qwen2_5_omni_thinker"
Embeds = Mapping[str, Sequence[Optional[torch.Tensor]]]  # encoder part -> one tensor (or None) per sample


def _audio_of(sample: VLMSample) -> list[torch.Tensor]:
    return list(getattr(sample, "audio_features", None) or [])


def _audio_token_counts(sample: VLMSample) -> list[int]:
    return list(getattr(sample, "audio_token_counts", None) or [])


class AudioEncoderPart(nn.Module):
    """The audio tower: log-mel features [mel, frames] per clip -> [audio tokens, H_llm] per sample."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.audio_tower = hf_compat.encoder_modules(model, OMNI_FAMILY)["audio"]["audio_tower"]
        self._owner = (hf_compat.multimodal_owner(model),)  # a tuple: the thinker is not our submodule

    def forward(self, clips: Sequence[torch.Tensor]) -> torch.Tensor:
        """[sum of the clips' audio tokens, H_llm], clips in order."""
        device = next(self.parameters()).device
        longest = max(int(c.shape[-1]) for c in clips)
        # The model's batched input: clips right-padded to the longest, with a mask of the real frames.
        features = torch.zeros(len(clips), int(clips[0].shape[0]), longest, dtype=clips[0].dtype, device=device)
        mask = torch.zeros(len(clips), longest, dtype=torch.long, device=device)
        for i, c in enumerate(clips):
            features[i, :, :c.shape[-1]] = c.to(device)
            mask[i, :c.shape[-1]] = 1
        out = self._owner[0].get_audio_features(features.to(next(self.parameters()).dtype),
                                                feature_attention_mask=mask)
        return out if isinstance(out, torch.Tensor) else out.last_hidden_state  # 4.57: tensor; 5.x: ModelOutput

    def encode_many(self, samples: Sequence[VLMSample]) -> list[torch.Tensor]:
        """Several samples' clips in ONE forward, split back per sample."""
        if not samples:
            return []
        clips = [c for s in samples for c in _audio_of(s)]
        counts = [sum(_audio_token_counts(s)) for s in samples]
        if not clips:
            raise ValueError(f"audio encoder: samples {[s.sample_id for s in samples]} carry no audio features")
        rows = self(clips)
        if rows.shape[0] != sum(counts):
            raise ValueError(f"audio encoder: {rows.shape[0]} rows for samples {[s.sample_id for s in samples]} "
                             f"that hold {sum(counts)} audio tokens ({counts})")
        return list(torch.split(rows, counts, dim=0))


class OmniBackbonePart(BackbonePart):
    """The thinker's LLM on packed microbatches, taking image AND audio rows (`embeds[part][i]` for sample i)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.audio_token_id = int(model.config.audio_token_id)
        self.token_of = {"vision": self.image_token_id, "audio": self.audio_token_id}

    def pack(self, samples: Sequence[VLMSample], image_embeds: Optional[Any] = None,
             token_budget: int = 0) -> PackedBatch:
        """As `BackbonePart.pack`; `image_embeds` is the per-part mapping (its "vision" entry is checked by the
        base class, the "audio" one here)."""
        embeds: Embeds = image_embeds or {}
        for s, emb in zip(samples, embeds.get("audio", [None] * len(samples))):
            n = int((s.input_ids == self.audio_token_id).sum())
            declared = sum(_audio_token_counts(s))
            rows = 0 if emb is None else int(emb.shape[0])
            if n != declared or (image_embeds is not None and rows != n):
                raise ValueError(f"sample {s.sample_id}: {n} audio placeholder tokens, audio_token_counts sum "
                                 f"{declared}, {rows} audio embedding rows: all three must agree")
        vision = embeds.get("vision") if image_embeds is not None else None
        return super().pack(samples, vision, token_budget)

    def _position_ids(self, samples: Sequence[VLMSample], segment_ids: torch.Tensor) -> torch.Tensor:
        """Per sample, the thinker's own rope index (audio clips take their frame counts); plain elsewhere."""
        pos = restart_positions(segment_ids).view(1, 1, -1).repeat(3, 1, 1)  # text-only samples and padding
        start = 0
        for s in samples:
            n = s.llm_tokens
            frames = list(getattr(s, "audio_frames", None) or [])
            grid = s.image_grid_thw if s.image_grid_thw is not None and len(s.image_grid_thw) else None
            if grid is not None or frames:
                seqlens = torch.tensor(frames, dtype=torch.long) if frames else None
                ids = s.input_ids.reshape(1, -1)
                # an all-ones mask: the audio-only branch of the rope index reads positions from it
                p, _ = self._owner[0].get_rope_index(ids, image_grid_thw=grid, video_grid_thw=None,
                                                     attention_mask=torch.ones_like(ids),
                                                     use_audio_in_video=False, audio_seqlens=seqlens)
                pos[:, :, start:start + n] = p
            start += n
        return pos

    def image_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Where any encoder part's rows go (image and audio placeholders): a pipeline's stage 0 takes those
        positions from the dense input (`image_dense`), the others from the token embeddings."""
        return ((input_ids == self.image_token_id) | (input_ids == self.audio_token_id)).unsqueeze(-1)

    def embed(self, packed: PackedBatch, image_embeds: Optional[Any]) -> torch.Tensor:
        """Token embeddings with every part's rows scattered at its placeholder id, in packing order."""
        return self._scatter(self.embed_tokens(packed.input_ids), packed, image_embeds)

    def image_dense(self, packed: PackedBatch, image_embeds: Optional[Any]) -> torch.Tensor:
        """[1, T, H] zeros with every part's rows at its placeholders (pipeline stage-0 input)."""
        weight = self.embed_tokens.weight
        zeros = torch.zeros(1, packed.token_budget, self.hidden_size, dtype=weight.dtype, device=weight.device)
        return self._scatter(zeros, packed, image_embeds)

    def _scatter(self, hidden: torch.Tensor, packed: PackedBatch, image_embeds: Optional[Any]) -> torch.Tensor:
        for part, per_sample in (image_embeds or {}).items():
            rows = [e for e in per_sample if e is not None and e.shape[0]]
            mask = (packed.input_ids == self.token_of[part]).unsqueeze(-1)
            n = int(mask.sum())
            got = sum(int(e.shape[0]) for e in rows)
            if n != got:
                raise ValueError(f"microbatch {packed.sample_ids}: {n} {part} placeholder tokens but {got} rows")
            if rows:
                hidden = hidden.masked_scatter(mask, torch.cat(rows).to(hidden.device, hidden.dtype))
        return hidden

    def forward(self, packed: PackedBatch, image_embeds: Optional[Any] = None,
                inputs_embeds: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, int]:
        hidden = inputs_embeds if inputs_embeds is not None else self.embed(packed, image_embeds)
        hidden = self.run_layers(hidden, packed.position_ids, packed.segments, self.layers)
        return token_loss_sum(self.logits(hidden), packed.labels), packed.n_label_tokens


def unused_audio_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The audio tower's bos/eos embedding: built by the tower, read by no forward of the thinker."""
    tower = hf_compat.encoder_modules(model, OMNI_FAMILY)["audio"]["audio_tower"]
    bos_eos = getattr(tower, "audio_bos_eos_token", None)
    return list(bos_eos.parameters()) if bos_eos is not None else []


def split_omni(model: nn.Module) -> dict[str, nn.Module]:
    """{"audio": AudioEncoderPart, "vision": EncoderPart, "backbone": OmniBackbonePart} covering every parameter
    of the thinker exactly once (parameters on no path to the loss are frozen, as `split_vlm` does)."""
    for p in unused_audio_parameters(model):
        p.requires_grad_(False)
    parts: dict[str, nn.Module] = {"audio": AudioEncoderPart(model), "vision": EncoderPart(model),
                                   "backbone": OmniBackbonePart(model)}
    seen: dict[int, str] = {}
    for name, part in parts.items():
        for p in part.parameters():
            if id(p) in seen:
                raise RuntimeError(f"parts {seen[id(p)]} and {name} share a parameter; it would be updated twice")
            seen[id(p)] = name
    missing = [n for n, p in model.named_parameters() if id(p) not in seen]
    if missing:
        raise RuntimeError(f"{type(model).__name__}: parameters {missing[:5]} belong to no part")
    return parts
