"""torch_compat: the behaviour probes that keep results identical on torch 2.7.1 (MindSpeed-MM's pin) and on the
current torch. The same tests run on both (`MSF_TORCH=2.7 bash scripts/run_tests.sh` for 2.7.1); each checks
the probe's answer against the behaviour it stands for, whichever way this torch behaves."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mindspeed_flow import torch_compat
from mindspeed_flow.hosts.torch.data_parallel import apply_ddp, apply_fsdp, dp_loss_scale
from mindspeed_flow.utils.multiproc import run_ranks


def _reduce_op_rank(rank: int, world: int) -> dict:
    # The raw behaviour: rank r holds r + 1 everywhere, reduce-scatter with AVG.
    raw = torch.empty(1)
    torch_compat.dist_fn("reduce_scatter_single", "reduce_scatter_tensor")(
        raw, torch.full((world,), float(rank + 1)), op=dist.ReduceOp.AVG)
    averages = torch_compat.reduce_scatter_avg_averages(None)
    cached = torch_compat.reduce_scatter_avg_averages(dist.group.WORLD)  # same group object: no new collective
    # A sub-group gets its own measurement.
    sub = dist.new_group([0, 1])
    sub_averages = torch_compat.reduce_scatter_avg_averages(sub) if rank in (0, 1) else None

    fsdp_reduction = torch_compat.fsdp_grad_reduction(None, torch.float32)
    # What FSDP2 does to a real module's gradients, and the loss scale that turns it into the SUM over ranks.
    lin = torch.nn.Linear(world, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    fsdp = apply_fsdp(lin, None, layer_containers=())
    scale = dp_loss_scale(None, fsdp)
    (fsdp(torch.full((1, world), float(rank + 1))).sum() * scale).backward()
    fsdp_grad = lin.weight.grad.full_tensor().tolist()
    # DDP is unaffected: it averages with SUM + divide.
    ddp_module = torch.nn.Linear(world, 1, bias=False)
    ddp = apply_ddp(ddp_module, None)
    (ddp(torch.full((1, world), float(rank + 1))).sum() * dp_loss_scale(None, ddp)).backward()
    return {"raw": raw.item(), "averages": averages, "cached": cached, "sub_averages": sub_averages,
            "fsdp_reduction": fsdp_reduction, "scale": scale, "fsdp_grad": fsdp_grad,
            "ddp_grad": ddp_module.weight.grad.tolist(), "adaptations": torch_compat.adaptations()}


def test_reduce_scatter_avg_probe_matches_the_behaviour_and_fixes_fsdp_scaling():
    out = run_ranks(_reduce_op_rank, 3, timeout_s=120)
    mean, total = 2.0, 6.0  # ranks hold 1, 2, 3
    for r, res in enumerate(out):
        assert res["raw"] in (mean, total), res  # the mean (current torch) or the sum (gloo in torch 2.7.1)
        assert res["averages"] == (res["raw"] == mean) == res["cached"], res
        # FSDP2 then averages exactly when AVG does (it reduce-scatters fp32 gradients with AVG)
        assert res["fsdp_reduction"] == ("mean" if res["averages"] else "sum"), res
        assert res["scale"] == (3.0 if res["fsdp_reduction"] == "mean" else 1.0), res
        # With the chosen loss scale the gradient is the SUM over ranks on every release: x summed = 1 + 2 + 3.
        assert res["fsdp_grad"] == [[total] * 3], res
        assert res["ddp_grad"] == [[total] * 3], res
        if not res["averages"]:  # an adaptation is never silent
            assert any("ReduceOp.AVG sums" in a for a in res["adaptations"]), res["adaptations"]
            assert any("FSDP2 gradients arrive summed" in a for a in res["adaptations"]), res["adaptations"]
    assert out[0]["sub_averages"] == out[1]["sub_averages"] == out[0]["averages"]
    assert out[2]["sub_averages"] is None


class _Work:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> bool:
        self.log.append(self.name)
        return True

    def is_completed(self) -> bool:
        return self.name in self.log


def test_pipeline_p2p_waits_on_every_handle(monkeypatch: pytest.MonkeyPatch):
    from torch.distributed.pipelining import schedules

    torch_compat.ensure_pipeline_p2p_waits_all()
    helper = schedules._batch_p2p
    # Either this torch's schedules wait on each work of a batch themselves (the helper returns the list), or the
    # helper is the one whose single handle waits on all of them.
    assert isinstance(helper([]), list) or getattr(helper, "_msf_waits_all", False)
    assert torch_compat.ensure_pipeline_p2p_waits_all() == getattr(helper, "_msf_waits_all", False)  # idempotent

    log: list[str] = []
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [_Work(log, op) for op in ops])
    handle = torch_compat._batch_p2p_waiting_all(["send", "recv"])
    assert not handle.is_completed()
    handle.wait()
    assert log == ["send", "recv"] and handle.is_completed()
    assert torch_compat._batch_p2p_waiting_all([]) is None  # as the 2.7 helper answers an empty batch


def test_schedule_and_step_keywords_follow_the_signatures():
    from torch.distributed.pipelining import Schedule1F1B

    assert torch_compat.schedule_kwargs(Schedule1F1B) in ({"scale_grads": False}, {})
    kwargs = torch_compat.step_kwargs(Schedule1F1B)
    assert kwargs == ({"return_outputs": False} if torch_compat.accepts(Schedule1F1B.step, "return_outputs")
                      else {})
    if not kwargs:
        assert any("return_outputs" in a for a in torch_compat.adaptations())

    class _Old:
        def __init__(self, stage, n_microbatches, loss_fn=None):
            pass

        def step(self, *args, target=None, losses=None, **kwargs):
            pass

    assert torch_compat.schedule_kwargs(_Old) == {} and torch_compat.step_kwargs(_Old(None, 1)) == {}
    assert torch_compat.accepts(Schedule1F1B.__init__, "n_microbatches")


def test_dist_fn_prefers_the_first_name_and_names_what_is_missing():
    assert torch_compat.dist_fn("no_such_collective", "all_reduce") is dist.all_reduce
    with pytest.raises(RuntimeError, match="none of"):
        torch_compat.dist_fn("no_such_collective")


def test_startup_line_names_every_adaptation(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch_compat, "_ADAPTATIONS", {})
    assert torch_compat.startup_line() is None and torch_compat.adaptations() == []
    torch_compat._adapt("a", "first thing")
    torch_compat._adapt("b", "second thing")
    torch_compat._adapt("a", "first thing again")  # recorded once
    line = torch_compat.startup_line()
    assert line == f"[mindspeed-flow] torch {torch.__version__}: first thing; second thing"
    assert "\n" not in line


def _teardown_rank(rank: int, world: int) -> dict:
    group = dist.new_group([0, 1])
    out = [torch.empty(4) for _ in range(world)]
    dist.all_gather(out, torch.full((4,), float(rank)), group=group, async_op=True).wait()
    torch_compat.reduce_scatter_avg_averages(group)
    del out  # the tensors' Python objects die before the group: torch 2.7's deadlock-prone order
    torch_compat.destroy_process_groups()
    retired = len(torch_compat._RETIRED_BACKENDS)
    torch_compat.destroy_process_groups()  # idempotent: nothing initialised any more
    return {"initialized": dist.is_initialized(), "retired": retired, "cache": len(torch_compat._RS_AVG)}


def test_destroy_process_groups_keeps_gloo_backends_and_forgets_the_probes():
    for res in run_ranks(_teardown_rank, 2, timeout_s=60):
        # the world group's and the sub-group's gloo backends are held (the world's may be shared per device type)
        assert res == {"initialized": False, "retired": res["retired"], "cache": 0} and res["retired"] >= 2, res


def _refused_avg_rank(rank: int, world: int) -> dict:
    raw = torch.empty(1)
    torch_compat.dist_fn("reduce_scatter_single", "reduce_scatter_tensor")(
        raw, torch.full((world,), float(rank + 1)), op=dist.ReduceOp.AVG)

    def refuse(*names):
        def call(*args, **kwargs):
            raise RuntimeError("ReduceOp.AVG is not supported by this backend")
        return call

    real = torch_compat.dist_fn
    torch_compat.dist_fn = refuse  # a backend that refuses AVG (this forked rank only)
    try:
        averages = torch_compat.reduce_scatter_avg_averages(None)
    finally:
        torch_compat.dist_fn = real
    # FSDP2 itself is then measured end to end (its own reduce-scatter is untouched here)
    return {"raw": raw.item(), "averages": averages,
            "fsdp": torch_compat.fsdp_grad_reduction(None, torch.float32)}


def test_a_backend_refusing_avg_gets_fsdp2_measured_end_to_end():
    for res in run_ranks(_refused_avg_rank, 2, timeout_s=60):
        assert res["averages"] is False, res
        assert res["fsdp"] == ("mean" if res["raw"] == 1.5 else "sum"), res
