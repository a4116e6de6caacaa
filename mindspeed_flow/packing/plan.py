"""`plan_step`: the one call the runtime makes, on every rank, to turn a step's sample shapes into a plan.

It checks the inputs (every message names the sample or argument and the rule), applies the oversize policy
(a sample longer than the budget is an error, or is left out and reported by id and length; never silently
dropped or truncated), and runs the chosen scheduler. Deterministic: mindspeed-flow's scheduler sorts the step by
sample id first, so the plan does not even depend on the order the shapes arrive in; the baselines keep arrival
order on purpose (that is what they model), which every rank sees identically.
"""
from __future__ import annotations

from typing import Sequence

from mindspeed_flow.data.shapes import SampleShape
from mindspeed_flow.packing.cost import CostModel
from mindspeed_flow.packing.schedulers import SCHEDULERS
from mindspeed_flow.packing.types import StepInputs, StepPlan

OVERSIZE_POLICIES = ("error", "skip")


class PackingError(ValueError):
    """Input the scheduler cannot plan; the message names the sample or argument and the rule."""


def plan_step(shapes: Sequence[SampleShape], *, dp: int, num_encoders: int, token_budget: int,
              cost_model: CostModel, scheduler: str = "flow", min_microbatches: int = 1,
              oversize_policy: str = "error", pad_multiple: int = 0) -> StepPlan:
    """Microbatches per [dp_rank][slot] and an encode order per encoder rank for one step's samples.

    pad_multiple=0 pads every packed microbatch to `token_budget` (one static shape); > 0 pads this step's packs
    to their longest load rounded up to that multiple (`StepPlan.seq_len`).
    """
    check_arguments(dp=dp, num_encoders=num_encoders, token_budget=token_budget, scheduler=scheduler,
                    min_microbatches=min_microbatches, oversize_policy=oversize_policy, pad_multiple=pad_multiple)
    lengths = llm_tokens_of(shapes)
    check_shapes(shapes, lengths)
    kept, oversize = apply_oversize_policy(shapes, token_budget, oversize_policy, lengths)
    if scheduler == "flow":
        kept = sorted(kept, key=lambda i: shapes[i].sample_id)
    inputs = StepInputs.from_shapes([shapes[i] for i in kept], cost_model, [lengths[i] for i in kept])
    plan = SCHEDULERS[scheduler](inputs, dp=dp, num_encoders=num_encoders, token_budget=token_budget,
                                 min_microbatches=min_microbatches, pad_multiple=pad_multiple)
    plan.oversize = oversize
    return plan


def llm_tokens_of(shapes: Sequence[SampleShape]) -> list[int]:
    """`SampleShape.llm_tokens` of every shape (same per-image floor, audio clips' tokens included), without the
    properties' per-call cost."""
    out: list[int] = []
    append = out.append
    for s in shapes:
        grid = s.image_grid_thw
        n = s.text_tokens + (s.audio_tokens if s.audio_frames else 0)
        if not grid:
            append(n)
            continue
        m2 = s.merge_size * s.merge_size
        if len(grid) == 1:
            t, h, w = grid[0]
            append(n + t * h * w // m2)
        else:
            append(n + sum(t * h * w // m2 for t, h, w in grid))
    return out


def check_arguments(*, dp: int, num_encoders: int, token_budget: int, scheduler: str, min_microbatches: int,
                    oversize_policy: str, pad_multiple: int) -> None:
    rules = [
        (dp >= 1, f"dp={dp}: must be >= 1"),
        (num_encoders >= 1, f"num_encoders={num_encoders}: must be >= 1"),
        (token_budget >= 1, f"token_budget={token_budget}: must be >= 1"),
        (min_microbatches >= 1, f"min_microbatches={min_microbatches}: must be >= 1"),
        (pad_multiple >= 0, f"pad_multiple={pad_multiple}: must be >= 0 (0 pads to the budget)"),
        (scheduler in SCHEDULERS, f"scheduler={scheduler!r}: choose one of {sorted(SCHEDULERS)}"),
        (oversize_policy in OVERSIZE_POLICIES, f"oversize_policy={oversize_policy!r}: 'error' or 'skip'"),
    ]
    for ok, message in rules:
        if not ok:
            raise PackingError(message)


def check_shapes(shapes: Sequence[SampleShape], lengths: Sequence[int]) -> None:
    """Unique sample ids and at least one LLM token per sample (a shape built in code skips the CSV checks)."""
    ids = [s.sample_id for s in shapes]
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        twice = next(sid for sid in ids if sid in seen or seen.add(sid))
        raise PackingError(f"sample {twice} appears twice in the step")
    if lengths and (min(lengths) <= 0 or min(s.text_tokens for s in shapes) < 0):
        bad = next(i for i, s in enumerate(shapes) if s.text_tokens < 0 or lengths[i] <= 0)
        shape = shapes[bad]
        raise PackingError(f"sample {shape.sample_id}: text_tokens={shape.text_tokens}, llm_tokens={lengths[bad]};"
                           " a sample needs text_tokens >= 0 and at least one LLM token")


def apply_oversize_policy(shapes: Sequence[SampleShape], token_budget: int, policy: str,
                          lengths: Sequence[int] | None = None) -> tuple[list[int], list[tuple[int, int]]]:
    """Positions of the samples that fit, and (sample_id, llm_tokens) of those left out under "skip"."""
    lengths = llm_tokens_of(shapes) if lengths is None else lengths
    if not lengths or max(lengths) <= token_budget:
        return list(range(len(shapes))), []
    if min(lengths) > token_budget:
        check_budget(shapes, token_budget)
    kept: list[int] = []
    oversize: list[tuple[int, int]] = []
    for i, tokens in enumerate(lengths):
        if tokens <= token_budget:
            kept.append(i)
        elif policy == "error":
            raise PackingError(f"sample {shapes[i].sample_id} has {tokens} LLM tokens, more than token_budget="
                               f"{token_budget} (oversize_policy='error'; use 'skip' to leave it out and report it)")
        else:
            oversize.append((shapes[i].sample_id, tokens))
    return kept, oversize


def check_budget(shapes: Sequence[SampleShape], token_budget: int, field: str = "token_budget") -> None:
    """A budget below the smallest sample is a configuration error, whatever the oversize policy."""
    if not shapes:
        return
    smallest = min(shapes, key=lambda s: (s.llm_tokens, s.sample_id))
    if token_budget < smallest.llm_tokens:
        raise PackingError(f"{field}={token_budget} is smaller than the smallest sample (sample "
                           f"{smallest.sample_id}, {smallest.llm_tokens} tokens)")
