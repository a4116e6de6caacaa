"""Architecture specs of the two parts of a VLM, with exact parameter counts and their FLOP formulas.

Pure computation (no torch). Shared by the packing cost model, the planner and the MFU estimate, so the
three always agree. `VLMSpec.from_hf_config` reads a HF transformers config (object or dict) of Qwen2-VL,
Qwen2.5-VL or LLaVA.

FLOPs (training, forward + backward = 3x forward):
  LLM sample of l tokens      : 6 * P_llm * l + 6 * L * h * l^2          (causal attention)
  ViT image of p patches      : 6 * P_vit * p + 12 * L_v * h_v * p * min(p, w) summed over layers, w = window
A frozen part runs forward only: one third of the above (2x its parameters per token instead of 6x).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

# family -> its encoder parts, in part order; a family not listed has one encoder part, "encoder" (vision)
ENCODER_PARTS: dict[str, tuple[str, ...]] = {"qwen2_5_omni_thinker": ("audio", "vision")}


def encoder_parts(family: str) -> tuple[str, ...]:
    """The names of a family's encoder parts: ("encoder",) for a VLM, ("audio", "vision") for the Omni thinker."""
    return ENCODER_PARTS.get(family, ("encoder",))


@dataclass(frozen=True)
class LLMSpec:
    """Decoder-only LLM backbone (Llama/Qwen2 family: RMSNorm, GQA, gated MLP)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_embeddings: bool = False
    qkv_bias: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * h + 2 * h * kv + h * h  # q, k, v, o
        if self.qkv_bias:
            attn += h + 2 * kv
        mlp = 3 * h * self.ffn_hidden_size  # gate, up, down
        norms = 2 * h
        return attn + mlp + norms

    @property
    def non_embedding_params(self) -> int:
        return self.num_layers * self.layer_params + self.hidden_size  # + final norm

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        return 0 if self.tie_embeddings else self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        return self.non_embedding_params + self.embedding_params + self.head_params

    @property
    def flops_params(self) -> int:
        """P_llm: non-embedding parameters plus the output head (always computed, tied or not)."""
        return self.non_embedding_params + self.vocab_size * self.hidden_size

    def linear_flops_per_token(self, trainable: bool = True) -> float:
        return (6.0 if trainable else 2.0) * self.flops_params

    def attn_flops_per_token_sq(self, trainable: bool = True) -> float:
        return (6.0 if trainable else 2.0) * self.num_layers * self.hidden_size

    def sample_flops(self, tokens: int, trainable: bool = True) -> float:
        return self.linear_flops_per_token(trainable) * tokens + self.attn_flops_per_token_sq(trainable) * tokens**2


@dataclass(frozen=True)
class VisionSpec:
    """Vision encoder + projector (Qwen2-VL / Qwen2.5-VL ViT with patch merger, or CLIP + LLaVA projector)."""

    kind: str  # "qwen2_vl" | "qwen2_5_vl" | "clip"
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int  # LLM hidden size the projector maps to
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    window_size: int = 0  # Qwen2.5-VL window in pixels (112): windowed layers attend within it
    fullatt_block_indexes: tuple[int, ...] = field(default_factory=tuple)
    image_size: int = 0  # CLIP only: fixed square input
    projector_hidden: int = 0  # CLIP/LLaVA only: hidden of the 2-layer projector (= LLM hidden by default)

    @property
    def params(self) -> int:
        d, i = self.hidden_size, self.intermediate_size
        if self.kind == "clip":
            n_patches = (self.image_size // self.patch_size) ** 2
            emb = self.in_channels * self.patch_size**2 * d + d + (n_patches + 1) * d
            layer = 4 * (d * d + d) + (d * i + i) + (i * d + d) + 4 * d
            proj_h = self.projector_hidden or self.out_hidden_size
            proj = d * proj_h + proj_h + proj_h * self.out_hidden_size + self.out_hidden_size
            return emb + 2 * d + self.depth * layer + 2 * d + proj
        patch = self.in_channels * self.temporal_patch_size * self.patch_size**2 * d
        attn = d * 3 * d + 3 * d + d * d + d
        if self.kind == "qwen2_5_vl":
            mlp = 2 * (d * i + i) + (i * d + d)  # gated, with bias
            norms = 2 * d  # RMSNorm
            merger_norm = d
        else:
            mlp = (d * i + i) + (i * d + d)
            norms = 4 * d  # LayerNorm with bias
            merger_norm = 2 * d
        m = d * self.spatial_merge_size**2
        merger = merger_norm + (m * m + m) + (m * self.out_hidden_size + self.out_hidden_size)
        return patch + self.depth * (attn + mlp + norms) + merger

    @property
    def window_patches(self) -> int:
        if self.kind != "qwen2_5_vl" or not self.window_size:
            return 0
        side = self.window_size // self.patch_size
        return side * side

    def llm_tokens_per_image(self, patches: int) -> int:
        if self.kind == "clip":
            return patches
        return patches // self.spatial_merge_size**2

    def image_flops(self, patches: int, trainable: bool = True) -> float:
        mult = 6.0 if trainable else 2.0
        linear = mult * self.params * patches
        full_layers = self.depth
        windowed = 0
        if self.window_patches:
            full_layers = len(self.fullatt_block_indexes)
            windowed = self.depth - full_layers
        # 12 = 2 matmuls (QK^T, AV) x 2 FLOPs x 3 (fwd+bwd), full (non-causal) attention.
        attn_mult = 12.0 if trainable else 4.0
        attn = attn_mult * self.hidden_size * patches * (
            full_layers * patches + windowed * min(patches, self.window_patches or patches)
        )
        return linear + attn


@dataclass(frozen=True)
class AudioSpec:
    """A Whisper-style audio encoder (the Qwen2.5-Omni thinker's audio tower): two convolutions, pre-norm
    layers (k projection without bias), final LayerNorm and projection to the LLM width."""

    num_mel_bins: int
    d_model: int
    layers: int
    ffn: int
    output_dim: int
    heads: int = 0  # attention heads per layer (what tensor parallelism splits)

    @property
    def params(self) -> int:
        d, f = self.d_model, self.ffn
        convs = (self.num_mel_bins * d * 3 + d) + (d * d * 3 + d)
        layer = 4 * d * d + 3 * d + 2 * 2 * d + (d * f + f) + (f * d + d)
        return convs + 2 * self.output_dim + self.layers * layer + 2 * d + d * self.output_dim + self.output_dim


@dataclass(frozen=True)
class VLMSpec:
    name: str
    vision: VisionSpec
    llm: LLMSpec
    image_token_id: int | None = None
    audio: AudioSpec | None = None  # models with an audio encoder part (the Omni thinker); not in FLOPs yet

    @property
    def total_params(self) -> int:
        return self.vision.params + self.llm.total_params + (self.audio.params if self.audio else 0)

    @staticmethod
    def from_hf_config(config: Any, name: str | None = None) -> "VLMSpec":
        """Build from a transformers config object or its dict (`config.json`)."""
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        model_type = cfg.get("model_type", "")
        text = cfg.get("text_config") or cfg
        if not isinstance(text, Mapping):
            text = text.to_dict()
        llm = LLMSpec(
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=int(text["hidden_size"]),
            ffn_hidden_size=int(text["intermediate_size"]),
            num_heads=int(text["num_attention_heads"]),
            num_kv_heads=int(text.get("num_key_value_heads") or text["num_attention_heads"]),
            vocab_size=int(text.get("vocab_size") or cfg["vocab_size"]),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            # Qwen2-family text models always carry q/k/v biases, also when wrapped by LLaVA.
            qkv_bias=(model_type.startswith("qwen") or str(text.get("model_type", "")).startswith("qwen2")
                      or bool(text.get("attention_bias", False))),
        )
        v = cfg["vision_config"]
        if model_type == "qwen2_vl":
            vision = VisionSpec(
                kind="qwen2_vl", depth=int(v["depth"]), hidden_size=int(v["embed_dim"]),
                intermediate_size=int(v["embed_dim"] * v.get("mlp_ratio", 4)), num_heads=int(v["num_heads"]),
                out_hidden_size=int(v.get("hidden_size", llm.hidden_size)), patch_size=int(v["patch_size"]),
                temporal_patch_size=int(v["temporal_patch_size"]), in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
                spatial_merge_size=int(v["spatial_merge_size"]),
            )
        elif model_type in ("qwen2_5_vl", "qwen2_5_omni_thinker"):  # the Omni thinker's ViT is Qwen2.5-VL's
            vision = VisionSpec(
                kind="qwen2_5_vl", depth=int(v["depth"]), hidden_size=int(v["hidden_size"]),
                intermediate_size=int(v["intermediate_size"]), num_heads=int(v["num_heads"]),
                out_hidden_size=int(v["out_hidden_size"]), patch_size=int(v["patch_size"]),
                temporal_patch_size=int(v["temporal_patch_size"]), in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
                spatial_merge_size=int(v["spatial_merge_size"]), window_size=int(v.get("window_size", 0)),
                fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", ())),
            )
        elif model_type == "llava":
            vision = VisionSpec(
                kind="clip", depth=int(v["num_hidden_layers"]), hidden_size=int(v["hidden_size"]),
                intermediate_size=int(v["intermediate_size"]), num_heads=int(v["num_attention_heads"]),
                out_hidden_size=llm.hidden_size, patch_size=int(v["patch_size"]),
                in_channels=int(v.get("num_channels", 3)), image_size=int(v["image_size"]), spatial_merge_size=1,
            )
        else:
            raise ValueError(f"unsupported model_type {model_type!r}: expected qwen2_vl, qwen2_5_vl or llava")
        a = cfg.get("audio_config")
        audio = None if not a else AudioSpec(
            num_mel_bins=int(a["num_mel_bins"]), d_model=int(a["d_model"]), layers=int(a["encoder_layers"]),
            ffn=int(a["encoder_ffn_dim"]), output_dim=int(a["output_dim"]), heads=int(a["encoder_attention_heads"]))
        return VLMSpec(name=name or model_type, vision=vision, llm=llm,
                       image_token_id=cfg.get("image_token_id", cfg.get("image_token_index")), audio=audio)
