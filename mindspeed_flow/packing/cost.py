"""Compute-cost model of one sample for the packing scheduler.

The scheduler balances *cost*, not tokens, so this module turns a `SampleShape` into two numbers:

- backbone cost of a sample of l LLM tokens:  linear * l + quadratic * l^2   (causal attention term);
- encoder cost of one image of p ViT patches: enc_linear * p + enc_quadratic * p^2
  + enc_window_quadratic * p * min(p, enc_window_patches)  (windowed layers, Qwen2.5-VL).

Coefficients come from the model spec (`CostModel.from_spec`, FLOPs) or from profiled numbers in the packing
recipe (`CostModel.from_config`, any unit: only ratios matter to the scheduler). A frozen encoder runs forward
only, so it costs 2x its parameters per patch instead of 6x (one third of the trainable cost).

Pure computation: numpy only, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from mindspeed_flow.config.packing import PackingConfig
from mindspeed_flow.data.shapes import SampleShape
from mindspeed_flow.specs import VLMSpec


@dataclass(frozen=True)
class CostModel:
    """Per-sample backbone cost and per-image encoder cost; all coefficients must be >= 0."""

    linear: float = 1.0
    quadratic: float = 0.0
    enc_linear: float = 1.0
    enc_quadratic: float = 0.0
    enc_window_quadratic: float = 0.0
    enc_window_patches: int = 0

    def __post_init__(self) -> None:
        for name in ("linear", "quadratic", "enc_linear", "enc_quadratic", "enc_window_quadratic"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"CostModel.{name}={value}: a cost coefficient must be finite and >= 0")
        if self.enc_window_patches < 0:
            raise ValueError(f"CostModel.enc_window_patches={self.enc_window_patches}: must be >= 0")

    @staticmethod
    def from_spec(spec: VLMSpec, frozen_encoder: bool = False) -> "CostModel":
        """FLOP coefficients (specs.py) for a trainable backbone and a trainable or frozen encoder."""
        vision = spec.vision
        enc_mult = 2.0 if frozen_encoder else 6.0  # forward only = one third of forward + backward
        attn_mult = 4.0 if frozen_encoder else 12.0  # QK^T and AV, 2 FLOPs per MAC, non-causal
        window = vision.window_patches
        full_layers = len(vision.fullatt_block_indexes) if window else vision.depth
        return CostModel(
            linear=spec.llm.linear_flops_per_token(True),
            quadratic=spec.llm.attn_flops_per_token_sq(True),
            enc_linear=enc_mult * vision.params,
            enc_quadratic=attn_mult * vision.hidden_size * full_layers,
            enc_window_quadratic=attn_mult * vision.hidden_size * (vision.depth - full_layers),
            enc_window_patches=window,
        )

    @staticmethod
    def from_config(cfg: PackingConfig, spec: VLMSpec | None = None, frozen_encoder: bool = False) -> "CostModel":
        """Spec-derived coefficients, overridden by profiled ones from the packing recipe.

        Profiled coefficients override as a pair: if either backbone coefficient is nonzero both are taken from
        the recipe (a zero there then means "no such term"), because profiled seconds and spec FLOPs must not be
        mixed in one sum. The encoder pair works the same way.
        """
        base = CostModel.from_spec(spec, frozen_encoder) if spec is not None else CostModel()
        if cfg.linear_coeff or cfg.quadratic_coeff:
            base = replace(base, linear=float(cfg.linear_coeff), quadratic=float(cfg.quadratic_coeff))
        enc_lin = float(getattr(cfg, "encoder_linear_coeff", 0.0) or 0.0)
        enc_quad = float(getattr(cfg, "encoder_quadratic_coeff", 0.0) or 0.0)
        if enc_lin or enc_quad:
            base = replace(base, enc_linear=enc_lin, enc_quadratic=enc_quad, enc_window_quadratic=0.0,
                           enc_window_patches=0)
        return base

    # ---- backbone -------------------------------------------------------------------------------------------
    def sample_cost(self, llm_tokens: int) -> float:
        return self.linear * llm_tokens + self.quadratic * llm_tokens * llm_tokens

    def sample_costs(self, llm_tokens: np.ndarray) -> np.ndarray:
        """Vectorized `sample_cost` (float64, so l^2 never overflows)."""
        lengths = np.asarray(llm_tokens, dtype=np.float64)
        return self.linear * lengths + self.quadratic * lengths * lengths

    # ---- encoder --------------------------------------------------------------------------------------------
    def image_cost(self, patches: int) -> float:
        windowed = min(patches, self.enc_window_patches) if self.enc_window_patches else patches
        return (self.enc_linear * patches + self.enc_quadratic * patches * patches
                + self.enc_window_quadratic * patches * windowed)

    def encoder_cost(self, shape: SampleShape) -> float:
        """Encoder cost of all images of a sample (0 for a text-only sample)."""
        return float(sum(self.image_cost(p) for p in shape.vit_patches_per_image))
