"""Split a whole HF VLM into the encoder part and the backbone part, sharing its parameter tensors.

The split is exact: `EncoderPart` computes the image embeddings with the model's own `get_image_features`
(the call the whole model makes before scattering), and `BackbonePart` scatters them with the same
`masked_scatter`, computes the same rotary embeddings from the same position ids, and runs the very decoder
layer modules of the model. For one unpadded sample the loss and every parameter gradient equal the whole
model's; for packed microbatches the only difference is the attention kernel's summation order.

No parameter is copied: both parts hold references to the model's submodules, so an optimizer over
`encoder.parameters()` and one over `backbone.parameters()` together cover the model exactly once (a tied
lm_head / embed_tokens is one parameter of the backbone).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mindspeed_flow.data.sample import IGNORE_INDEX, VLMSample
from mindspeed_flow.hosts.torch import attention, hf_compat
from mindspeed_flow.hosts.torch.attention import Segments
from mindspeed_flow.hosts.torch.packed import (PackedBatch, check_pack_fits, cu_seqlens_for, pad_tail,
                                               restart_positions, segment_ids_for, shifted_labels)


class EncoderPart(nn.Module):
    """Vision encoder + projector/merger: pixels -> LM-sized image embeddings, one row per placeholder token."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.family = hf_compat.family_of(model)
        for name, module in hf_compat.vision_modules(model, self.family).items():
            self.add_module(name, module)
        # Held in a tuple so the base model is not registered as a submodule (its LM parameters are not ours).
        self._owner = (hf_compat.multimodal_owner(model),)

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[n_image_tokens_total, H_llm], images in input order, tokens in the order the model scatters them."""
        device = self._device()
        grid = image_grid_thw.to(device) if image_grid_thw is not None else None
        return hf_compat.image_features(self._owner[0], self.family, pixel_values.to(device), grid)

    def encode_many(self, samples: Sequence[VLMSample]) -> list[torch.Tensor]:
        """Several samples' images in ONE forward, split back per sample: [image tokens of sample i, H_llm] each.

        Qwen's ViT takes the images' patches concatenated with their grids (it attends within each image by the
        grids' boundaries); LLaVA's tower takes the images stacked (one size after preprocessing).
        """
        if not samples:
            return []
        pixels = torch.cat([s.pixel_values for s in samples], dim=0)
        grids = [s.image_grid_thw for s in samples]
        grid = torch.cat(grids, dim=0) if all(g is not None for g in grids) else None
        rows = self(pixels, grid)
        counts = [sum(s.image_token_counts) for s in samples]
        if sum(counts) != rows.shape[0]:
            raise ValueError(f"encoder: {rows.shape[0]} embedding rows for samples "
                             f"{[s.sample_id for s in samples]} that hold {sum(counts)} image tokens ({counts})")
        return list(torch.split(rows, counts, dim=0))

    def _device(self) -> torch.device:
        p = next(self.parameters(), None)
        return p.device if p is not None else torch.device("cpu")


class BackbonePart(nn.Module):
    """Token embeddings, decoder layers, final norm and lm_head, run on packed microbatches."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.family = hf_compat.family_of(model)
        self.mrope = self.family in hf_compat.MROPE_FAMILIES
        lm = hf_compat.language_model(model)
        self.embed_tokens = lm.embed_tokens
        self.layers = lm.layers
        self.norm = lm.norm
        self.rotary_emb = lm.rotary_emb
        self.lm_head = hf_compat.lm_head(model)
        self._owner = (hf_compat.multimodal_owner(model),)
        self.image_token_id = hf_compat.image_token_id(model.config)
        # Packed microbatches attend through a varlen kernel; the whole model keeps its own implementation.
        self.attn_implementation = attention.install(lm.config)
        self.vocab_size = int(self.lm_head.out_features)
        self.hidden_size = int(self.embed_tokens.embedding_dim)
        # Qwen3-VL: D deepstack maps ride in each image row after the merged embedding (see hf_compat)
        self.deepstack = hf_compat.deepstack_layers(model.config)
        self.embed_width = self.hidden_size * (1 + self.deepstack)
        self.pad_token_id = self._pick_pad_id(lm.config)
        vision_config = getattr(model.config, "vision_config", None)
        self.merge_size = int(getattr(vision_config, "spatial_merge_size", 1) or 1)

    def _pick_pad_id(self, text_config) -> int:
        pad = getattr(text_config, "pad_token_id", None)
        # The padding tail must never look like an image placeholder (the scatter counts those).
        return 0 if pad is None or int(pad) == self.image_token_id else int(pad)

    @property
    def tied_embeddings(self) -> bool:
        return self.lm_head.weight is self.embed_tokens.weight

    # ---- packing -------------------------------------------------------------------------------------------
    def pack(self, samples: Sequence[VLMSample], image_embeds: Optional[Sequence[Optional[torch.Tensor]]] = None,
             token_budget: int = 0) -> PackedBatch:
        """One packed microbatch of exactly `token_budget` tokens (zero samples gives an all-padding batch)."""
        seq_lens = [s.llm_tokens for s in samples]
        sample_ids = [s.sample_id for s in samples]
        check_pack_fits(sample_ids, seq_lens, token_budget)
        counts = [self._image_tokens_of(s) for s in samples]
        if image_embeds is not None:
            self._check_embeds(sample_ids, counts, image_embeds)
        n_pad = token_budget - sum(seq_lens)
        # Built on the CPU (rope index and segment bookkeeping are small integer work), then moved once.
        segment_ids = segment_ids_for(seq_lens, token_budget)
        input_ids = pad_tail(_cat_or_empty([s.input_ids for s in samples]), n_pad, self.pad_token_id)
        labels = pad_tail(_cat_or_empty([shifted_labels(s.labels) for s in samples]), n_pad, IGNORE_INDEX)
        return PackedBatch(
            input_ids=input_ids.view(1, -1),
            labels=labels.view(1, -1),
            position_ids=self._position_ids(samples, segment_ids),
            segment_ids=segment_ids,
            cu_seqlens=cu_seqlens_for(seq_lens, token_budget),
            seq_lens=seq_lens,
            sample_ids=sample_ids,
            image_token_counts=counts,
            n_label_tokens=int((labels != IGNORE_INDEX).sum()),
            token_budget=token_budget,
        ).to(self.embed_tokens.weight.device)

    def _image_tokens_of(self, sample: VLMSample) -> int:
        """Placeholder count of one sample, checked against its image metadata (a clear error beats an
        index error deep inside the model's rope index)."""
        n = int((sample.input_ids == self.image_token_id).sum())
        declared = list(sample.image_token_counts)
        if (declared or n) and sum(declared) != n:
            raise ValueError(f"sample {sample.sample_id}: {n} image placeholder tokens in input_ids but "
                             f"image_token_counts={declared} (sum {sum(declared)})")
        if self.mrope and n:
            grid = sample.image_grid_thw
            per_image = [] if grid is None else (grid.prod(-1) // self.merge_size ** 2).tolist()
            if per_image != declared:
                raise ValueError(f"sample {sample.sample_id}: image_grid_thw gives {per_image} LLM tokens per image "
                                 f"(t*h*w / {self.merge_size}^2) but image_token_counts={declared}")
        return n

    def _check_embeds(self, sample_ids: Sequence[int], counts: Sequence[int],
                      image_embeds: Sequence[Optional[torch.Tensor]]) -> None:
        if len(image_embeds) != len(counts):
            raise ValueError(f"pack: {len(image_embeds)} image embedding entries for {len(counts)} samples")
        for sid, n, emb in zip(sample_ids, counts, image_embeds):
            rows = 0 if emb is None else int(emb.shape[0])
            if rows != n or (emb is not None and emb.shape[-1] != self.embed_width):
                shape = None if emb is None else tuple(emb.shape)
                raise ValueError(f"sample {sid}: {n} image placeholder tokens but image embeddings of shape {shape} "
                                 f"(need [{n}, {self.embed_width}])")

    def _position_ids(self, samples: Sequence[VLMSample], segment_ids: torch.Tensor) -> torch.Tensor:
        flat = restart_positions(segment_ids)  # text-only samples and the padding tail: plain arange
        if not self.mrope:
            return flat
        pos = flat.view(1, 1, -1).repeat(3, 1, 1)
        start = 0
        for s in samples:
            n = s.llm_tokens
            if s.image_grid_thw is not None and len(s.image_grid_thw):  # grids suffice: backbone ranks load no pixels
                pos[:, :, start:start + n] = hf_compat.rope_index(self._owner[0], s.input_ids, s.image_grid_thw,
                                                                  self.image_token_id)
            start += n
        return pos

    # ---- embedding -----------------------------------------------------------------------------------------
    def image_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (input_ids == self.image_token_id).unsqueeze(-1)

    def embed(self, packed: PackedBatch, image_embeds: Optional[Sequence[Optional[torch.Tensor]]]) -> torch.Tensor:
        """inputs_embeds [1, T, H]: token embeddings with each sample's image embeddings scattered in.

        Autograd reaches every sample's embeddings tensor (and embed_tokens), so d(loss)/d(embedding) per
        sample is that tensor's .grad after backward.
        """
        text = self.embed_tokens(packed.input_ids)
        rows = _image_rows(packed, image_embeds, text)
        if rows is None:
            return text
        rows = rows[:, :self.hidden_size]  # the deepstack maps after it join later (`deepstack_rows`)
        return text.masked_scatter(self.image_mask(packed.input_ids), rows.to(text.dtype))

    def deepstack_rows(self, packed: PackedBatch,
                       image_embeds: Optional[Sequence[Optional[torch.Tensor]]]) -> Optional[torch.Tensor]:
        """[D, n_image_tokens, H]: the deepstack maps of the microbatch's image rows, in placeholder order (None
        without deepstack or images). Slices of the received rows, so their gradients reach the producer."""
        if not self.deepstack:
            return None
        rows = _image_rows(packed, image_embeds, self.embed_tokens.weight)
        if rows is None:
            return None
        return rows[:, self.hidden_size:].reshape(rows.shape[0], self.deepstack, self.hidden_size).transpose(0, 1)

    def image_dense(self, packed: PackedBatch,
                    image_embeds: Optional[Sequence[Optional[torch.Tensor]]]) -> torch.Tensor:
        """[1, T, H] zeros with the image embeddings at the placeholder positions (pipeline stage-0 input)."""
        zeros = torch.zeros(1, packed.token_budget, self.hidden_size, dtype=self.embed_tokens.weight.dtype,
                            device=self.embed_tokens.weight.device)
        rows = _image_rows(packed, image_embeds, zeros)
        if rows is None:
            return zeros
        if self.deepstack:  # a stage boundary would have to carry the maps to layers 0..D-1
            raise ValueError("a pipelined backbone with deepstack image rows (Qwen3-VL) is not supported")
        return zeros.masked_scatter(self.image_mask(packed.input_ids), rows.to(zeros.dtype))

    def embed_dense(self, input_ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """Token embeddings where the placeholders take `dense` (same values and gradients as `embed`)."""
        return torch.where(self.image_mask(input_ids), dense, self.embed_tokens(input_ids))

    # ---- decoder -------------------------------------------------------------------------------------------
    def run_layers(self, hidden: torch.Tensor, position_ids: torch.Tensor, segments: Segments,
                   layers: Sequence[nn.Module], deepstack: Optional[torch.Tensor] = None,
                   image_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`layers` over one packed microbatch; attention stays within each of `segments` (varlen kernel).

        `deepstack` [D, n_image_tokens, H] (with `image_mask` [1, T]): map i is added at the image positions after
        layer i, as Qwen3-VL's text model does (`layers` must then start at layer 0)."""
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for i, layer in enumerate(layers):
            hidden = hf_compat.call_decoder_layer(layer, hidden, None, position_embeddings, segments=segments)
            if deepstack is not None and i < deepstack.shape[0]:
                hidden = hidden.clone()  # autograd needs the layer's output intact
                hidden[image_mask] = hidden[image_mask] + deepstack[i].to(hidden.dtype)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def forward(self, packed: PackedBatch, image_embeds: Optional[Sequence[Optional[torch.Tensor]]] = None,
                inputs_embeds: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, int]:
        """(loss_sum, n_label_tokens): summed token cross entropy of one packed microbatch."""
        hidden = inputs_embeds if inputs_embeds is not None else self.embed(packed, image_embeds)
        deepstack = self.deepstack_rows(packed, image_embeds)
        if deepstack is not None and inputs_embeds is not None:
            raise ValueError("a deepstack model takes its image rows, not ready inputs_embeds")
        mask = self.image_mask(packed.input_ids)[..., 0] if deepstack is not None else None
        hidden = self.run_layers(hidden, packed.position_ids, packed.segments, self.layers, deepstack, mask)
        return token_loss_sum(self.logits(hidden), packed.labels), packed.n_label_tokens


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of cross entropy over label tokens (labels already shifted); 0 when there are none."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def _cat_or_empty(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _image_rows(packed: PackedBatch, image_embeds: Optional[Sequence[Optional[torch.Tensor]]],
                like: torch.Tensor) -> Optional[torch.Tensor]:
    """All samples' image embeddings concatenated in packing order, or None when the batch has no images."""
    n_image = sum(packed.image_token_counts)
    if n_image == 0:
        return None
    if image_embeds is None:
        raise ValueError(f"microbatch with samples {packed.sample_ids} has {n_image} image tokens but no image "
                         f"embeddings were given")
    if len(image_embeds) != packed.n_samples:
        raise ValueError(f"{len(image_embeds)} image embedding entries for the {packed.n_samples} samples "
                         f"{packed.sample_ids}")
    parts = []
    for sid, n, emb in zip(packed.sample_ids, packed.image_token_counts, image_embeds):
        rows = 0 if emb is None else int(emb.shape[0])
        if rows != n:
            raise ValueError(f"sample {sid}: {n} image placeholder tokens but {rows} image embedding rows")
        if emb is not None and n:
            parts.append(emb.to(like.device))
    return torch.cat(parts, dim=0)


def split_vlm(model: nn.Module) -> tuple[EncoderPart, BackbonePart]:
    """(EncoderPart, BackbonePart) sharing the model's parameters; together they cover every parameter once.

    Encoder parameters that are on no path to the loss (`hf_compat.unused_vision_parameters`, e.g. CLIP's
    post_layernorm in LLaVA) are frozen: they never get a gradient, so an optimizer never changes them anyway,
    and DDP (which waits for a gradient of every trainable parameter) then needs no find_unused_parameters.
    """
    family = hf_compat.family_of(model)
    for p in hf_compat.unused_vision_parameters(model, family):
        p.requires_grad_(False)
    encoder, backbone = EncoderPart(model), BackbonePart(model)
    enc_ids = {id(p) for p in encoder.parameters()}
    shared = [n for n, p in backbone.named_parameters() if id(p) in enc_ids]
    if shared:
        raise RuntimeError(f"encoder and backbone parts share parameters {shared}; the split would update them twice")
    covered = enc_ids | {id(p) for p in backbone.parameters()}
    missing = [n for n, p in model.named_parameters() if id(p) not in covered]
    if missing:
        raise RuntimeError(f"{type(model).__name__}: parameters {missing[:5]} belong to neither the encoder nor the "
                           f"backbone part; hf_compat does not know this model layout")
    return encoder, backbone
