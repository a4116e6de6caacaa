"""Dynamic packing scheduler: cost-balanced backbone microbatches over DP ranks x slots.

The runtime calls `plan_step` on every rank with the step's sample shapes; the result, a `StepPlan`, says which
samples form each microbatch of each DP rank (same count on every rank), and in which order each encoder rank
encodes its samples. Pure computation (numpy, no torch), deterministic across ranks.

    plan = plan_step(shapes, dp=8, num_encoders=2, token_budget=16384,
                     cost_model=CostModel.from_spec(spec), min_microbatches=pp)

Building blocks, usable on their own: `CostModel` (cost.py), `best_fit_pack` / `pack_into_bins` with the
capacity bitset (bestfit.py), `zigzag_place` / `encoder_schedule` (balance.py), the baselines
(schedulers.py), `StreamingPacker` (streaming.py) and the InfoVQA-like shape generator (workloads.py).
"""
from mindspeed_flow.packing.balance import encoder_schedule, split_to_count, zigzag_place
from mindspeed_flow.packing.bestfit import CapacityTree, Packing, best_fit_pack, pack_into_bins
from mindspeed_flow.packing.cost import CostModel
from mindspeed_flow.packing.plan import PackingError, apply_oversize_policy, check_budget, plan_step
from mindspeed_flow.packing.schedulers import (
    SCHEDULERS, first_fit_schedule, flow_schedule, naive_schedule, sorted_schedule,
)
from mindspeed_flow.packing.types import Microbatch, StepInputs, StepPlan

__all__ = [
    "CapacityTree", "CostModel", "Microbatch", "Packing", "PackingError", "SCHEDULERS", "StepInputs", "StepPlan",
    "apply_oversize_policy", "best_fit_pack", "check_budget", "encoder_schedule", "first_fit_schedule",
    "flow_schedule", "naive_schedule", "pack_into_bins", "plan_step", "sorted_schedule", "split_to_count",
    "zigzag_place",
]
