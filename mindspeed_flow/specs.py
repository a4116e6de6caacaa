"""Architecture specs of the two parts of a VLM, with exact parameter counts and their FLOP formulas.

Pure computation (no torch). Shared by the packing cost model, the planner and the MFU estimate, so the
three always agree. `VLMSpec.from_hf_config` reads a HF transformers config (object or dict) of Qwen2-VL,
Qwen2.5-VL, the Qwen2.5-Omni thinker, Qwen3-VL (dense and MoE), GLM-4.5V, LLaVA or InternVL.

FLOPs (training, forward + backward = 3x forward):
  LLM sample of l tokens      : 6 * P_llm * l + 6 * L * q * l^2          (causal attention, q = heads x head_dim)
  P_llm of a MoE LLM          : its ACTIVE parameters (top-k routed experts + shared expert + router, attention,
                                dense layers, head); its TOTAL parameters are what memory holds
  ViT image of p patches      : 6 * P_vit * p + 12 * L_v * h_v * p * min(p, w) summed over layers, w = window
  audio clip of F mel frames  : 6 * (P_conv1 * F + (P_conv2 + L_a * P_layer) * T + P_head * A)
                                + 12 * L_a * d_a * sum over chunks of c^2   (the Omni thinker's audio encoder)
                                T = (F - 1) // 2 + 1 frames after the convolutions (conv2 has stride 2), A = (T - 2)
                                // 2 + 1 LLM tokens after the stride-2 average pool (P_head: ln_post + proj run on
                                those), chunks: the clip cut into windows of 2 x n_window mel frames (c = each
                                window's frames after the convolutions); attention is full within a chunk only
A frozen part runs forward only: one third of the above (2x its parameters per token instead of 6x).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from mindspeed_flow.data.shapes import audio_conv_frames, audio_llm_tokens

# family -> its encoder parts, in part order; a family not listed has one encoder part, "encoder" (vision)
ENCODER_PARTS: dict[str, tuple[str, ...]] = {"qwen2_5_omni_thinker": ("audio", "vision")}


# families whose ViT also hands deepstack maps (features of some ViT layers) to the first LLM layers (Qwen3-VL)
DEEPSTACK_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")


def encoder_parts(family: str) -> tuple[str, ...]:
    """The names of a family's encoder parts: ("encoder",) for a VLM, ("audio", "vision") for the Omni thinker."""
    return ENCODER_PARTS.get(family, ("encoder",))


@dataclass(frozen=True)
class LLMSpec:
    """Decoder-only LLM backbone (Llama/Qwen2/Qwen3/GLM family: RMSNorm, GQA, gated MLP), dense or MoE.

    MoE (num_experts > 0): the first `dense_layers` layers keep a dense gated MLP of `ffn_hidden_size`; every
    other layer has a router (num_experts x hidden), `num_experts` routed experts of `moe_ffn_hidden_size`, of
    which `experts_per_token` run per token, and an always-on shared expert of `shared_ffn_hidden_size` (GLM).
    Parameter counts are TOTAL (what weights and optimizer states hold); FLOPs use the ACTIVE parameters
    (`flops_params`: the experts a token does not visit cost it nothing)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_embeddings: bool = False
    qkv_bias: bool = True
    head_size: int = 0  # attention head width when not hidden / heads (Qwen3, GLM-4.5); 0: hidden / heads
    qk_norm: bool = False  # per-head RMSNorm of q and k (Qwen3)
    num_experts: int = 0  # routed experts per MoE layer; 0: dense
    experts_per_token: int = 0
    moe_ffn_hidden_size: int = 0
    shared_ffn_hidden_size: int = 0  # shared experts' total width (n_shared_experts x moe width)
    dense_layers: int = 0  # leading layers with a dense MLP (GLM's first_k_dense_replace)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.dense_layers if self.is_moe else 0

    @property
    def attn_params(self) -> int:
        """q, k, v, o (+ biases, + q/k norms) and the two RMSNorms of one layer."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * self.head_dim
        return attn + 2 * h

    @property
    def expert_params(self) -> int:
        """One routed expert (gate, up, down)."""
        return 3 * self.hidden_size * self.moe_ffn_hidden_size

    @property
    def moe_layer_params(self) -> int:
        """A MoE layer's total: attention, router, every routed expert and the shared expert."""
        h = self.hidden_size
        return (self.attn_params + self.num_experts * h + self.num_experts * self.expert_params
                + 3 * h * self.shared_ffn_hidden_size)

    @property
    def dense_layer_params(self) -> int:
        return self.attn_params + 3 * self.hidden_size * self.ffn_hidden_size

    @property
    def routed_expert_params(self) -> int:
        """All routed experts of all layers: what expert parallelism divides."""
        return self.moe_layers * self.num_experts * self.expert_params

    @property
    def layer_params(self) -> int:
        """Parameters of one layer (MoE: the mean over layers, dense and MoE, of the total)."""
        if not self.is_moe:
            return self.dense_layer_params
        dense = self.num_layers - self.moe_layers
        return (dense * self.dense_layer_params + self.moe_layers * self.moe_layer_params) // self.num_layers

    @property
    def non_embedding_params(self) -> int:
        layers = (self.num_layers - self.moe_layers) * self.dense_layer_params + self.moe_layers * self.moe_layer_params
        return layers + self.hidden_size  # + final norm

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
    def inactive_params(self) -> int:
        """Routed experts a token skips: (experts - top-k) per MoE layer."""
        return self.moe_layers * (self.num_experts - self.experts_per_token) * self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters one token uses (embedding and head included): total minus the experts it skips."""
        return self.total_params - self.inactive_params

    @property
    def active_ffn_hidden_size(self) -> int:
        """MLP width one token passes through in a MoE layer (top-k experts + shared); the dense width otherwise."""
        if not self.is_moe:
            return self.ffn_hidden_size
        return self.experts_per_token * self.moe_ffn_hidden_size + self.shared_ffn_hidden_size

    @property
    def flops_params(self) -> int:
        """P_llm: active non-embedding parameters plus the output head (always computed, tied or not)."""
        return self.non_embedding_params - self.inactive_params + self.vocab_size * self.hidden_size

    def linear_flops_per_token(self, trainable: bool = True) -> float:
        return (6.0 if trainable else 2.0) * self.flops_params

    def attn_flops_per_token_sq(self, trainable: bool = True) -> float:
        # QK^T and AV run at the query width (heads x head_dim), wider than hidden in GLM-4.5 and Qwen3-30B-A3B
        return (6.0 if trainable else 2.0) * self.num_layers * self.num_heads * self.head_dim

    def sample_flops(self, tokens: int, trainable: bool = True) -> float:
        return self.linear_flops_per_token(trainable) * tokens + self.attn_flops_per_token_sq(trainable) * tokens**2


@dataclass(frozen=True)
class VisionSpec:
    """Vision encoder + projector: Qwen2-VL / Qwen2.5-VL / Qwen3-VL / GLM-4.xV ViT with patch merger, CLIP + LLaVA
    projector, or InternViT + InternVL's pixel-shuffle MLP projector."""

    kind: str  # "qwen2_vl" | "qwen2_5_vl" | "qwen3_vl" | "glm4v" | "clip" | "internvl"
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
    image_size: int = 0  # CLIP / InternViT / GLM: the square input the position table covers
    projector_hidden: int = 0  # CLIP/LLaVA/InternVL: projector hidden (= LLM hidden by default); GLM: merger MLP
    position_embeddings: int = 0  # Qwen3-VL: learned (interpolated) position table rows
    deepstack_layers: int = 0  # Qwen3-VL: layers whose features also go to the LLM, each through its own merger

    @property
    def first_params(self) -> int:
        """Patch embedding (and position table, CLS token): on the first layer's device."""
        d = self.hidden_size
        if self.kind in ("clip", "internvl"):
            n_patches = (self.image_size // self.patch_size) ** 2
            emb = self.in_channels * self.patch_size**2 * d + d + (n_patches + 1) * d
            return emb + (2 * d if self.kind == "clip" else d)  # CLIP: pre-LayerNorm; InternViT: CLS token
        patch = self.in_channels * self.temporal_patch_size * self.patch_size**2 * d
        if self.kind == "qwen3_vl":
            return patch + d + self.position_embeddings * d  # conv bias + position table
        if self.kind == "glm4v":
            return patch + d + (self.image_size // self.patch_size) ** 2 * d
        return patch

    @property
    def layer_params(self) -> int:
        d, i = self.hidden_size, self.intermediate_size
        if self.kind == "glm4v":  # no biases, RMSNorm, SwiGLU
            return 4 * d * d + 3 * d * i + 2 * d
        attn = 4 * (d * d + d)
        if self.kind == "internvl":  # q, k, v without bias; two layer-scale vectors
            attn = 4 * d * d + d + 2 * d
        if self.kind == "qwen2_5_vl":
            return attn + 2 * (d * i + i) + (i * d + d) + 2 * d  # gated, with bias; RMSNorm
        return attn + (d * i + i) + (i * d + d) + 4 * d  # LayerNorm with bias

    @property
    def last_params(self) -> int:
        """After the last layer: the patch merger / projector (and Qwen3-VL's deepstack mergers)."""
        d, o = self.hidden_size, self.out_hidden_size
        m = d * self.spatial_merge_size**2
        if self.kind == "clip":
            h = self.projector_hidden or o
            return 2 * d + d * h + h + h * o + o  # post-LayerNorm + 2-layer projector
        if self.kind == "internvl":
            h = self.projector_hidden or o
            return 2 * m + m * h + h + h * o + o  # LayerNorm + MLP on the pixel-shuffled features
        if self.kind == "glm4v":
            # post-layer RMSNorm, 2 x 2 conv downsample to the LLM width, then the merger: a linear, LayerNorm and
            # a SwiGLU of projector_hidden
            return 2 * d + m * o + o + o * o + 2 * o + 3 * o * self.projector_hidden
        mlp = (m * m + m) + (m * o + o)
        norm = d if self.kind == "qwen2_5_vl" else 2 * d
        deepstack = self.deepstack_layers * (2 * m + mlp)  # each: LayerNorm over the merged features + MLP
        return norm + mlp + deepstack

    @property
    def params(self) -> int:
        return self.first_params + self.depth * self.layer_params + self.last_params

    @property
    def embedding_tensors(self) -> int:
        """Feature tensors per LLM token handed to the LLM: the merger's output plus one per deepstack layer."""
        return 1 + self.deepstack_layers

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
    layers (k projection without bias), a stride-2 average pool, final LayerNorm and projection to the LLM width.

    A clip is cut into chunks of 2 x n_window mel frames (the last one shorter); the layers run on every chunk's
    frames packed together and attend within a chunk only. The positional embedding is a sinusoidal buffer (no
    parameters)."""

    num_mel_bins: int
    d_model: int
    layers: int
    ffn: int
    output_dim: int
    heads: int = 0  # attention heads per layer (what tensor parallelism splits)
    n_window: int = 100  # half a chunk, in mel frames

    @property
    def conv1_params(self) -> int:
        return self.num_mel_bins * self.d_model * 3 + self.d_model

    @property
    def conv2_params(self) -> int:
        return self.d_model * self.d_model * 3 + self.d_model

    @property
    def first_params(self) -> int:
        """The convolutions and the audio BOS/EOS embedding: on the part's input side."""
        return self.conv1_params + self.conv2_params + 2 * self.output_dim

    @property
    def layer_params(self) -> int:
        d, f = self.d_model, self.ffn
        return 4 * d * d + 3 * d + 2 * 2 * d + (d * f + f) + (f * d + d)

    @property
    def last_params(self) -> int:
        """ln_post and the projection to the LLM width (after the pool)."""
        return 2 * self.d_model + self.d_model * self.output_dim + self.output_dim

    @property
    def params(self) -> int:
        return self.first_params + self.layers * self.layer_params + self.last_params

    def chunk_frames(self, mel_frames: int) -> tuple[int, ...]:
        """Frames after the convolutions of each attention chunk of a clip of `mel_frames` mel frames."""
        window = 2 * self.n_window
        full, tail = divmod(int(mel_frames), window)
        chunks = [window] * full + ([tail] if tail else [])
        return tuple(audio_conv_frames(c) for c in chunks)

    def clip_linear_flops(self, mel_frames: int, trainable: bool = True) -> float:
        """Parameter FLOPs of one clip (module docstring): conv1 on every mel frame, conv2 and the layers on the
        frames after the convolutions, ln_post and the projection on the LLM tokens. The convolutions run on
        padded chunks in the HF code; the padding of a clip's last chunk is not counted."""
        mult = 6.0 if trainable else 2.0
        t = audio_conv_frames(mel_frames)
        return mult * (self.conv1_params * mel_frames + (self.conv2_params + self.layers * self.layer_params) * t
                       + self.last_params * audio_llm_tokens(mel_frames))

    def clip_attn_flops(self, mel_frames: int, trainable: bool = True) -> float:
        """QK^T and AV of every layer, full (non-causal) attention within each chunk: 12 = 2 matmuls x 2 FLOPs x 3
        (fwd + bwd); 4 frozen."""
        mult = 12.0 if trainable else 4.0
        return mult * self.layers * self.d_model * float(sum(c * c for c in self.chunk_frames(mel_frames)))

    def clip_flops(self, mel_frames: int, trainable: bool = True) -> float:
        return self.clip_linear_flops(mel_frames, trainable) + self.clip_attn_flops(mel_frames, trainable)


def _moe_fields(text: Mapping[str, Any]) -> dict[str, int]:
    """LLMSpec's MoE fields from a text config: Qwen3-MoE names (num_experts) or GLM-4.5's (n_routed_experts,
    n_shared_experts, first_k_dense_replace); {} for a dense model."""
    experts = int(text.get("num_experts") or text.get("n_routed_experts") or 0)
    if not experts:
        return {}
    if text.get("mlp_only_layers") or int(text.get("decoder_sparse_step") or 1) != 1:
        raise ValueError("MoE configs with mlp_only_layers or decoder_sparse_step != 1 are not supported: every "
                         "layer after first_k_dense_replace must be a MoE layer")
    moe_ffn = int(text["moe_intermediate_size"])
    return {"num_experts": experts, "experts_per_token": int(text["num_experts_per_tok"]),
            "moe_ffn_hidden_size": moe_ffn, "shared_ffn_hidden_size": int(text.get("n_shared_experts") or 0) * moe_ffn,
            "dense_layers": int(text.get("first_k_dense_replace") or 0)}


def _square(value: Any) -> int:
    """InternVL configs give image and patch sizes as [h, w]; the others as one int."""
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def _vision_spec(model_type: str, v: Mapping[str, Any], llm: LLMSpec) -> VisionSpec:
    """The VisionSpec of a HF vision_config (by the top-level model_type)."""
    channels = int(v.get("in_channels", v.get("in_chans", v.get("num_channels", 3))))
    if model_type == "qwen2_vl":
        return VisionSpec(
            kind="qwen2_vl", depth=int(v["depth"]), hidden_size=int(v["embed_dim"]),
            intermediate_size=int(v["embed_dim"] * v.get("mlp_ratio", 4)), num_heads=int(v["num_heads"]),
            out_hidden_size=int(v.get("hidden_size", llm.hidden_size)), patch_size=int(v["patch_size"]),
            temporal_patch_size=int(v["temporal_patch_size"]), in_channels=channels,
            spatial_merge_size=int(v["spatial_merge_size"]))
    if model_type in ("qwen2_5_vl", "qwen2_5_omni_thinker", "qwen3_vl", "qwen3_vl_moe", "glm4v_moe"):
        # the Omni thinker's ViT is Qwen2.5-VL's; Qwen3-VL and GLM-4.xV share its grid and 2 x 2 merge
        kind = {"qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl", "glm4v_moe": "glm4v"}.get(model_type, "qwen2_5_vl")
        glm = kind == "glm4v"
        return VisionSpec(
            kind=kind, depth=int(v["depth"]), hidden_size=int(v["hidden_size"]),
            # GLM's blocks run their SwiGLU at the LLM width; intermediate_size is its merger's MLP
            intermediate_size=int(v["out_hidden_size"] if glm else v["intermediate_size"]),
            num_heads=int(v["num_heads"]), out_hidden_size=int(v["out_hidden_size"]), patch_size=int(v["patch_size"]),
            temporal_patch_size=int(v["temporal_patch_size"]), in_channels=channels,
            spatial_merge_size=int(v["spatial_merge_size"]), window_size=int(v.get("window_size", 0)),
            fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", ())),
            image_size=int(v.get("image_size", 0)) if glm else 0,
            projector_hidden=int(v["intermediate_size"]) if glm else 0,
            position_embeddings=int(v.get("num_position_embeddings", 0)),
            deepstack_layers=len(v.get("deepstack_visual_indexes", ())))
    if model_type == "llava":
        return VisionSpec(
            kind="clip", depth=int(v["num_hidden_layers"]), hidden_size=int(v["hidden_size"]),
            intermediate_size=int(v["intermediate_size"]), num_heads=int(v["num_attention_heads"]),
            out_hidden_size=llm.hidden_size, patch_size=int(v["patch_size"]), in_channels=channels,
            image_size=int(v["image_size"]), spatial_merge_size=1)
    if model_type == "internvl":
        return VisionSpec(
            kind="internvl", depth=int(v["num_hidden_layers"]), hidden_size=int(v["hidden_size"]),
            intermediate_size=int(v["intermediate_size"]), num_heads=int(v["num_attention_heads"]),
            out_hidden_size=llm.hidden_size, patch_size=_square(v["patch_size"]), in_channels=channels,
            image_size=_square(v["image_size"]), temporal_patch_size=1, spatial_merge_size=2)
    raise ValueError(f"unsupported model_type {model_type!r}: expected qwen2_vl, qwen2_5_vl, qwen2_5_omni_thinker, "
                     "qwen3_vl, qwen3_vl_moe, glm4v_moe, llava or internvl")


@dataclass(frozen=True)
class VLMSpec:
    name: str
    vision: VisionSpec
    llm: LLMSpec
    image_token_id: int | None = None
    # the audio encoder (the Omni thinker): its FLOPs per clip are `AudioSpec.clip_flops`, priced by the planner
    # as a part of its own when the workload has clips (`planner.parts.audio_part`)
    audio: AudioSpec | None = None

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
        text_type = str(text.get("model_type", ""))
        llm = LLMSpec(
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=int(text["hidden_size"]),
            ffn_hidden_size=int(text["intermediate_size"]),
            num_heads=int(text["num_attention_heads"]),
            num_kv_heads=int(text.get("num_key_value_heads") or text["num_attention_heads"]),
            vocab_size=int(text.get("vocab_size") or cfg["vocab_size"]),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            # Qwen2-family text models always carry q/k/v biases, also when wrapped by LLaVA; Qwen3 never does
            # (its config says attention_bias: false); GLM-4.5's says true.
            qkv_bias=(model_type.startswith("qwen2") or text_type.startswith("qwen2")
                      or bool(text.get("attention_bias", False))),
            head_size=int(text.get("head_dim") or 0),
            qk_norm=model_type.startswith("qwen3") or text_type.startswith("qwen3"),
            **_moe_fields(text),
        )
        vision = _vision_spec(model_type, cfg["vision_config"], llm)
        a = cfg.get("audio_config")
        audio = None if not a else AudioSpec(
            num_mel_bins=int(a["num_mel_bins"]), d_model=int(a["d_model"]), layers=int(a["encoder_layers"]),
            ffn=int(a["encoder_ffn_dim"]), output_dim=int(a["output_dim"]), heads=int(a["encoder_attention_heads"]),
            n_window=int(a.get("n_window", 100)))
        return VLMSpec(name=name or model_type, vision=vision, llm=llm,
                       image_token_id=cfg.get("image_token_id", cfg.get("image_token_index")), audio=audio)
