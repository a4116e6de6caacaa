"""`mindspeed-flow report RUN_DIR [--step N] [--out DIR]`: a run's curves and one step's timeline as PNG.

    curves.png    loss, grad norm, samples/s, MFU, padding, step time, encoder and backbone busy/wait, embedding
                  transfer seconds exposed / hidden per step (from RUN_DIR/metrics.jsonl)
    timeline.png  one step of every rank: compute, waits and the pool calls of the encoder and backbone tracks
                  (from RUN_DIR/trace.json, written by a run with trainer.trace=true; default: the last step)

RUN_DIR is a `mindspeed-flow train` run directory or a MindSpeed-MM flow job's (docs/mindspeed_mm.md: "What a flow job writes").

Written to RUN_DIR/report/ unless --out says otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

from mindspeed_flow.telemetry.tensorboard import SCALARS

# (title, y label, [(metrics.jsonl field or SCALARS tag, legend label)])
PANELS: tuple[tuple[str, str, list[tuple[str, str]]], ...] = (
    ("Loss", "loss (per label token)", [("train/loss", "loss")]),
    ("Gradient norm", "global L2 norm", [("train/grad_norm", "grad norm")]),
    ("Throughput", "samples / s", [("throughput/samples_per_s", "samples/s")]),
    ("MFU", "MFU (%)", [("mfu_pct", "MFU")]),
    ("Padding", "padded share of tokens (%)", [("padding_pct", "padding")]),
    ("Step time", "seconds", [("throughput/step_seconds", "step")]),
    ("Encoder ranks", "seconds per step", [("parts/encoder_busy_s", "busy"), ("parts/encoder_wait_s", "wait")]),
    ("Backbone ranks", "seconds per step", [("parts/backbone_busy_s", "busy"), ("parts/backbone_wait_s", "wait")]),
    # both hosts measure these (the pool's peak occupancy, torch host only, is in TensorBoard)
    ("Embedding transfers", "seconds per step", [("pool/transfer_exposed_s", "exposed (decoder waited)"),
                                                 ("pool/transfer_hidden_s", "hidden behind compute")]),
)
# timeline rows draw these events, by name, else by category (the MindSpeed-MM host names its spans by what they
# are, e.g. `decoder.backward` in category `busy`); others, e.g. the enclosing `step`, only set the step's extent
TIMELINE_STYLE: dict[str, dict[str, Any]] = {
    "busy": {"color": "tab:blue", "label": "compute"},
    "wait": {"color": "lightgray", "label": "wait"},
    "optimizer": {"color": "tab:orange", "label": "optimizer"},
    "pool.put": {"color": "tab:green", "label": "pool put"},
    "pool.get": {"color": "tab:purple", "label": "pool get"},
    "pool.wait_grad": {"color": "tab:red", "label": "pool wait grad"},
    "pool.return_grad": {"color": "tab:olive", "label": "pool return grad"},
}


def _value(line: dict[str, Any], key: str) -> Optional[float]:
    if key == "mfu_pct":
        return None if line.get("mfu") is None else 100.0 * line["mfu"]
    if key == "padding_pct":
        return None if line.get("padding_fraction") is None else 100.0 * line["padding_fraction"]
    value = SCALARS[key](line) if key in SCALARS else line.get(key)
    return None if value is None else float(value)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (RUN_DIR must be a `mindspeed-flow train` run_dir or a "
                                "MindSpeed-MM flow job's run directory)")
    lines = []
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            print(f"mindspeed-flow report: {path}:{number}: skipped, not JSON ({err.msg})", file=sys.stderr)
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            print(f"mindspeed-flow report: {path}:{number}: skipped, not a step record (no integer 'step')",
                  file=sys.stderr)
            continue
        lines.append(record)
    if not lines:
        raise ValueError(f"{path} holds no step yet")
    return lines


def plot_curves(lines: list[dict[str, Any]], out: Path, title: str) -> Path:
    import matplotlib  # optional: plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: plots
    from matplotlib.ticker import MaxNLocator  # optional: plots

    fig, axes = plt.subplots(3, 3, figsize=(15, 11), constrained_layout=True)
    for ax, (name, ylabel, series) in zip(axes.flat, PANELS):
        for key, label in series:
            pts = [(ln["step"], _value(ln, key)) for ln in lines]
            pts = [(s, v) for s, v in pts if v is not None]
            if pts:
                ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o", markersize=3, label=label)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend()
    fig.suptitle(title)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def step_events(trace: dict[str, Any], step: Optional[int]) -> tuple[int, list[dict[str, Any]], dict[int, str]]:
    """(the step, its X events, pid -> part name); default step: the last one traced."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("args", {}).get("step") is not None]
    steps = sorted({e["args"]["step"] for e in events})
    if not steps:
        raise ValueError("the trace holds no step events")
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise ValueError(f"--step {step}: the trace has steps {steps[0]}..{steps[-1]}")
    return chosen, [e for e in events if e["args"]["step"] == chosen], names


def _style_key(event: dict[str, Any]) -> str:
    return event["name"] if event["name"] in TIMELINE_STYLE else event.get("cat", "")


def plot_timeline(trace_path: Path, out: Path, step: Optional[int]) -> Path:
    import matplotlib  # optional: plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: plots
    from matplotlib.patches import Patch  # optional: plots

    chosen, events, names = step_events(json.loads(trace_path.read_text()), step)
    t0 = min(e["ts"] for e in events)
    rows = sorted({(e["pid"], e["tid"]) for e in events})
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.7 * len(rows)), constrained_layout=True)
    for y, (pid, tid) in enumerate(rows):
        mine = [e for e in events if (e["pid"], e["tid"]) == (pid, tid)]
        for name, style in TIMELINE_STYLE.items():
            spans = [((e["ts"] - t0) / 1e3, e["dur"] / 1e3) for e in mine if _style_key(e) == name]
            # waits and compute fill the row; the pool calls (inside waits) and the optimizer sit on top, thinner
            height = 0.7 if name in ("busy", "wait") else 0.35
            if spans:
                ax.broken_barh(spans, (y - height / 2, height), facecolors=style["color"], edgecolor="none")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{names.get(pid, pid)} · rank {tid}" for pid, tid in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"milliseconds since step {chosen} started")
    ax.set_title(f"Step {chosen}: every rank of every part (from {trace_path.name})")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=[Patch(color=s["color"], label=s["label"]) for s in TIMELINE_STYLE.values()],
              loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(rows) < 4 else -0.1), ncol=len(TIMELINE_STYLE))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mindspeed-flow report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, default=None, help="the step of the timeline (default: the last traced)")
    p.add_argument("--out", default=None, help="folder for the PNGs (default: RUN_DIR/report)")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir / "report"
    try:
        lines = read_metrics(run_dir)
        out.mkdir(parents=True, exist_ok=True)
        print(f"curves: {plot_curves(lines, out / 'curves.png', f'{run_dir.name}: {len(lines)} steps')}")
        trace_path = run_dir / "trace.json"
        if trace_path.is_file():
            print(f"timeline: {plot_timeline(trace_path, out / 'timeline.png', args.step)}")
        else:
            print(f"timeline: none ({trace_path} absent: train with trainer.trace=true)")
    except (FileNotFoundError, ValueError) as err:
        print(f"mindspeed-flow report: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
