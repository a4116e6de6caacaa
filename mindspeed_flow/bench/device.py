"""`mindspeed-flow bench device`: the runtime's single-device pieces on the accelerator at hand, in one run.

    mindspeed-flow bench device [--device auto] [--out runs/bench-device] [--sections pool,attention,build,norm,job]
                                [--model small_qwen2_vl] [--experiment device_small] [--steps 8] [--json]

Made for a short lease of one GPU or NPU (one device cannot host two NCCL/HCCL ranks, so everything here is what
one device can show), and runnable on the CPU (`--device cpu --model tiny_qwen2_vl --experiment ...`) so CI
keeps it working. Each section reports `ok` or the error that stopped it; one failing section does not stop the
others.

- pool: two ranks on the one device (host-staged transport over gloo: the device-backend payload groups need two
  devices) put embeddings of several sizes; the consumer's device tier holds them in device memory and larger
  ones land in the host tier; values, tiers and returned gradients are checked.
- attention: the varlen kernel the accelerator picks vs masked SDPA on a packed microbatch: outputs and input
  gradients compared on 2,048 tokens, then peak memory of both at --tokens (16,384) from `bench attention`.
- build: device memory after building and moving the whole model, the encoder part only and the backbone part
  only (`build_vlm(parts=...)`): an encoder rank holds no backbone parameter.
- norm: the global gradient norm and clipping on device with a one-rank process group of the device's backend,
  under `torch.cuda.set_sync_debug_mode("error")` where it exists (a host sync raises), checked against
  `torch.nn.utils.clip_grad_norm_`.
- job: `mindspeed-flow profile --device` calibrates the planner on this device (encoder and backbone calls of
  --model timed at the job's shapes), `mindspeed-flow train experiment=--experiment` trains the job on this
  device, and the step simulator, calibrated by that profile, predicts each measured step: the report gives
  both, their error and the range the calibration spread allows.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml

from mindspeed_flow.accelerator import Accelerator, detect_type
from mindspeed_flow.bench import attention as bench_attention
from mindspeed_flow.bench import bench_main
from mindspeed_flow.config import load as config_load
from mindspeed_flow.hosts.torch.attention import Segments, varlen_attention
from mindspeed_flow.hosts.torch.build import build_vlm, part_parameters
from mindspeed_flow.hosts.torch.data_parallel import clip_grads_, global_grad_norm, grad_sq_sum
from mindspeed_flow.hosts.torch.split import split_vlm
from mindspeed_flow.planner import profile
from mindspeed_flow.planner.hardware import recipes_dir
from mindspeed_flow.planner.inputs import build_problem, parse_kv, resolve_model
from mindspeed_flow.planner.simulate import simulate_job
from mindspeed_flow.pool import EmbeddingPool
from mindspeed_flow.skus import sku_of
from mindspeed_flow.utils.multiproc import free_port, run_ranks

SECTIONS = ("pool", "attention", "build", "norm", "job")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mindspeed-flow bench device", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", help="auto | cuda | npu | cpu")
    p.add_argument("--out", default=None, help="folder for the profile, the job's run and report.json "
                   "(default: runs/bench-device-<time>; an existing folder is refused)")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--model", default="small_qwen2_vl", help="model recipe of the build and job sections")
    p.add_argument("--data", default="infovqa_1280", help="data recipe the profile samples")
    p.add_argument("--experiment", default="device_small", help="the job section's experiment recipe")
    p.add_argument("--steps", type=int, default=12, help="training steps of the job")
    p.add_argument("--warmup", type=int, default=4, help="first steps of the job left out of the comparison "
                   "(allocator and kernel warm-up)")
    p.add_argument("--tokens", type=int, default=16384, help="packed microbatch of the attention memory figure")
    p.add_argument("--budgets", default="4096,8192,16384", help="backbone token budgets the profile times")
    p.add_argument("--overrides", default="", help="extra Hydra overrides for the job, space separated")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(list(argv))
    args.section_list = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in args.section_list if s not in SECTIONS]
    if bad:
        p.error(f"--sections: unknown {bad}; choose from {list(SECTIONS)}")
    if args.warmup < 0 or args.steps <= args.warmup:
        p.error(f"--steps {args.steps} --warmup {args.warmup}: need warmup >= 0 and at least one measured step")
    return args


# ------------------------------------------------------------------------------------------------------ pool
POOL_ITEMS = [(0, 64), (1, 1024), (2, 4096), (3, 0), (4, 300)]  # (sample id, tokens)
POOL_HIDDEN = 1024
POOL_HOST_TIER_BYTES = 4096 * POOL_HIDDEN * 2 - 1  # the 4,096-token bf16 item is over it: host tier


def _pool_rank(rank: int, world: int, device_type: str) -> dict[str, Any]:
    device = torch.device(device_type, 0) if device_type != "cpu" else torch.device("cpu")

    def emb(sid: int, tokens: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(sid)
        return torch.randn(tokens, POOL_HIDDEN, generator=g).to(torch.bfloat16)

    pool = EmbeddingPool(rank=rank, group=None, device=device, capacity_bytes=64 << 20, timeout_s=120.0,
                         host_tier_bytes=POOL_HOST_TIER_BYTES)
    out: dict[str, Any] = {"rank": rank}
    with pool:
        if rank == 0:
            for sid, tokens in POOL_ITEMS:
                pool.put(emb(sid, tokens).to(device), sample_id=sid, step=0, consumer=1)
            grads_ok = []
            for sid, tokens in POOL_ITEMS:
                g = pool.wait_grad(sample_id=sid, step=0, consumer=1)
                grads_ok.append(bool(g.device == device and torch.equal(g.cpu(), 2 * emb(sid, tokens))))
            out["grads_ok"] = all(grads_ok)
        else:
            pool.expect(producer=0, items=[(sid, 0) for sid, _ in POOL_ITEMS])
            tiers, values_ok = {}, []
            for sid, tokens in POOL_ITEMS:
                e = pool.get(sample_id=sid, step=0, producer=0, expected_shape=(tokens, POOL_HIDDEN))
                values_ok.append(bool(e.device == device and torch.equal(e.cpu(), emb(sid, tokens))))
                pool.return_grad(2 * e, sample_id=sid, step=0, producer=0)
            pool.flush()
            stats = pool.stats()
            out["values_ok"] = all(values_ok)
            out["stats"] = {k: v for k, v in vars(stats).items() if isinstance(v, (int, float))}
            out["tiers"] = tiers
    return out


def section_pool(args: argparse.Namespace, device_type: str) -> dict[str, Any]:
    producer, consumer = run_ranks(_pool_rank, 2, device_type, timeout_s=180.0)
    ok = bool(producer.get("grads_ok") and consumer.get("values_ok"))
    return {"ok": ok, "device": device_type, "transport": "host-staged over gloo (one device)",
            "items_tokens": [t for _, t in POOL_ITEMS], "hidden": POOL_HIDDEN,
            "host_tier_bytes": POOL_HOST_TIER_BYTES, "consumer_stats": consumer.get("stats", {}),
            "values_equal": consumer.get("values_ok"), "grads_equal": producer.get("grads_ok")}


# ------------------------------------------------------------------------------------------------- attention
def section_attention(args: argparse.Namespace, device_type: str) -> dict[str, Any]:
    acc = Accelerator.for_type(device_type)
    dev = acc.device()
    dtype = torch.bfloat16 if device_type != "cpu" else torch.float32
    heads, kv_heads, head_dim = 16, 4, 128
    lengths = bench_attention.segment_lengths(2048, 8, 0)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 2048, head_dim, generator=g).to(dev, dtype).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(1, 2048, heads, head_dim, generator=g).to(dev, dtype)
    out = varlen_attention(q, k, v, Segments.from_lengths(lengths))
    out.backward(grad)
    got = (out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float())
    # reference in fp32 with the explicit block-causal mask
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    rep = heads // kv_heads
    mask = bench_attention.block_causal_mask(lengths, dev)
    ref = F.scaled_dot_product_attention(qr, kr.repeat_interleave(rep, 1), vr.repeat_interleave(rep, 1),
                                         attn_mask=mask).transpose(1, 2)
    ref.backward(grad.float())
    want = (ref.detach(), qr.grad, kr.grad, vr.grad)
    errs = {name: float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    del q, k, v, grad, out, qr, kr, vr, ref, mask, got, want
    if acc.module is not None:
        acc.module.empty_cache()
    mem = bench_attention.measure(argparse.Namespace(
        tokens=args.tokens, segments=16, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        dtype="bf16" if dtype == torch.bfloat16 else "fp32", device=device_type, seed=0))
    return {"ok": all(e <= tol for e in errs.values()), "kernel": acc.varlen_attention_kernel,
            "dtype": str(dtype), "parity_tokens": 2048, "relative_max_error_vs_fp32_mask": errs, "tolerance": tol,
            "memory": mem}


# ----------------------------------------------------------------------------------------------------- build
def section_build(args: argparse.Namespace, device_type: str) -> dict[str, Any]:
    acc = Accelerator.for_type(device_type)
    ref = resolve_model(args.model)
    dtype = getattr(torch, ref.dtype)
    family = ref.hf_config["model_type"]
    mod = acc.module  # torch.cuda / torch.npu; None on the CPU (device figures are then not reported)
    rows: dict[str, Any] = {}
    for name, parts in (("encoder", ("encoder",)), ("backbone", ("backbone",)), ("whole", ("encoder", "backbone"))):
        acc.synchronize()
        before = mod.memory_allocated() if mod is not None else 0
        acc.reset_peak_memory()
        model = build_vlm(family, ref.hf_config, seed=0, dtype=dtype, parts=parts)
        encoder, backbone = split_vlm(model)
        for part_name, module in (("encoder", encoder), ("backbone", backbone)):
            if part_name in parts:
                module.to(acc.device())
        acc.synchronize()
        by_part = part_parameters(model, family)
        rows[name] = {
            "device_bytes": (mod.memory_allocated() - before) if mod is not None else None,
            "device_peak_bytes": (mod.max_memory_allocated() - before) if mod is not None else None,
            "materialized": {p: sum(t.numel() * t.element_size() for t in ps if t.device.type != "meta")
                             for p, ps in by_part.items()},
        }
        del model, encoder, backbone, by_part, module
        gc.collect()  # the parts refer back to the model: free this build before the next one is measured
        if mod is not None:
            mod.empty_cache()
    enc = rows["encoder"]
    return {"ok": enc["materialized"]["backbone"] == 0 and rows["backbone"]["materialized"]["encoder"] == 0,
            "model": args.model, "dtype": ref.dtype, "builds": rows}


# ------------------------------------------------------------------------------------------------------ norm
def section_norm(args: argparse.Namespace, device_type: str) -> dict[str, Any]:
    acc = Accelerator.for_type(device_type)
    dev = acc.device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).to(dev)
    ref_model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).to(dev)
    ref_model.load_state_dict(model.state_dict())
    x = torch.randn(64, 512, device=dev)
    for m in (model, ref_model):
        (m(x) ** 2).mean().mul(1e3).backward()
    started_group = not dist.is_initialized()
    if started_group:
        store = dist.TCPStore("127.0.0.1", free_port(), 1, True)
        dist.init_process_group(acc.backend, store=store, rank=0, world_size=1)
    sync_debug = getattr(acc.module, "set_sync_debug_mode", None) if acc.module is not None else None
    try:
        if sync_debug is not None:
            sync_debug("error")  # any host synchronisation inside raises
        share = grad_sq_sum(model, replicated_over=1)
        norm = global_grad_norm([share], device=dev)
        coef = clip_grads_(model.parameters(), norm, max_norm=1.0)
    finally:
        if sync_debug is not None:
            sync_debug("default")
        if started_group:
            dist.destroy_process_group()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm=1.0)
    grads_close = all(torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)
                      for a, b in zip(model.parameters(), ref_model.parameters()))
    rel = abs(float(norm) / float(ref_norm) - 1)
    return {"ok": rel < 1e-4 and grads_close, "backend": acc.backend, "norm_device": str(norm.device),
            "host_sync_checked": sync_debug is not None, "norm": float(norm), "reference_norm": float(ref_norm),
            "relative_error": rel, "clip_coef": float(coef), "clipped_grads_equal_reference": grads_close}


# ------------------------------------------------------------------------------------------------------- job
def _cluster_for(device_name: str) -> str:
    """The cluster preset whose SKU is this device (one device of it); cpu when none matches."""
    sku = sku_of(device_name)
    folder = Path(recipes_dir()) / "cluster"
    for path in sorted(folder.glob("*.yaml")):
        if sku and (yaml.safe_load(path.read_text()) or {}).get("sku") == sku:
            return path.stem
    return "cpu"


def section_job(args: argparse.Namespace, device_type: str, out: Path) -> dict[str, Any]:
    acc = Accelerator.for_type(device_type)
    cluster = _cluster_for(acc.device_name) if device_type != "cpu" else "cpu"
    # 1. calibrate on this device
    t0 = time.perf_counter()
    table = profile.measure(args.model, args.data, cluster, [int(b) for b in args.budgets.split(",")], repeats=3,
                            links=False, device=device_type)
    profile_path = out / "profile.json"
    profile.write_outputs(table, str(profile_path), None)
    profile_s = time.perf_counter() - t0
    # 2. train the job on this device (a subprocess through the CLI, as a user runs it)
    run_dir = out / "run"
    cmd = [sys.executable, "-m", "mindspeed_flow.cli", "train", f"experiment={args.experiment}",
           f"run_dir={run_dir}", f"trainer.steps={args.steps}", "trainer.progress=false", *args.overrides.split()]
    env = dict(os.environ, MSF_DEVICE=device_type)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    train_s = time.perf_counter() - t0
    (out / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"training failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-1500:]}")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    measured = {int(r["step"]): float(r["step_seconds"]) for r in lines if int(r["step"]) >= args.warmup}
    # 3. predict each measured step with the calibrated simulator (same batches, same step plans)
    job = config_load.load(run_dir / "config.yaml")
    problem, _ = build_problem(parse_kv([f"model={args.model}", f"data={args.data}", f"cluster={cluster}",
                                         "devices=1", f"planner.profile={profile_path}",
                                         f"global_batch={job.trainer.global_batch_size}"]))
    simulated = simulate_job(job, problem.ctx, sorted(measured), cores=0.0)
    rows = [{"step": s, "measured_s": measured[s], "simulated_s": simulated[s].step_seconds,
             "error": simulated[s].step_seconds / measured[s] - 1} for s in sorted(measured)]
    spread = table["calibration"]["spread"]
    mean_meas = statistics.mean(measured.values())
    mean_sim = statistics.mean(r["simulated_s"] for r in rows)
    mfu = [float(r["mfu"]) for r in lines if int(r["step"]) >= args.warmup and "mfu" in r]
    return {"ok": True, "cluster_preset": cluster, "device": acc.device_name, "profile_seconds": profile_s,
            "train_seconds": train_s, "calibration": table["calibration"], "profile_rows": table["rows"],
            "steps": rows, "mean_measured_s": mean_meas, "mean_simulated_s": mean_sim,
            "mean_error": mean_sim / mean_meas - 1, "mean_abs_error": statistics.mean(abs(r["error"]) for r in rows),
            "prediction_range_s": [mean_sim * (1 - max(spread.values())), mean_sim * (1 + max(spread.values()))],
            "measured_mfu": statistics.mean(mfu) if mfu else None,
            "losses": [float(r["loss"]) for r in lines]}


# ------------------------------------------------------------------------------------------------------ main
def measure(args: argparse.Namespace) -> dict[str, Any]:
    device_type = detect_type(args.device)  # without initialising it: the pool section forks first
    out = Path(args.out or f"runs/bench-device-{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"bench device: --out {out} already holds files; give a new folder (nothing is "
                         "overwritten)")
    out.mkdir(parents=True, exist_ok=True)
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "pool": lambda: section_pool(args, device_type),  # first: it forks before this process touches the device
        "attention": lambda: section_attention(args, device_type),
        "build": lambda: section_build(args, device_type),
        "norm": lambda: section_norm(args, device_type),
        "job": lambda: section_job(args, device_type, out),
    }
    report: dict[str, Any] = {"device_type": device_type, "out": str(out), "sections": {}}
    for name in [s for s in SECTIONS if s in args.section_list]:
        t0 = time.perf_counter()
        try:
            res = runners[name]()
        except Exception as exc:  # one broken section must not hide the others' results
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        res["seconds"] = time.perf_counter() - t0
        report["sections"][name] = res
        print(f"[bench device] {name}: {'ok' if res.get('ok') else 'FAILED'} ({res['seconds']:.1f} s)",
              file=sys.stderr, flush=True)
        (out / "report.json").write_text(json.dumps(report, indent=1, default=str))

    report["device"] = Accelerator.for_type(device_type).device_name
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def _gb(x: Any) -> str:
    return "-" if x is None else f"{x / 2**30:.2f} GiB" if abs(x) >= 2**30 else f"{x / 2**20:.1f} MiB"


def _table(report: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [f"bench device on {report.get('device', report['device_type'])} (report: {report['out']}/report.json)"]
    for name, res in report["sections"].items():
        status = "ok" if res.get("ok") else f"FAILED: {res.get('error', 'a check did not hold')}"
        lines.append(f"\n[{name}] {status}  ({res['seconds']:.1f} s)")
        if "error" in res:
            continue
        if name == "pool":
            st = res["consumer_stats"]
            lines.append(f"  items {res['items_tokens']} tokens x {res['hidden']} bf16: values equal "
                         f"{res['values_equal']}, gradients equal {res['grads_equal']}; "
                         f"host-tier items {st.get('host_tier_items', '?')}")
        elif name == "attention":
            e = res["relative_max_error_vs_fp32_mask"]
            m = res["memory"]
            lines.append(f"  kernel {res['kernel']} ({res['dtype']}), vs fp32 masked SDPA on {res['parity_tokens']} "
                         f"tokens: " + ", ".join(f"{k} {v:.2e}" for k, v in e.items()))
            lines.append(f"  {m['tokens']} tokens peak: mask {_gb(m['peak_bytes']['mask'])}, varlen "
                         f"{_gb(m['peak_bytes']['varlen'])} (x{m['mask_over_varlen']:.1f})")
        elif name == "build":
            for b, row in res["builds"].items():
                mat = row["materialized"]
                lines.append(f"  {b:<8} device {_gb(row['device_bytes'])} (peak {_gb(row['device_peak_bytes'])}); "
                             f"encoder params {_gb(mat['encoder'])}, backbone params {_gb(mat['backbone'])}")
        elif name == "norm":
            lines.append(f"  {res['backend']} norm {res['norm']:.6g} on {res['norm_device']} vs clip_grad_norm_ "
                         f"{res['reference_norm']:.6g} (rel {res['relative_error']:.1e}); host sync checked: "
                         f"{res['host_sync_checked']}")
        elif name == "job":
            cal = res["calibration"]
            spf = cal["seconds_per_flop"]
            lines.append(f"  profile ({res['cluster_preset']} preset): encoder {1 / spf['encoder'] / 1e12:.1f} "
                         f"TFLOP/s, backbone {1 / spf['backbone'] / 1e12:.1f} TFLOP/s achieved; spread "
                         + ", ".join(f"{k} {100 * v:.1f}%" for k, v in cal["spread"].items()))
            lines.append("  step   measured s   simulated s   error")
            for r in res["steps"]:
                lines.append(f"  {r['step']:>4}   {r['measured_s']:10.4f}   {r['simulated_s']:11.4f}   "
                             f"{100 * r['error']:+6.1f}%")
            lo, hi = res["prediction_range_s"]
            lines.append(f"  mean: measured {res['mean_measured_s']:.4f} s, simulated {res['mean_simulated_s']:.4f} s "
                         f"(range {lo:.4f}-{hi:.4f}), mean |error| {100 * res['mean_abs_error']:.1f}%; "
                         f"measured MFU {res['measured_mfu']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(argv, parse_args, measure, _table)
