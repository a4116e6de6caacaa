"""The strict emulated NPU: each rule is checked by making the wrong call on purpose and seeing it refused, next to
positive checks (training on the npu is bit-identical to the CPU, HCCL on npu tensors equals gloo on host tensors,
save/load, memory statistics, in-place/out=/view semantics).

The emulation patches torch for the whole process and for good, so every check activates it in a forked rank
(`mindspeed_flow.utils.multiproc.run_ranks`) or in a fresh interpreter, never in the pytest process. The C++ device
is built once up front, in a subprocess, so no rank waits on the compiler.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from mindspeed_flow.utils.multiproc import run_ranks

SAME_DEVICE = "Expected all tensors to be on the same device, but found at least two devices"
NO_BACKEND = "No backend type associated with device type cpu"
TIMEOUT_S = 120


@pytest.fixture(scope="module", autouse=True)
def built_extension() -> None:
    """Build (or find) the npu extension in a throwaway interpreter before any rank needs it."""
    code = "from mindspeed_flow.emulation import npu_ext; npu_ext.load()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _strict(local_world_size: int | None = None) -> None:
    """Activate the strict emulation in this (forked) rank; LOCAL_WORLD_SIZE sets the npu count."""
    if local_world_size is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    from mindspeed_flow import emulation

    assert emulation.activate(mode="strict") == "strict"


def _refusal(call: Callable[[], Any]) -> str:
    """The error text of a call that must fail; "accepted" if it ran."""
    try:
        call()
    except RuntimeError as err:
        return str(err)
    return "accepted"


# ------------------------------------------------------------------------------------------------ refusals
def _mixed_devices(rank: int, world: int) -> dict[str, str]:
    _strict()
    dev, host = torch.ones(3, 4, device="npu"), torch.ones(3, 4)
    idx = torch.tensor([0, 2])
    return {
        "add": _refusal(lambda: dev + host),
        "add_host_first": _refusal(lambda: host.add_(dev)),
        "cat": _refusal(lambda: torch.cat([dev, host])),
        "matmul": _refusal(lambda: dev @ host.t()),
        # what a device allows: 0-dim host scalars, cross-device copies, host index tensors
        "scalar": str((dev * torch.tensor(2.0)).device),
        "copy": str(dev.copy_(host).device),
        "to_host": str((dev + 1).cpu().device),
        "index": str(dev[idx].device),
        "index_put": str(dev.index_put_((idx,), torch.zeros(2, 4, device="npu")).device),
        "index_put_host_values": _refusal(lambda: dev.index_put_((idx,), torch.zeros(2, 4))),
    }


def test_host_and_device_tensors_in_one_op_are_refused() -> None:
    got = run_ranks(_mixed_devices, 1, timeout_s=TIMEOUT_S)[0]
    for key in ("add", "add_host_first", "cat", "matmul", "index_put_host_values"):
        assert got[key].startswith(f"{SAME_DEVICE}, npu:0 and cpu!"), (key, got[key])
    assert got["scalar"] == got["copy"] == got["index"] == got["index_put"] == "npu:0"
    assert got["to_host"] == "cpu"


def _host_input_to_linear(rank: int, world: int) -> dict[str, str]:
    _strict()
    layer = torch.nn.Linear(4, 2).npu()
    ok = layer(torch.ones(3, 4).npu())
    return {"refused": _refusal(lambda: layer(torch.ones(3, 4))), "ok": str(ok.device),
            "weight": layer.weight.type()}


def test_host_input_to_a_linear_on_the_device_is_refused() -> None:
    got = run_ranks(_host_input_to_linear, 1, timeout_s=TIMEOUT_S)[0]
    assert got["refused"].startswith(f"{SAME_DEVICE}, npu:0 and cpu!"), got["refused"]
    assert got["ok"] == "npu:0" and got["weight"] == "torch.npu.FloatTensor"


def _two_devices(rank: int, world: int) -> dict[str, Any]:
    import threading

    _strict(local_world_size=2)
    a, b = torch.ones(2, device="npu:0"), torch.ones(2, device="npu:1")
    seen: list[int] = []

    def other_thread() -> None:
        torch.npu.set_device(1)
        seen.append(torch.empty(1, device="npu").device.index)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    return {"mixed": _refusal(lambda: a + b), "copy": str(b.copy_(a).device), "count": torch.npu.device_count(),
            "out_of_range": _refusal(lambda: torch.npu.set_device(2)), "other_thread": seen[0],
            "this_thread": torch.npu.current_device(), "sum_on_1": str((b + b).device)}


def test_two_npu_devices_in_one_op_are_refused() -> None:
    got = run_ranks(_two_devices, 1, timeout_s=TIMEOUT_S)[0]
    assert got["mixed"].startswith(f"{SAME_DEVICE}, npu:0 and npu:1!"), got["mixed"]
    assert got["copy"] == "npu:1" and got["sum_on_1"] == "npu:1" and got["count"] == 2
    assert "invalid device ordinal 2" in got["out_of_range"]
    assert (got["other_thread"], got["this_thread"]) == (1, 0)  # the device index is per thread, as on CUDA/ACL


def _host_in_hccl(rank: int, world: int) -> dict[str, str]:
    _strict()
    hccl = dist.new_group(list(range(world)), backend="hccl")
    gloo = dist.new_group(list(range(world)), backend="gloo")
    host = torch.ones(4)
    got = {"all_reduce": _refusal(lambda: dist.all_reduce(host, group=hccl)),
           "broadcast": _refusal(lambda: dist.broadcast(host, src=0, group=hccl)),
           "send": _refusal(lambda: dist.send(host, dst=1 - rank, group=hccl)),
           "all_gather_mixed": _refusal(lambda: dist.all_gather([torch.ones(4, device="npu"), torch.ones(4)],
                                                                torch.ones(4, device="npu"), group=hccl))}
    dist.all_reduce(host, group=gloo)  # a gloo group still takes host tensors
    got["gloo"] = str(host.tolist())
    got["backend"] = dist.get_backend(hccl)
    return got


def test_host_tensors_in_hccl_collectives_and_p2p_are_refused() -> None:
    for got in run_ranks(_host_in_hccl, 2, timeout_s=TIMEOUT_S):
        for key in ("all_reduce", "broadcast", "send", "all_gather_mixed"):
            assert NO_BACKEND in got[key], (key, got[key])
        assert got["gloo"] == "[2.0, 2.0, 2.0, 2.0]" and got["backend"] == "hccl"


def _batch_p2p(rank: int, world: int) -> dict[str, Any]:
    _strict()
    hccl = dist.new_group(list(range(world)), backend="hccl")
    gloo = dist.new_group(list(range(world)), backend="gloo")
    peer = 1 - rank
    send = torch.arange(3, dtype=torch.float32, device="npu") + 10 * rank
    recv = torch.empty(3, device="npu")
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer, hccl), dist.P2POp(dist.irecv, recv, peer, hccl)])
    count = len(works)
    for work in works:
        work.wait()
    # HCCL has no message tags: a send and a receive of one pair match in posting order, whatever their tags.
    # (Rank 0 sends first, rank 1 receives first: a pair's operations run in order on one stream.)
    tagged = torch.empty(3, device="npu")
    ops = [lambda: dist.isend(send, peer, group=hccl, tag=5), lambda: dist.irecv(tagged, peer, group=hccl, tag=9)]
    reqs = [op() for op in (ops if rank == 0 else ops[::-1])]
    for req in reqs:
        req.wait()
    mixed = [dist.P2POp(dist.isend, send, peer, hccl), dist.P2POp(dist.irecv, torch.empty(3), peer, hccl)]
    host_send, host_recv = torch.full((3,), float(rank)), torch.empty(3)
    gloo_works = dist.batch_isend_irecv([dist.P2POp(dist.isend, host_send, peer, gloo),
                                         dist.P2POp(dist.irecv, host_recv, peer, gloo)])
    for work in gloo_works:
        work.wait()
    return {"works": count, "recv": recv.cpu().tolist(), "device": str(recv.device), "tagged": tagged.cpu().tolist(),
            "mixed": _refusal(lambda: dist.batch_isend_irecv(mixed)), "gloo_works": len(gloo_works),
            "gloo_recv": host_recv.tolist()}


def test_batch_isend_irecv_is_one_work_per_batch_and_refuses_host_tensors() -> None:
    got = run_ranks(_batch_p2p, 2, timeout_s=TIMEOUT_S)
    for rank, result in enumerate(got):
        assert result["works"] == 1  # torch_npu's contract on npu tensors: one work for the whole batch
        assert result["recv"] == result["tagged"] == [10.0 * (1 - rank) + i for i in range(3)]
        assert result["device"] == "npu:0"
        assert NO_BACKEND in result["mixed"], result["mixed"]
        assert result["gloo_works"] == 2 and result["gloo_recv"] == [float(1 - rank)] * 3  # gloo: one per op


def _stream_order(rank: int, world: int) -> dict[str, Any]:
    """Operations wait on each other as on a device stream: each rank posts a receive, then the send its peer's
    receive waits for, on ONE pair stream (hung on a device: each receive sits ahead of the send that would
    satisfy the other), and the same two operations on TWO groups, one per direction (fine)."""
    import datetime

    _strict()
    peer = 1 - rank
    one, other = (dist.new_group([0, 1], backend="hccl") for _ in range(2))
    send = torch.full((4,), float(rank), device="npu")
    got = torch.empty(4, device="npu")
    # Two communicators, one per direction: each pair stream holds one operation, nothing waits in a cycle.
    recv_w = dist.irecv(got, peer, group=one if rank == 0 else other)
    send_w = dist.isend(send, peer, group=other if rank == 0 else one)
    recv_w.wait()
    send_w.wait()
    crossed_ok = got.cpu().tolist() == [float(peer)] * 4
    # One communicator: the receive is ahead of the send on this rank's pair stream, and on the peer's too.
    recv_w = dist.irecv(torch.empty(4, device="npu"), peer, group=one)
    send_w = dist.isend(send, peer, group=one)
    try:
        send_w.wait(datetime.timedelta(seconds=5))  # can never complete: nothing the peer does can start it
        hung = "completed"
    except RuntimeError as err:
        hung = str(err)
    # Stay until the peer has seen it too, then leave without tearing the stuck streams down.
    dist.barrier(group=dist.new_group([0, 1], backend="gloo"))
    return {"crossed_ok": crossed_ok, "hung": hung, "recv_done": recv_w.is_completed()}


def test_hccl_runs_each_stream_in_order_as_a_device_does() -> None:
    got = run_ranks(_stream_order, 2, timeout_s=TIMEOUT_S)
    for result in got:
        assert result["crossed_ok"]
        assert "timed out" in result["hung"].lower(), result["hung"]
        assert not result["recv_done"]


# ------------------------------------------------------------------------------------------------ same results
_TRAINING = textwrap.dedent("""
    import json, torch, torch.nn as nn, torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.checkpoint import checkpoint
    from mindspeed_flow import emulation
    emulation.activate(mode="strict")
    from mindspeed_flow.emulation import strict

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 4, 3, padding=1)
            self.inp = nn.Linear(16, 32)
            self.qkv = nn.Linear(32, 96)
            self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
            self.norm = nn.LayerNorm(32)
            self.out = nn.Linear(32, 4)

        def forward(self, img, x):
            x = self.inp(x + self.conv(img).mean(dim=(1, 2, 3), keepdim=True).squeeze(-1))  # [b, s, 32]
            q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 16).permute(2, 0, 3, 1, 4)
            with sdpa_kernel(SDPBackend.MATH):
                att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
            x = x + att
            x = x + checkpoint(self.mlp, self.norm(x), use_reentrant=False)
            return self.out(x)

    def train(device, dtype):
        torch.manual_seed(0)
        net = Net().to(dtype)
        img, x, y = torch.randn(2, 2, 6, 6), torch.randn(2, 5, 16), torch.randn(2, 5, 4)
        net, img, x, y = net.to(device), img.to(device, dtype), x.to(device, dtype), y.to(device, dtype)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=True)
        losses = []
        for _ in range(3):
            loss = F.mse_loss(net(img, x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5, foreach=True)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        params = [p.detach().to("cpu") for p in net.parameters()]
        return losses, params, next(net.parameters()).device.type

    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        cpu_losses, cpu_params, _ = train("cpu", dtype)
        npu_losses, npu_params, where = train("npu", dtype)
        result[str(dtype)] = {"losses": cpu_losses == npu_losses, "device": where,
                              "params": all(torch.equal(a, b) for a, b in zip(cpu_params, npu_params))}
    result["engine_device_threads"] = not strict._STATE.get("autograd_on_calling_thread", False)
    print("RESULT", json.dumps(result))
""")


def _result_line(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def test_training_on_the_npu_is_bit_identical_to_the_cpu() -> None:
    """MLP, bf16, SDPA (math), conv2d, AdamW (foreach), clip_grad_norm_ and activation checkpointing, three steps,
    in a fresh interpreter so backward runs on autograd's npu device thread as it would in a job."""
    proc = subprocess.run([sys.executable, "-c", _TRAINING], capture_output=True, text=True, timeout=300)
    got = _result_line(proc)
    assert got.pop("engine_device_threads") is True
    for dtype, res in got.items():
        assert res == {"losses": True, "device": "npu", "params": True}, (dtype, res)


def _collectives(rank: int, world: int) -> dict[str, bool]:
    _strict()
    hccl = dist.new_group(list(range(world)), backend="hccl")
    gloo = dist.new_group(list(range(world)), backend="gloo")
    gen = torch.Generator().manual_seed(rank)
    base = torch.randn(world * 4, generator=gen)

    def both(run: Callable[[Callable[[torch.Tensor], torch.Tensor], Any], torch.Tensor]) -> bool:
        """Run one collective on host tensors over gloo and on npu tensors over hccl; True if results agree."""
        want = run(lambda t: t.clone(), gloo)
        got = run(lambda t: t.clone().to("npu"), hccl)
        return got.device.type == "npu" and torch.equal(got.cpu(), want)

    def all_reduce(make: Callable, group: Any, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        t = make(base)
        dist.all_reduce(t, op=op, group=group)
        return t

    def all_gather(make: Callable, group: Any) -> torch.Tensor:
        outs = [make(torch.empty(4)) for _ in range(world)]
        dist.all_gather(outs, make(base[:4]), group=group)
        return torch.cat(outs)

    def all_gather_into(make: Callable, group: Any) -> torch.Tensor:
        out = make(torch.empty(world * 4))
        dist.all_gather_into_tensor(out, make(base[:4]), group=group)
        return out

    def reduce_scatter(make: Callable, group: Any) -> torch.Tensor:
        out = make(torch.empty(4))
        dist.reduce_scatter_tensor(out, make(base), group=group)
        return out

    def broadcast(make: Callable, group: Any) -> torch.Tensor:
        t = make(base)
        dist.broadcast(t, src=1, group=group)
        return t

    def all_to_all(make: Callable, group: Any) -> torch.Tensor:
        out = make(torch.empty(world * 4))
        dist.all_to_all_single(out, make(base), group=group)
        return out

    def p2p(make: Callable, group: Any) -> torch.Tensor:
        peer = 1 - rank
        out = make(torch.empty(world * 4))
        # Rank 0 sends first, rank 1 receives first: on a device a pair's send and receive run in order on one
        # stream, so both ranks sending first would wait for each other (test_hccl_runs_each_stream_in_order...).
        ops = [lambda: dist.isend(make(base), group_dst=peer, group=group),
               lambda: dist.irecv(out, group_src=peer, group=group)]
        reqs = [op() for op in (ops if rank == 0 else ops[::-1])]
        for req in reqs:
            req.wait()
        return out

    return {"all_reduce": both(all_reduce), "all_reduce_max": both(lambda m, g: all_reduce(m, g, dist.ReduceOp.MAX)),
            "all_gather": both(all_gather), "all_gather_into_tensor": both(all_gather_into),
            "reduce_scatter_tensor": both(reduce_scatter), "broadcast": both(broadcast),
            "all_to_all_single": both(all_to_all), "isend_irecv": both(p2p), **_averages(rank, world, hccl, base)}


def _averages(rank: int, world: int, hccl: Any, base: torch.Tensor) -> dict[str, bool]:
    """ReduceOp.AVG, which gloo refuses: on hccl (torch_npu sums, then divides by the group size) it equals the gloo
    sum divided by the group size, for all-reduce and reduce-scatter, float and integer tensors."""
    gloo = dist.new_group(list(range(world)), backend="gloo")
    summed = base.clone()
    dist.all_reduce(summed, group=gloo)
    avg = base.clone().npu()
    dist.all_reduce(avg, op=dist.ReduceOp.AVG, group=hccl)
    ints = torch.full((3,), 3 + rank, dtype=torch.int64).npu()  # (3 + 4) / 2 -> 3, truncated as torch_npu does
    dist.all_reduce(ints, op=dist.ReduceOp.AVG, group=hccl)
    shard = torch.empty(4).npu()
    dist.reduce_scatter_tensor(shard, base.clone().npu(), op=dist.ReduceOp.AVG, group=hccl)
    return {"all_reduce_avg": torch.allclose(avg.cpu(), summed / world),
            "all_reduce_avg_int": ints.cpu().tolist() == [3, 3, 3],
            "reduce_scatter_avg": torch.allclose(shard.cpu(), (summed / world)[rank * 4:(rank + 1) * 4])}


def test_collectives_on_npu_tensors_equal_gloo_on_host_tensors() -> None:
    for got in run_ranks(_collectives, 2, timeout_s=TIMEOUT_S):
        assert all(got.values()), got


# ------------------------------------------------------------------------------------------------ device semantics
def _save_load_and_aliases(rank: int, world: int, path: str) -> dict[str, Any]:
    _strict()
    from mindspeed_flow.emulation import npu_ext

    x = torch.randn(5, 3).npu()
    torch.save({"x": x, "view": x[1:3]}, path)
    loaded = torch.load(path)
    on_host = torch.load(path, map_location="cpu")
    equal = torch.equal(loaded["x"].cpu(), x.cpu())
    storage = torch.UntypedStorage(8).npu()
    host = npu_ext.host_alias(x)
    host[0, 0] = 42.0  # writes through to the npu memory
    back = npu_ext.device_alias(torch.arange(4.0), 0)
    return {"loaded": str(loaded["x"].device), "equal": equal,
            "view_shares": loaded["view"].untyped_storage().data_ptr() == loaded["x"].untyped_storage().data_ptr(),
            "on_host": str(on_host["x"].device), "storage": str(storage.device), "write_through": x[0, 0].item(),
            "alias_device": str(back.device), "alias_sum": back.sum().item(), "repr": repr(x[:1, :1])}


def test_save_load_round_trip_and_host_device_aliases(tmp_path) -> None:
    got = run_ranks(_save_load_and_aliases, 1, str(tmp_path / "t.pt"), timeout_s=TIMEOUT_S)[0]
    assert got["loaded"] == "npu:0" and got["equal"] and got["view_shares"] and got["on_host"] == "cpu"
    assert got["storage"] == "npu:0" and got["write_through"] == 42.0
    assert got["alias_device"] == "npu:0" and got["alias_sum"] == 6.0 and "device='npu:0'" in got["repr"]


def _memory(rank: int, world: int) -> dict[str, int]:
    _strict()
    torch.npu.reset_peak_memory_stats()
    start = torch.npu.memory_allocated()
    x = torch.empty(1024, device="npu")  # 4 KiB from the npu allocator
    after_alloc = torch.npu.memory_allocated()
    y = x.fill_(1.0) * 2  # a CPU kernel's output, adopted by the npu
    after_kernel = torch.npu.memory_allocated()
    del x, y
    return {"alloc": after_alloc - start, "kernel": after_kernel - after_alloc,
            "freed": torch.npu.memory_allocated() - start, "peak": torch.npu.max_memory_allocated() - start,
            "cuda_view": torch.cuda.memory_allocated() - start}


def test_memory_allocated_tracks_allocations() -> None:
    got = run_ranks(_memory, 1, timeout_s=TIMEOUT_S)[0]
    assert got == {"alloc": 4096, "kernel": 4096, "freed": 0, "peak": 8192, "cuda_view": 0}


def _in_place_out_and_views(rank: int, world: int) -> dict[str, Any]:
    _strict()
    base = torch.zeros(4, 4, device="npu")
    base[1:3].add_(1.0)  # in place on a view: lands in the base
    diag = base.diagonal()
    diag.fill_(5.0)
    windows = base.view(16).unfold(0, 4, 4)  # a view made by a CPU kernel (unfold) stays on the npu storage
    windows[0, 0] = 7.0
    out = torch.empty(0, device="npu")
    torch.add(base, 1.0, out=out)  # out= grown by the CPU kernel: re-pointed at the new memory
    grown = torch.arange(3.0, device="npu")
    grown.resize_(6)
    sink = torch.empty(0, device="npu")
    sink.set_(base.untyped_storage(), 4, (2, 2), (4, 1))
    return {"base": base.cpu().tolist(), "out": out.cpu().tolist(), "out_device": str(out.device),
            "unfold_shares": windows.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(),
            "grown_head": grown[:3].cpu().tolist(), "grown_numel": grown.numel(), "set": sink.cpu().tolist()}


def test_in_place_out_and_view_ops_keep_npu_memory() -> None:
    got = run_ranks(_in_place_out_and_views, 1, timeout_s=TIMEOUT_S)[0]
    want = [[7.0, 0.0, 0.0, 0.0], [1.0, 5.0, 1.0, 1.0], [1.0, 1.0, 5.0, 1.0], [0.0, 0.0, 0.0, 5.0]]
    assert got["base"] == want and got["unfold_shares"]
    assert got["out"] == [[v + 1 for v in row] for row in want] and got["out_device"] == "npu:0"
    assert got["grown_head"] == [0.0, 1.0, 2.0] and got["grown_numel"] == 6
    assert got["set"] == [[1.0, 5.0], [1.0, 1.0]]


def _autocast(rank: int, world: int) -> dict[str, str]:
    _strict()
    a = torch.randn(4, 4, device="npu")
    with torch.autocast("cuda", dtype=torch.bfloat16):  # transfer_to_npu: cuda -> npu
        mm = a @ a
        soft = torch.softmax(mm, dim=-1)  # fp32 policy, as on CUDA
        mixed = torch.addcmul(a, mm, a)  # promote policy
    return {"mm": str(mm.dtype), "softmax": str(soft.dtype), "addcmul": str(mixed.dtype), "device": str(mm.device)}


def test_autocast_on_the_npu_casts_with_cuda_policies() -> None:
    got = run_ranks(_autocast, 1, timeout_s=TIMEOUT_S)[0]
    assert got == {"mm": "torch.bfloat16", "softmax": "torch.float32", "addcmul": "torch.float32",
                   "device": "npu:0"}
