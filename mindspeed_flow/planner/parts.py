"""The parts a plan allocates devices to: one `PartSpec` per process group (encoder(s), backbone).

A `PartSpec` is everything the cost and memory model needs about one part, already averaged over the workload:
layer dims, parameter counts split by where they live (per layer, first stage, last stage), FLOPs per sample and
per token, token counts and extremes, and which parallel sizes the part accepts. Parts form a LIST, so a second
encoder (video, audio) is one more entry built the same way, not new solver code: the Qwen2.5-Omni thinker on a
workload with audio clips is [vision encoder, audio encoder, backbone] (`vlm_parts`), in MindSpeed-MM's rank order.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from mindspeed_flow.data.shapes import SampleShape
from mindspeed_flow.specs import VLMSpec


@dataclass(frozen=True)
class PartSpec:
    name: str  # part name: "encoder" (the vision encoder) | "audio" | "backbone"
    role: str  # "encoder" (produces embeddings) | "backbone" (consumes them, owns the loss)
    trainable: bool
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    gated_mlp: bool  # gate + up projections (SwiGLU) instead of one fc1
    layer_params: int
    first_params: int  # embeddings / patch embedding: on the first pipeline stage
    last_params: int  # output head + final norm / patch merger: on the last stage
    total_params: int
    # Workload averages, per sample. "tokens": LLM tokens (backbone), ViT patches (vision encoder) or frames after
    # the convolutions (audio encoder).
    tokens_per_sample: float
    sq_tokens_per_sample: float  # mean over samples of sum over attention sequences of len^2
    items_per_sample: float  # sequences per sample the layers run on: images; a sample's packed audio; backbone 1
    max_item_tokens: int  # longest sample (backbone) / largest image (vision) / a sample's most audio frames (audio)
    linear_flops_per_token: float  # training multiplier (6 or 2 frozen) already applied
    attn_flops_per_sample: float  # mean quadratic attention FLOPs per sample (training multiplier applied)
    out_tokens_per_sample: float = 0.0  # encoder: LLM tokens handed to the backbone
    max_out_tokens: int = 0  # encoder: the largest sample's embedding tokens (what the pool must let through)
    out_hidden: int = 0  # encoder: width of those embeddings
    input_elems_per_token: int = 0  # encoder: pixel values per patch / mel values per frame (kept when recomputing)
    vocab: int = 0  # backbone: logits width
    # Activation elements saved per token per layer: act_h x hidden + act_kv x (K and V width) + act_f x ffn.
    # Counted from the HF implementations' saved tensors (tests/test_planner_memory.py measures them).
    act_h: float = 8.0
    act_kv: float = 2.0
    act_f: float = 4.0
    # Encoder: elements per patch saved by the patch merger / projector (after the last layer).
    act_head_per_token: float = 0.0
    # Encoder: the backbone's mean and longest tokens per sample (how many samples a decoder microbatch holds:
    # the unit of MindSpeed-MM's in-flight bound, `cost.encoder_inflight_samples`); 0 = unknown.
    llm_tokens_per_sample: float = 0.0
    llm_max_tokens: int = 0
    # Encoder: feature tensors per LLM token it hands over (Qwen3-VL: the merger's output + 3 deepstack layers)
    embedding_tensors: int = 1
    # Backbone MoE (0: dense): routed experts per MoE layer, experts a token visits, MoE layers, and the routed
    # experts' parameters over all layers (what expert parallelism divides; layer_params and total_params
    # include them)
    experts: int = 0
    top_k: int = 0
    moe_layers: int = 0
    expert_params: int = 0
    # Backbone: parameters of a module held on the first pipeline stage that this workload never runs (the
    # Qwen2.5-Omni thinker's audio encoder on a workload without clips: built there, sharded over the stage's TP,
    # not a part of its own), and whether they train (then their gradients and optimizer states are held and
    # synced too). Memory and the gradient tail only: no compute.
    idle_first_params: int = 0
    idle_first_trainable: bool = False
    tp_sizes: tuple[int, ...] = (1, 2, 4, 8)
    pp_sizes: tuple[int, ...] = (1,)
    cp_sizes: tuple[int, ...] = (1,)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ep_sizes(self) -> tuple[int, ...]:
        """Expert-parallel sizes: the divisors of the expert count (1 only for a dense part)."""
        return _divisors(self.experts) if self.experts else (1,)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def flops_per_sample(self) -> float:
        """Model FLOPs per sample of this part (training multiplier applied, no recompute, no padding)."""
        return self.linear_flops_per_token * self.tokens_per_sample + self.attn_flops_per_sample

    @property
    def forward_fraction(self) -> float:
        """Share of `flops_per_sample` that is the forward pass (what recompute runs again)."""
        return 1.0 / 3.0 if self.trainable else 1.0


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def pp_candidates(layers: int) -> tuple[int, ...]:
    """Pipeline sizes to search: every size up to 16 (uneven splits make any of them valid) and the divisors."""
    return tuple(sorted(set(range(1, min(layers, 16) + 1)) | set(_divisors(layers))))


def backbone_part(spec: VLMSpec, shapes: Sequence[SampleShape], name: str = "backbone") -> PartSpec:
    llm = spec.llm
    tokens = np.array([s.llm_tokens for s in shapes], dtype=np.float64)
    attn = llm.attn_flops_per_token_sq(True) * tokens**2
    first = llm.embedding_params
    last = llm.head_params + llm.hidden_size  # head (absent when tied) + final norm
    tp_ok = tuple(t for t in (1, 2, 4, 8) if llm.num_heads % t == 0
                  and (llm.num_kv_heads % t == 0 or t % llm.num_kv_heads == 0))
    return PartSpec(
        name=name, role="backbone", trainable=True, layers=llm.num_layers, hidden=llm.hidden_size,
        # a MoE token's MLP activations: its top-k experts' (and the shared expert's) widths
        ffn=llm.active_ffn_hidden_size, heads=llm.num_heads, kv_heads=llm.num_kv_heads, gated_mlp=True,
        layer_params=llm.layer_params, first_params=first, last_params=last, total_params=llm.total_params,
        tokens_per_sample=float(tokens.mean()), sq_tokens_per_sample=float((tokens**2).mean()), items_per_sample=1.0,
        max_item_tokens=int(tokens.max()), linear_flops_per_token=llm.linear_flops_per_token(True),
        attn_flops_per_sample=float(attn.mean()), vocab=llm.vocab_size, tp_sizes=tp_ok,
        pp_sizes=pp_candidates(llm.num_layers), cp_sizes=(1, 2, 4, 8), experts=llm.num_experts,
        top_k=llm.experts_per_token, moe_layers=llm.moe_layers, expert_params=llm.routed_expert_params,
    )


def encoder_part(spec: VLMSpec, shapes: Sequence[SampleShape], trainable: bool = True,
                 name: str = "encoder") -> PartSpec:
    v = spec.vision
    mult = 6.0 if trainable else 2.0
    per_image = [p for s in shapes for p in s.vit_patches_per_image]
    patches = np.array([s.vit_patches for s in shapes], dtype=np.float64)
    sq = np.array([sum(p * p for p in s.vit_patches_per_image) for s in shapes], dtype=np.float64)
    # Attention FLOPs = image_flops minus its linear part, so windowed layers are counted as specs does.
    attn = np.array([sum(v.image_flops(p, trainable) - mult * v.params * p for p in s.vit_patches_per_image)
                     for s in shapes], dtype=np.float64)
    out_tokens = np.array([s.image_tokens for s in shapes], dtype=np.float64)
    d = v.hidden_size
    fixed_tiles = v.kind in ("clip", "internvl")  # 2-D patches of a fixed-size tile; the others: t x p x p
    in_elems = v.in_channels * v.patch_size**2 * (1 if fixed_tiles else v.temporal_patch_size)
    tp_ok = tuple(t for t in (1, 2, 4, 8) if v.num_heads % t == 0)
    act_h, act_f = _VIT_ACTIVATIONS[v.kind]
    head = 2.0 * v.out_hidden_size if fixed_tiles else 3.0 * d
    return PartSpec(
        name=name, role="encoder", trainable=trainable, layers=v.depth, hidden=d, ffn=v.intermediate_size,
        heads=v.num_heads, kv_heads=v.num_heads, gated_mlp=v.kind in ("qwen2_5_vl", "glm4v"),
        layer_params=v.layer_params, first_params=v.first_params, last_params=v.last_params, total_params=v.params,
        tokens_per_sample=float(patches.mean()), sq_tokens_per_sample=float(sq.mean()),
        items_per_sample=float(np.mean([s.num_images for s in shapes])),
        max_item_tokens=int(max(per_image) if per_image else 0), linear_flops_per_token=mult * v.params,
        attn_flops_per_sample=float(attn.mean()), out_tokens_per_sample=float(out_tokens.mean()),
        max_out_tokens=int(out_tokens.max()) if len(out_tokens) else 0, out_hidden=v.out_hidden_size, input_elems_per_token=in_elems, tp_sizes=tp_ok,
        act_h=act_h, act_kv=0.0, act_f=act_f, act_head_per_token=head, embedding_tensors=v.embedding_tensors,
    )


# Saved elements per patch per ViT layer (x hidden, x ffn), counted from transformers' modules on CPU:
# Qwen2-VL (LayerNorm, quick-GELU MLP), Qwen2.5-VL (RMSNorm, SwiGLU MLP, window reordering), CLIP. Not counted,
# taken from the closest counted block: Qwen3-VL (LayerNorm, GELU MLP) from Qwen2-VL, GLM-4.5V (RMSNorm, SwiGLU)
# from Qwen2.5-VL, InternViT (LayerNorm, GELU MLP, layer scale) from CLIP.
_VIT_ACTIVATIONS: dict[str, tuple[float, float]] = {"qwen2_vl": (11.5, 3.0), "qwen2_5_vl": (14.0, 4.0),
                                                    "clip": (8.5, 3.0), "qwen3_vl": (11.5, 3.0),
                                                    "glm4v": (14.0, 4.0), "internvl": (8.5, 3.0)}


def audio_part(spec: VLMSpec, shapes: Sequence[SampleShape], trainable: bool = True,
               name: str = "audio") -> PartSpec:
    """The audio encoder (`spec.audio`, the Omni thinker's) as an encoder part over the workload's clips.

    Its tokens are the clips' frames after the two convolutions (what the layers run on); attention is per chunk
    of 2 x n_window mel frames (`AudioSpec.chunk_frames`), so the quadratic FLOPs and the score memory are per
    chunk; it hands the backbone the pooled LLM audio tokens, `output_dim` wide. Samples without clips count
    as samples with no audio work."""
    a = spec.audio
    if a is None:
        raise ValueError(f"{spec.name}: the model has no audio encoder")
    clips = [s.audio_frames for s in shapes]
    frames = np.array([sum(sum(a.chunk_frames(f)) for f in c) for c in clips], dtype=np.float64)
    sq = np.array([sum(x * x for f in c for x in a.chunk_frames(f)) for c in clips], dtype=np.float64)
    linear = np.array([sum(a.clip_linear_flops(f, trainable) for f in c) for c in clips], dtype=np.float64)
    attn = np.array([sum(a.clip_attn_flops(f, trainable) for f in c) for c in clips], dtype=np.float64)
    out_tokens = np.array([s.audio_tokens for s in shapes], dtype=np.float64)
    d = a.d_model
    act_h, act_f = _VIT_ACTIVATIONS[_AUDIO_ACTIVATIONS_FROM]
    return PartSpec(
        name=name, role="encoder", trainable=trainable, layers=a.layers, hidden=d, ffn=a.ffn, heads=a.heads,
        kv_heads=a.heads, gated_mlp=False, layer_params=a.layer_params, first_params=a.first_params,
        last_params=a.last_params, total_params=a.params,
        tokens_per_sample=float(frames.mean()), sq_tokens_per_sample=float(sq.mean()),
        # a sample's chunks (and clips) run through the layers as one packed sequence, one TP collective per
        # linear for all of them: the item is the sample's audio (attention per chunk is in sq and attn above)
        items_per_sample=float(np.mean([1.0 if c else 0.0 for c in clips])),
        max_item_tokens=int(frames.max()) if len(frames) else 0,
        # the workload's mean parameter FLOPs per frame: conv1 runs on twice the frames, the head on half
        linear_flops_per_token=float(linear.sum() / max(frames.sum(), 1.0)),
        attn_flops_per_sample=float(attn.mean()), out_tokens_per_sample=float(out_tokens.mean()),
        max_out_tokens=int(out_tokens.max()) if len(out_tokens) else 0, out_hidden=a.output_dim,
        input_elems_per_token=2 * a.num_mel_bins,  # two mel frames per frame after the stride-2 convolution
        tp_sizes=tuple(t for t in (1, 2, 4, 8) if a.heads % t == 0),
        # saved after the last layer per frame: the pool's input (d), and on the pooled half-length sequence the
        # LayerNorm's and the projection's inputs (d / 2 each)
        act_h=act_h, act_kv=0.0, act_f=act_f, act_head_per_token=2.0 * d,
    )


# The audio encoder's layer (pre-LayerNorm, separate q/k/v/o projections, no rotary, GELU MLP with biases) takes
# the closest counted block's saved elements, CLIP's (the same layer structure); against the bytes autograd saves
# for the tiny thinker's clips they predict -5% to -14% (tests/test_planner_memory.py; the larger misses are clips
# whose last chunk is short: the tower runs its convolutions on chunks padded to full length).
_AUDIO_ACTIVATIONS_FROM = "clip"


def vlm_parts(spec: VLMSpec, shapes: Sequence[SampleShape], freeze_encoder: bool = False,
              freeze_audio: bool | None = None, audio_part_always: bool = False) -> list[PartSpec]:
    """The parts of a VLM, producers first, the backbone (the consumer) last: [vision encoder, backbone], or
    [vision encoder, audio encoder, backbone] for a model with an audio encoder on a workload with audio clips
    (MindSpeed-MM's rank order). Without clips such a model's audio encoder stays on the backbone's first stage,
    where the MindSpeed-MM job builds it: its weights (and, trained, its gradients and optimizer states) are counted there.
    `freeze_audio` None: the audio encoder follows `freeze_encoder`. `audio_part_always`: the audio encoder is a
    part even without clips (the torch host's split; it then holds its weights and does no work)."""
    bb = backbone_part(spec, shapes)
    llm = {"llm_tokens_per_sample": bb.tokens_per_sample, "llm_max_tokens": bb.max_item_tokens}
    parts = [dataclasses.replace(encoder_part(spec, shapes, trainable=not freeze_encoder), **llm)]
    if spec.audio is not None:
        frozen = freeze_encoder if freeze_audio is None else freeze_audio
        if audio_part_always or any(s.audio_frames for s in shapes):
            parts.append(dataclasses.replace(audio_part(spec, shapes, trainable=not frozen), **llm))
        else:
            bb = dataclasses.replace(bb, idle_first_params=spec.audio.params, idle_first_trainable=not frozen)
    return parts + [bb]
