"""Schema of the `packing` recipe group: how the backbone's microbatches are built (owned by packing/)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PackingConfig:
    # flow: segment-tree best fit + cost buckets + zig-zag; naive: fixed batch padded to the longest;
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
