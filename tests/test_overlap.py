"""The overlap layer against a dense single-process reference on 2 and 4 gloo ranks, forward and backward.

Each rank builds the same full x / W / upstream gradient from one seed, takes its shards, runs every
implementation ("plain", "chunked" with 1, 2 and 4 chunks) and compares output, grad x and grad W with the
matching slices of the dense x @ W^T. The MC2 path runs on forked ranks that activate the CPU emulation of
torch_npu first (never in the pytest process), and must agree with "chunked" in bf16.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import pytest
import torch
import torch.distributed as dist

from mindspeed_flow.overlap import (ColumnParallelLinear, ColumnParallelLinearSP, OverlapContext, RowParallelLinear,
                                    RowParallelLinearSP, all_gather_rows, column_parallel_linear,
                                    column_parallel_linear_sp, reduce_scatter_rows, row_parallel_linear,
                                    row_parallel_linear_sp)
from mindspeed_flow.overlap import mc2_api
from mindspeed_flow.utils.multiproc import run_ranks

M_LOCAL, IN, OUT = 7, 12, 8  # 7 rows per rank: 2 and 4 chunks split unevenly (4+3, 2+2+2+1)
VARIANTS = [("plain", 1), ("chunked", 1), ("chunked", 2), ("chunked", 4)]


def _dense(world: int, dtype: torch.dtype = torch.float32, m: int = M_LOCAL, k: int = IN,
           n: int = OUT) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(world * m, k, generator=g) / k ** 0.5
    w = torch.randn(n, k, generator=g) / k ** 0.5  # unit-scale outputs, so bf16 tolerances are relative
    grad = torch.randn(world * m, n, generator=g)
    return x.to(dtype), w.to(dtype), grad.to(dtype)


def _run(fn, x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor, ctx: OverlapContext | None = None,
         **kw) -> tuple[torch.Tensor, ...]:
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(x, w, ctx=ctx or OverlapContext(), **kw)
    out.backward(grad)
    return out.detach(), x.grad, w.grad


def _check(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], what: str, tol: float = 1e-5) -> None:
    for name, g, w in zip(("out", "grad_x", "grad_w"), got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=lambda m: f"{what} {name}: {m}")


def _impls_rank(rank: int, world: int) -> list[str]:
    x_full, w_full, g_full = _dense(world)
    ref = x_full @ w_full.t()
    rows = slice(rank * M_LOCAL, (rank + 1) * M_LOCAL)
    cols = slice(rank * OUT // world, (rank + 1) * OUT // world)
    ks = slice(rank * IN // world, (rank + 1) * IN // world)
    # Column-parallel: grad x is the sum over ranks of G[:, cols_r] @ W[cols_r], i.e. (G @ W) on this rank's rows.
    col_want = (ref[:, cols], (g_full @ w_full)[rows], g_full[:, cols].t() @ x_full)
    # Row-parallel: every rank holds the full sequence of its input-feature slice; rank r's output rows get
    # the upstream gradient rows r, so grad x is the full (G @ W) restricted to its columns.
    row_want = (ref[rows], (g_full @ w_full)[:, ks], g_full.t() @ x_full[:, ks])
    done = []
    for impl, chunks in VARIANTS:
        got = _run(column_parallel_linear_sp, x_full[rows], w_full[cols], g_full[:, cols], impl=impl,
                   chunks=chunks)
        _check(got, col_want, f"column {impl}x{chunks} world {world}")
        got = _run(row_parallel_linear_sp, x_full[:, ks], w_full[:, ks], g_full[rows], impl=impl, chunks=chunks)
        _check(got, row_want, f"row {impl}x{chunks} world {world}")
        # Without sequence parallelism the activations outside the TP region are replicated (full rows).
        got = _run(column_parallel_linear, x_full, w_full[cols], g_full[:, cols], impl=impl)
        _check(got, (ref[:, cols], g_full @ w_full, g_full[:, cols].t() @ x_full), f"column-ar {impl}x{chunks}")
        got = _run(row_parallel_linear, x_full[:, ks], w_full[:, ks], g_full, impl=impl, chunks=chunks)
        _check(got, (ref, (g_full @ w_full)[:, ks], g_full.t() @ x_full[:, ks]), f"row-ar {impl}x{chunks}")
        done.append(f"{impl}x{chunks}")
    return done


def _modules_rank(rank: int, world: int) -> dict[str, object]:
    """Modules on 3-D [s, b, h] input with bias, the all_reduce reduce-scatter fallback, and the dispatcher."""
    b = 2
    x_full, w_full, g_full = _dense(world, m=M_LOCAL * b)
    bias_col, bias_row = torch.arange(OUT, dtype=torch.float32), torch.ones(OUT)
    ref = x_full @ w_full.t()
    s_local = M_LOCAL
    ctx = OverlapContext(impl="chunked", chunks=2)
    col = ColumnParallelLinearSP(IN, OUT, ctx)
    row = RowParallelLinearSP(OUT, OUT, ctx)
    cols = slice(rank * OUT // world, (rank + 1) * OUT // world)
    with torch.no_grad():
        col.weight.copy_(w_full[cols])
        col.bias.copy_(bias_col[cols])
    x3 = x_full.view(world * s_local, b, IN)[rank * s_local:(rank + 1) * s_local]
    y = col(x3)
    assert y.shape == (world * s_local, b, OUT // world)
    torch.testing.assert_close(y, (ref + bias_col).view(world * s_local, b, OUT)[..., cols], rtol=1e-5, atol=1e-5)
    # Chain into the row-parallel layer (identity weight) as an MLP would: back to the sequence shard.
    with torch.no_grad():
        row.weight.copy_(torch.eye(OUT)[:, cols])
        row.bias.copy_(bias_row)
    z = row(y)
    assert z.shape == (s_local, b, OUT) and row.bias.sequence_parallel
    full_z = (ref + bias_col + bias_row).view(world * s_local, b, OUT)
    torch.testing.assert_close(z, full_z[rank * s_local:(rank + 1) * s_local], rtol=1e-5, atol=1e-5)
    z.sum().backward()
    assert col.weight.grad is not None and col.bias.grad is not None

    # Sharding dense layers: column -> row equals the dense MLP; a fused [q|k|v] projection splits per part.
    torch.manual_seed(3)
    fc1, fc2, qkv = torch.nn.Linear(IN, 2 * OUT), torch.nn.Linear(2 * OUT, IN), torch.nn.Linear(IN, 3 * OUT)
    tp_ctx = OverlapContext(impl="chunked")
    fc1_tp, fc2_tp = ColumnParallelLinear.from_linear(fc1, tp_ctx), RowParallelLinear.from_linear(fc2, tp_ctx)
    xin = torch.randn(5, IN, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(fc2_tp(torch.nn.functional.gelu(fc1_tp(xin))), fc2(torch.nn.functional.gelu(fc1(xin))),
                               rtol=1e-5, atol=1e-5)
    qkv_tp = ColumnParallelLinear.from_linear(qkv, tp_ctx, fused=3)
    local = OUT // world
    picks = torch.cat([torch.arange(p * OUT + rank * local, p * OUT + (rank + 1) * local) for p in range(3)])
    assert torch.equal(qkv_tp.weight, qkv.weight[picks]) and torch.equal(qkv_tp.bias, qkv.bias[picks])
    assert getattr(fc1_tp.weight, "tensor_parallel_dim") == 0 and getattr(fc2_tp.weight, "tensor_parallel_dim") == 1
    assert not hasattr(fc2_tp.bias, "tensor_parallel_dim")  # replicated: added once after the all-reduce

    # reduce-scatter fallback (all_reduce + this rank's rows), sync and async, equals the native collective.
    inp = torch.randn(world * 3, 5, generator=torch.Generator().manual_seed(rank))
    native, sync_fb, async_fb = (torch.empty(3, 5) for _ in range(3))
    reduce_scatter_rows(native, inp, None)
    reduce_scatter_rows(sync_fb, inp, None, via_all_reduce=True)
    reduce_scatter_rows(async_fb, inp, None, async_op=True, via_all_reduce=True).wait()
    assert torch.equal(native, sync_fb) and torch.equal(native, async_fb)
    # torch 2.7 has only the *_tensor / *_into_tensor names: drop the new ones where present (this forked rank
    # only), so both torch releases run the old-name path here.
    for name in ("all_gather_single", "reduce_scatter_single"):
        if hasattr(dist, name):
            delattr(dist, name)
    old_names = torch.empty(3, 5)
    reduce_scatter_rows(old_names, inp, None, async_op=True).wait()
    assert torch.equal(native, old_names)
    gathered = torch.empty(world * 3, 5)
    all_gather_rows(gathered, native, None, async_op=True).wait()
    assert torch.equal(gathered[rank * 3:(rank + 1) * 3], native)

    # Dispatcher on CPU/gloo without torch_npu.
    xs, ws = x_full[:M_LOCAL], w_full[cols]
    auto = OverlapContext()
    impl, why = auto.explain(xs, ws, "column")
    tiny = auto.select(xs[:1], ws, "column")
    try:
        auto.select(xs, ws, "column", impl="mc2")
        forced = "no error"
    except ValueError as err:
        forced = str(err)
    return {"auto": impl, "why": why, "tiny": tiny, "forced": forced}


@pytest.mark.parametrize("world", [2, 4])
def test_impls_match_dense_reference(world: int) -> None:
    results = run_ranks(_impls_rank, world, timeout_s=60)
    assert all(r == [f"{i}x{c}" for i, c in VARIANTS] for r in results)


def test_modules_fallback_and_dispatcher_on_cpu() -> None:
    r = run_ranks(_modules_rank, 2, timeout_s=60)[0]
    assert r["auto"] == "chunked" and r["tiny"] == "plain"
    assert "torch_npu is not imported" in r["why"][0]
    assert "'mc2' requested but unusable" in r["forced"]


def test_select_impl_logs_reason_once() -> None:
    r = run_ranks(_log_rank, 2, timeout_s=60)
    assert r[0] == 12, r[0]  # once for the first context, then once more for the second


def _log_rank(rank: int, world: int) -> int:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("mindspeed_flow.overlap.linear")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    x, w = torch.randn(4, 5), torch.randn(3, 5)
    first, second = OverlapContext(), OverlapContext()
    for _ in range(3):
        first.select(x, w)
    once = sum("torch_npu is not imported" in rec.getMessage() for rec in records)
    second.select(x, w)  # another part's context has its own log memory: it says it again, once
    return once * 10 + sum("torch_npu is not imported" in rec.getMessage() for rec in records)


# ------------------------------------------------------------------------------------------------ mc2 (emulated)
def _record_mc2_calls(torch_npu, calls: list) -> None:
    """Wrap the (emulated) torch_npu ops and the HCCL name lookup so every call's arguments are kept."""
    from mindspeed_flow.emulation import hccl

    for op in ("npu_all_gather_base_mm", "npu_mm_reduce_scatter_base", "npu_mm_all_reduce_base"):
        fn = getattr(torch_npu, op)

        def wrapped(*args, _op=op, _fn=fn, **kwargs):
            calls.append((_op, args, kwargs))
            return _fn(*args, **kwargs)

        setattr(torch_npu, op, wrapped)
    # what `group._get_backend(torch.device("npu"))` returns (strict: the npu extension's HcclBackend)
    backend_cls = hccl._STRICT_BACKEND[0] if hccl._STRICT_BACKEND else hccl.FakeHcclBackend
    original = backend_cls.get_hccl_comm_name

    def name(self, *args, **kwargs):
        calls.append(("get_hccl_comm_name", args, kwargs))
        return original(self, *args, **kwargs)

    backend_cls.get_hccl_comm_name = name


def _check_comm_name_call(args: Sequence[Any], kwargs: Mapping[str, Any], group_ranks: Sequence[int],
                          my_global_rank: int) -> list[str]:
    """`get_hccl_comm_name(rankid, init_comm=True)` takes this process's *global* rank, a member of the group."""
    bound, errors = mc2_api._bind_all("get_hccl_comm_name", args, kwargs)
    if not bound:
        return errors
    rankid = bound[0]["rankid"]
    if rankid != my_global_rank:
        errors.append(f"get_hccl_comm_name: rankid={rankid} but this process's global rank is {my_global_rank}"
                      f" (group ranks {list(group_ranks)}): pass dist.get_global_rank(group, group_rank)")
    return errors


def _mc2_rank(rank: int, world: int) -> dict[str, object]:
    """Two TP groups of 2 on 4 ranks ({0,1}, {2,3}): ranks 2 and 3 have group ranks 0 and 1, so a group-local rank
    handed to get_hccl_comm_name would show. Every MC2 call is recorded and checked against the documented API."""
    import sys

    from mindspeed_flow import emulation
    from mindspeed_flow.overlap import mc2_api

    emulation.activate()
    calls: list = []
    groups = [dist.new_group([0, 1], backend="hccl"), dist.new_group([2, 3], backend="hccl")]
    _record_mc2_calls(sys.modules["torch_npu"], calls)
    group = groups[rank // 2]
    tp, tp_rank = 2, rank % 2
    ctx = OverlapContext(group)
    k = 256
    m, n = 8, 256  # row backward contracts over n, which must also be >= 256
    # On the npu, as MC2 inputs are (strict emulation refuses host tensors in HCCL collectives).
    x_full, w_full, g_full = (t.to("npu") for t in _dense(tp, torch.bfloat16, m=m, k=k * tp, n=n))
    rows = slice(tp_rank * m, (tp_rank + 1) * m)
    cols = slice(tp_rank * n // tp, (tp_rank + 1) * n // tp)
    ks = slice(tp_rank * k, (tp_rank + 1) * k)
    cases = {"column": (column_parallel_linear_sp, x_full[rows, :k].contiguous(), w_full[cols, :k].contiguous(),
                        g_full[:, cols].contiguous()),
             "row": (row_parallel_linear_sp, x_full[:, ks].contiguous(), w_full[:, ks].contiguous(),
                     g_full[rows].contiguous()),
             "row_allreduce": (row_parallel_linear, x_full[:, ks].contiguous(), w_full[:, ks].contiguous(),
                               g_full.contiguous())}
    picked = {}
    for kind, (fn, x, w, g) in cases.items():
        picked[kind] = ctx.explain(x, w, kind)[0]
        mc2 = _run(fn, x, w, g, ctx, impl="mc2")
        chunked = _run(fn, x, w, g, OverlapContext(group), impl="chunked", chunks=2)
        fp32 = _run(fn, x.float(), w.float(), g.float(), OverlapContext(group), impl="plain")
        for name, a, b, c in zip(("out", "grad_x", "grad_w"), mc2, chunked, fp32):
            assert a.dtype == torch.bfloat16, (kind, name, a.dtype)
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=lambda s: f"{kind} {name} mc2 vs chunked: {s}")
            torch.testing.assert_close(a.float(), c, rtol=3e-2, atol=3e-2, msg=lambda s: f"{kind} {name} vs fp32: {s}")
    fp32_why = ctx.explain(x_full[rows, :k].float(), w_full[cols, :k].float(), "column")[1]
    small_k = ctx.explain(x_full[rows, :128], w_full[cols, :128], "column")[1]

    # Every recorded call, checked against the documented prototypes (both releases) and their rules.
    violations, ops = [], []
    for op, args, kwargs in calls:
        ops.append(op)
        if op == "get_hccl_comm_name":
            violations += _check_comm_name_call(args, kwargs, dist.get_process_group_ranks(group), rank)
        else:
            violations += mc2_api.check_call(op, args, kwargs, ctx.domain, tp)
    # The checker is not vacuous: the slips it exists for are caught.
    x, w = cases["column"][1], cases["column"][2]
    slips = {
        "transposed first input": mc2_api.check_call("npu_all_gather_base_mm", (w.t()[:, :8], w.t(), ctx.domain, 2),
                                                     {}, ctx.domain, 2),
        "bias given": mc2_api.check_call("npu_mm_reduce_scatter_base", (x, w.t(), ctx.domain, 2),
                                         {"bias": torch.zeros(128, dtype=x.dtype)}, ctx.domain, 2),
        "positional reduce_op": mc2_api.check_call("npu_mm_reduce_scatter_base", (x, w.t(), ctx.domain, 2, "sum"),
                                                   {}, ctx.domain, 2),
        "gather_index 1": mc2_api.check_call("npu_all_gather_base_mm", (x, w.t(), ctx.domain, 2),
                                             {"gather_index": 1}, ctx.domain, 2),
        "group-local rank": _check_comm_name_call((tp_rank,), {}, [0, 1], rank) if rank >= 2 else ["n/a"],
    }
    try:
        mc2_api.checked("npu_all_gather_base_mm", lambda *a, **k: None, ctx.domain, 2)(x, w.t(), ctx.domain, 3)
        raised = ""
    except ValueError as err:
        raised = str(err)
    return {"picked": picked, "domain": ctx.domain, "fp32": fp32_why, "small_k": small_k, "ops": sorted(set(ops)),
            "violations": violations, "slips": {k: bool(v) for k, v in slips.items()}, "raised": raised}


def test_mc2_path_under_emulation_matches_chunked_bf16_and_the_documented_api() -> None:
    results = run_ranks(_mc2_rank, 4, timeout_s=120)
    for rank, r in enumerate(results):
        assert r["picked"] == {"column": "mc2", "row": "mc2", "row_allreduce": "mc2"}
        assert str(r["domain"]).startswith("fakehccl_")
        assert any("float16 or bfloat16" in s for s in r["fp32"])
        assert any("k=128 outside" in s for s in r["small_k"])
        assert r["ops"] == ["get_hccl_comm_name", "npu_all_gather_base_mm", "npu_mm_all_reduce_base",
                            "npu_mm_reduce_scatter_base"], r["ops"]
        assert r["violations"] == [], (rank, r["violations"])
        assert all(r["slips"].values()), (rank, r["slips"])
        assert "world_size=3" in r["raised"]
    # Ranks of one TP group agree on their communication domain.
    assert results[0]["domain"] == results[1]["domain"] and results[2]["domain"] == results[3]["domain"]


def test_no_module_level_mutable_state_in_the_overlap_layer() -> None:
    """Caches live on the part's OverlapContext: the modules hold only constants, functions and classes."""
    import types

    from mindspeed_flow.overlap import collectives, linear, mc2_api

    for module in (collectives, linear, mc2_api):
        for name, value in vars(module).items():
            if name.startswith("__") or isinstance(value, (types.ModuleType, types.FunctionType, type, int, float,
                                                          str, tuple, frozenset, torch.dtype, logging.Logger)):
                continue
            if name in ("Any", "Callable", "Mapping", "Optional", "Sequence", "Protocol", "annotations"):
                continue
            assert name == "PROTOTYPES", f"{module.__name__}.{name} is module-level state ({type(value).__name__})"
