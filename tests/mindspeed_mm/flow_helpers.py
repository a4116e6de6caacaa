"""Helpers shared by the MindSpeed-MM flow-job tests: recipes, rank counts, the per-part group check."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

# Ranks print concurrently, so two reports may share a line: match each report, not each line.
GROUPS_LINE = re.compile(r"\[mindspeed-flow\] rank (\d+) \((\w+)\) groups: ((?:\w+=\[[\d, ]*\] ?)+)")


def write_recipe(path: Path, enc: dict, dec: dict, layout: str = "auto", **extra: str) -> Path:
    split = f", layer_split: {list(dec['layer_split'])}" if dec.get("layer_split") else ""
    lines = ["# mindspeed-flow emulate --nproc N --flow-recipe THIS.yaml -- pretrain_vlm.py <job args>",
             "parallel:", f"  encoder: {{dp: {enc['dp']}, tp: {enc['tp']}, pp: 1, cp: 1}}",
             f"  backbone: {{dp: {dec['dp']}, tp: {dec['tp']}, pp: {dec['pp']}, cp: 1{split}}}",
             "packing:", "  token_budget: 256", f"  layout: {layout}"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def nranks(enc: dict, dec: dict) -> int:
    return enc["dp"] * enc["tp"] + dec["dp"] * dec["tp"] * dec["pp"]


def check_part_groups(output: str, enc: dict, dec: dict) -> None:
    """Every rank's Megatron groups lie inside its own part and have the part's sizes."""
    n_enc = enc["dp"] * enc["tp"]
    rows = GROUPS_LINE.findall(output)
    assert len(rows) == nranks(enc, dec), output[-3000:]
    for rank, part, text in rows:
        groups = {k: json.loads(v) for k, v in re.findall(r"(\w+)=(\[[^\]]*\])", text)}
        own = range(0, n_enc) if part == "encoder" else range(n_enc, nranks(enc, dec))
        assert all(r in own for g in groups.values() for r in g), (rank, part, groups)
        lay = enc if part == "encoder" else dec
        assert len(groups["tp"]) == lay["tp"] and len(groups["dp"]) == lay["dp"], (rank, groups)
        assert len(groups["pp"]) == lay.get("pp", 1), (rank, groups)


# The first lines of a reader process: one that can unpickle what Megatron saves beside the tensors (its args).
_READER_PRELUDE = ("import sys, torch\nfrom mindspeed_flow import emulation\nemulation.activate()\n"
                   "from mindspeed_flow.emulation.sources import find_sources\n"
                   "sys.path[:0] = find_sources().pythonpath()\n")


def _read_in_job_process(body: str, folder: Path, suffix: str) -> Any:
    """Run `body` (argv[1]: `folder`, argv[2]: where to torch.save what it read) in a reader process; load that."""
    dump = folder.parent / f"{folder.name}.{suffix}.pt"
    proc = subprocess.run([sys.executable, "-c", _READER_PRELUDE + body, str(folder), str(dump)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import torch

    return torch.load(dump, weights_only=True)


def load_models(folder: Path) -> dict[str, dict]:
    """{rank folder: model state} of a checkpoint's latest iteration."""
    return _read_in_job_process(
        "from pathlib import Path\nroot = Path(sys.argv[1]); it = (root / 'latest_checkpointed_iteration.txt')"
        ".read_text().strip()\nout = {}\nfor d in sorted((root / f'iter_{int(it):07d}').iterdir()):\n"
        "    sd = torch.load(d / 'model_optim_rng.pt', map_location='cpu', weights_only=False)['model']\n"
        "    out[d.name] = {k: v for k, v in sd.items() if torch.is_tensor(v)}\n"
        "torch.save(out, sys.argv[2])\n", folder, "models")


def rel(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]


def assert_flow_matches(flow: Any, base: Any, what: str, iters: int, first: int = 1, norm_tol: float = 1e-2) -> None:
    """Per-token losses within 5e-3 at the first iteration and 2e-2 at every one, gradient norms within `norm_tol`
    (one norm over both parts); every torch_npu name asked for exists."""
    from mindspeed_flow.emulation.jobs import parse_grad_norms

    flow.assert_trained(iters, first)
    base.assert_trained(iters, first)
    loss_rel = rel(flow.losses, base.losses)
    norms = [parse_grad_norms(r.output) for r in (flow, base)]
    norm_rel = rel(norms[0], norms[1])
    print(f"{what}: flow {flow.losses}\n{what}: unpatched {base.losses}\n{what}: largest relative difference: "
          f"loss {max(loss_rel):.1e}, grad norm {max(norm_rel):.1e}")
    assert loss_rel[0] <= 5e-3 and max(loss_rel) <= 2e-2, (loss_rel, flow.losses, base.losses)
    assert len(norms[0]) == len(norms[1]) == iters and max(norm_rel) <= norm_tol, norms
    assert not flow.log.get("MISSING"), flow.log.get("MISSING")


def load_dcp_tensors(folder: Path) -> dict[str, Any]:
    """{flattened key: tensor} of a DCP checkpoint folder."""
    return _read_in_job_process(
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        "dcp_to_torch_save(sys.argv[1], sys.argv[2])\nflat = {}\n"
        "def walk(prefix, node):\n    for k, v in node.items():\n"
        "        if isinstance(v, dict):\n            walk(prefix + k + '.', v)\n"
        "        elif torch.is_tensor(v):\n            flat[prefix + k] = v\n"
        "walk('', torch.load(sys.argv[2], weights_only=False))\ntorch.save(flat, sys.argv[2])\n", folder, "tensors")


# A pretrain_transformers.py flow job's FLOW.yaml: each part data parallel (FSDP2 over its ranks).
TRANSFORMERS_FLOW_RECIPE = """\
# mindspeed-flow emulate --nproc {world} --flow-recipe THIS -- pretrain_transformers.py <the job's arguments>
parallel:
  encoder: {{dp: {enc}, tp: 1, pp: 1, cp: 1}}
  backbone: {{dp: {bb}, tp: 1, pp: 1, cp: 1}}
flow:
  timeout_s: 300
"""
