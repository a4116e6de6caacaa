"""`mindspeed-flow bench attention`: memory of packed attention, varlen kernel vs an explicit T x T mask.

    mindspeed-flow bench attention [--tokens 16384] [--segments 16] [--heads 4 --kv-heads 2 --head-dim 64]
        [--dtype fp32|bf16] [--json]

One packed microbatch of --tokens tokens holds --segments causal sequences (seeded random lengths). Each
variant runs one attention forward + backward (to q, k and v) over it:

- "mask": what packed attention did before the varlen kernel: a block-diagonal causal bool mask [1, 1, T, T]
  built from the segment ids, then `scaled_dot_product_attention(attn_mask=mask)`;
- "varlen": `mindspeed_flow.hosts.torch.attention.varlen_attention` with the kernel the accelerator picks.

Peak memory above the inputs: on a GPU/NPU the device allocator's peak; on the CPU the process's peak resident
set (VmHWM, reset through /proc/self/clear_refs) in a fresh spawned process per variant, so neither variant
sees the other's freed pages. The report prints both side by side and their ratio; the mask's own size is
T^2 bytes whatever the head count (268M elements at 16,384 tokens).
"""
from __future__ import annotations

import argparse
import random
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from mindspeed_flow.accelerator import Accelerator
from mindspeed_flow.hosts.torch.attention import Segments, varlen_attention
from mindspeed_flow.bench import bench_main
from mindspeed_flow.utils import rss

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = ("mask", "varlen")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mindspeed-flow bench attention", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens of the packed microbatch (T)")
    p.add_argument("--segments", type=int, default=16, help="sequences packed into it")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | npu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(list(argv))
    if not 1 <= args.segments <= args.tokens:
        p.error(f"--segments {args.segments} must be between 1 and --tokens {args.tokens}")
    if args.heads < 1 or args.kv_heads < 1 or args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a positive multiple of --kv-heads {args.kv_heads}")
    return args


def segment_lengths(tokens: int, segments: int, seed: int) -> list[int]:
    """`segments` positive lengths summing to `tokens` (random cut points, seeded)."""
    cuts = sorted(random.Random(seed).sample(range(1, tokens), segments - 1)) if segments > 1 else []
    bounds = [0, *cuts, tokens]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def block_causal_mask(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """The pre-varlen mask: bool [1, 1, T, T], query q sees key k iff start(q) <= k <= q."""
    lens = torch.tensor(list(lengths), device=device)
    starts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    t = torch.arange(int(lens.sum()), device=device)
    return ((t[None, :] <= t[:, None]) & (t[None, :] >= starts[:, None]))[None, None]


def _inputs(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(args.seed)
    shape_q = (1, args.heads, args.tokens, args.head_dim)
    shape_kv = (1, args.kv_heads, args.tokens, args.head_dim)
    dtype = DTYPES[args.dtype]
    q, k, v = (torch.randn(s, generator=g).to(device, dtype).requires_grad_() for s in (shape_q, shape_kv, shape_kv))
    grad = torch.randn(1, args.tokens, args.heads, args.head_dim, generator=g).to(device, dtype)
    return q, k, v, grad


def _run_variant(variant: str, args: argparse.Namespace, acc: Accelerator, lengths: list[int]) -> float:
    device = acc.device()
    q, k, v, grad = _inputs(args, device)
    acc.synchronize()
    baseline = _peak_start(acc)
    if variant == "mask":
        mask = block_causal_mask(lengths, device)
        rep = args.heads // args.kv_heads
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                             attn_mask=mask).transpose(1, 2)
    else:
        out = varlen_attention(q, k, v, Segments.from_lengths(lengths))
    out.backward(grad)
    acc.synchronize()
    return _peak_end(acc, baseline)


def _peak_start(acc: Accelerator) -> float:
    if acc.module is not None:
        acc.reset_peak_memory()
        return float(acc.module.memory_allocated())
    return rss.reset_peak()


def _peak_end(acc: Accelerator, baseline: float) -> float:
    if acc.module is not None:
        return float(acc.module.max_memory_allocated()) - baseline
    return rss.peak_bytes() - baseline


def _child(variant: str, args: argparse.Namespace, lengths: list[int]) -> float:
    # Warm-up on a small problem first: one-time kernel and thread-pool set-up is not the variant's memory.
    small = argparse.Namespace(**{**vars(args), "tokens": 64})
    _run_variant(variant, small, Accelerator.for_type("cpu"), segment_lengths(64, min(args.segments, 8), 0))
    return _run_variant(variant, args, Accelerator.for_type("cpu"), lengths)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    acc = Accelerator.detect(args.device)
    lengths = segment_lengths(args.tokens, args.segments, args.seed)
    peaks: dict[str, float] = {}
    for variant in VARIANTS:
        if acc.module is not None:
            peaks[variant] = _run_variant(variant, args, acc, lengths)
            continue
        peaks[variant] = rss.in_fresh_process(_child, variant, args, lengths, what=f"bench attention {variant}")
    return {"device": acc.device_type, "kernel": acc.varlen_attention_kernel, "tokens": args.tokens,
            "segments": len(lengths), "longest_segment": max(lengths), "heads": args.heads,
            "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": args.dtype,
            "mask_bytes": args.tokens ** 2, "peak_bytes": peaks,
            "mask_over_varlen": peaks["mask"] / max(peaks["varlen"], 1.0)}


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(argv, parse_args, measure, _table)


def _table(report: dict[str, Any], args: argparse.Namespace) -> str:
    mib = 2.0 ** 20
    out: list[str] = []
    out.append(f"packed attention, {report['tokens']} tokens in {report['segments']} sequences (longest "
               f"{report['longest_segment']}), {args.heads}/{args.kv_heads} heads x {args.head_dim}, {args.dtype}, "
               f"{report['device']}; varlen kernel: {report['kernel']}")
    out.append(f"  explicit mask alone: {report['mask_bytes'] / mib:,.0f} MiB")
    for variant in VARIANTS:
        out.append(f"  {variant:>7}: peak {report['peak_bytes'][variant] / mib:,.1f} MiB above the inputs (fwd+bwd)")
    out.append(f"  mask / varlen: {report['mask_over_varlen']:.1f}x")
    return "\n".join(out)
