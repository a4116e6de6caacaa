"""Schema of the `packing` recipe group: how the backbone's microbatches are built (owned by packing/)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PackingConfig:
    # flow: bitset best fit + cost buckets + zig-zag; naive: fixed batch padded to the longest;
    # sorted: length-sorted batches; first_fit: greedy first fit.
    scheduler: str = "flow"
    # Tokens per backbone microbatch (at most; see pad_multiple).
    token_budget: int = 1024
    # What to do with a sample longer than the budget: "error" | "skip" (reported by id and length, never silent).
    oversize_policy: str = "error"
    # Optional profiled coefficients (FLOPs-equivalent seconds); 0 means "derive from the model spec".
    linear_coeff: float = 0.0
    quadratic_coeff: float = 0.0
    # Same for the encoder (per image of p ViT patches: a_v * p + b_v * p^2); 0 means "derive from the spec".
    encoder_linear_coeff: float = 0.0
    encoder_quadratic_coeff: float = 0.0
    # 0: every microbatch is padded to token_budget (one static shape for the whole run). > 0: each step's
    # microbatches are padded to the step's longest pack rounded up to this multiple (one shape per step, from a
    # bounded set of buckets), which removes the padding left when the pack count is rounded up to a multiple of DP.
    # Pipelines too: they keep a schedule per (length, microbatch count).
    pad_multiple: int = 0
    # What makes a step. "samples": trainer.global_batch_size samples, packed into as few packs as the step rules
    # allow (a multiple of DP, >= pp per rank). "packs": token-defined steps of DP x packs_per_rank packs filled by
    # the streaming packer (packing/streaming.py): samples that do not fit a nearly full pack wait in a look-ahead
    # buffer of `lookahead` samples for a later step (saved with checkpoints), so packs stay nearly full; every pack
    # is padded to token_budget (pad_multiple must be 0). The sampler still hands out global_batch_size ids at a time.
    # "window": still exactly global_batch_size samples per step, chosen from a pool of the streaming packer's packs
    # holding global_batch_size + lookahead samples (packing/window.py): whole packs whose count is a multiple of
    # DP when they are full enough, else the oldest samples packed as in "samples"; a pooled sample waits at most
    # 4 steps (while lookahead < global_batch_size). pad_multiple is honoured.
    step_mode: str = "samples"
    # How a backbone microbatch lays out its samples. packed: one row, samples back to back, each attending only to
    # itself (varlen / THD attention). rows: one row per sample padded to the longest (the MindSpeed-MM host only;
    # kept to compare against). auto: packed, except a MindSpeed-MM job without --use-flash-attn (rows: the TND
    # kernel is its flash attention).
    layout: str = "auto"
    packs_per_rank: int = 0  # step_mode=packs: packs per DP rank per step; 0 = the backbone's pipeline size
    # step_mode=packs: the look-ahead buffer, in samples; window: also the pool's samples beyond a step, <=
    # trainer.global_batch_size (0: equal to it).
    lookahead: int = 1024
