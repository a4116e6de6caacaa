"""Held-out sweep: MindSpeed-MM's own example configs, scaled down, trained as flow jobs in layouts and with flags
the test suite does not pair, each against the unpatched job and restarted from its own checkpoint.

Run (a MindSpeed-MM environment: `mindspeed-flow emulate --setup DIR`, then `source DIR/env.sh`):

    python tests/mindspeed_mm/held_out_sweep.py WORKDIR [CASE ...]

Per case it prints one JSON line: return codes (unpatched, flow, flow to iteration 6, flow restarted), iterations,
the flow job's loss relative to the unpatched job's (first iteration and max over 12), and whether the restarted
run's losses equal the uninterrupted run's. Each case takes 2-3 minutes on 2 cores.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flow_helpers import nranks  # noqa: E402

from mindspeed_flow.emulation.jobs import TinyJob, emulate_job  # noqa: E402
from mindspeed_flow.emulation.scaled import scaled_model_json, write_user_like_data_json  # noqa: E402
from mindspeed_flow.emulation.sources import find_sources  # noqa: E402
from mindspeed_flow.emulation.tiny import prepare_workdir  # noqa: E402

ITERS, STOP = 12, 6
TRAINABLE_VIT = {"image_encoder.vision_encoder.freeze": False}
CASES = {
    # name: (config, model.json overrides, encoder, decoder, flags, samples, image max pixels, global batch)
    "72b_trainable_vit_distopt_tp2_sp": ("72b", TRAINABLE_VIT, {"dp": 2, "tp": 1}, {"dp": 1, "tp": 2, "pp": 1},
                                         ["--calculate-per-token-loss", "--use-distributed-optimizer"], 30, 140, 4),
    "3b_tied_encoder_tp2_decoder_pp2": ("3b", {}, {"dp": 1, "tp": 2}, {"dp": 1, "tp": 1, "pp": 2},
                                        ["--calculate-per-token-loss", "--use-distributed-optimizer"], 30, 140, 4),
    "72b_mbs2_overlap_decoder_dp2": ("72b", TRAINABLE_VIT, {"dp": 1, "tp": 1}, {"dp": 2, "tp": 1, "pp": 1},
                                     ["--overlap-grad-reduce", "--micro-batch-size", "2"], 30, 140, 4),
    "32b_per_sample_pp2_45_samples": ("32b", {}, {"dp": 2, "tp": 1}, {"dp": 1, "tp": 1, "pp": 2},
                                      ["--calculate-per-sample-loss", "--use-distributed-optimizer"], 45, 224, 6),
    "7b_frozen_default_loss_enc_dp2_dec_dp2": ("7b", {}, {"dp": 2, "tp": 1}, {"dp": 2, "tp": 1, "pp": 1},
                                               ["--use-distributed-optimizer"], 30, 168, 4),
}


def recipe(path: Path, enc: dict, dec: dict, budget: int) -> Path:
    path.write_text("# mindspeed-flow emulate --nproc N --flow-recipe THIS.yaml -- pretrain_vlm.py <job args>\n"
                    f"parallel:\n  encoder: {{dp: {enc['dp']}, tp: {enc['tp']}, pp: 1, cp: 1}}\n"
                    f"  backbone: {{dp: {dec['dp']}, tp: {dec['tp']}, pp: {dec['pp']}, cp: 1}}\n"
                    f"packing:\n  token_budget: {budget}\n  layout: auto\n")
    return path


def run_case(name: str, workdir: Path) -> dict:
    size, overrides, enc, dec, flags, samples, side, gbs = CASES[name]
    out = workdir / name
    out.mkdir(parents=True, exist_ok=True)
    data_dir = workdir / f"data_{samples}_{side}"
    prepare_workdir(data_dir, n_samples=8)  # the tiny processor the user-like set is tokenized with
    data = write_user_like_data_json(data_dir, samples, max_pixels=side * side)
    model = scaled_model_json(find_sources().mindspeed_mm.root, size, out, **overrides)
    tp = dec["tp"]
    sp = ["--sequence-parallel"] if tp > 1 else []
    seq = 512 if side > 140 else 256

    def job(fl: list[str], **kw) -> list[str]:
        return TinyJob(model, data, train_iters=kw.pop("iters", ITERS), global_batch_size=gbs, seq_length=seq,
                       extra=["--variable-seq-lengths"] + fl, **kw).argv()

    start = time.time()
    coupled = out / "coupled"
    ref_ranks = 2 if gbs % 2 == 0 else 1
    if not (coupled / "latest_checkpointed_iteration.txt").exists():
        emulate_job("save", job(flags + sp, iters=1, save=coupled, tp=tp), log_dir=out,
                    nproc=ref_ranks).assert_trained(1)
    ref = emulate_job("unpatched", job(flags + sp + ["--finetune"], load=coupled, tp=tp), log_dir=out, nproc=ref_ranks)
    flow_recipe = recipe(out / "flow.yaml", enc, dec, seq)
    n = nranks(enc, dec)
    whole = emulate_job("flow", job(flags + sp + ["--finetune"], load=coupled), log_dir=out, nproc=n,
                        flow_recipe=flow_recipe)
    saved = out / "flow_ckpt"
    first = emulate_job("flow_first", job(flags + sp + ["--finetune", "--exit-interval", str(STOP)], load=coupled,
                                          save=saved, save_interval=STOP), log_dir=out, nproc=n, flow_recipe=flow_recipe)
    again = emulate_job("flow_again", job(flags + sp, load=saved, save=saved, save_interval=STOP), log_dir=out,
                        nproc=n, flow_recipe=flow_recipe)
    rel = [abs(a - b) / abs(b) for a, b in zip(whole.losses, ref.losses)]
    for result, label in ((ref, "unpatched"), (whole, "flow"), (first, "flow_first"), (again, "flow_again")):
        if result.rc != 0:
            (out / f"{label}.output.txt").write_text(result.output)
    return {"case": name, "rc": [ref.rc, whole.rc, first.rc, again.rc],
            "iterations": [len(ref.losses), len(whole.losses), len(first.losses), len(again.losses)],
            "rel_first": rel[0] if rel else None, "rel_max": max(rel) if rel else None,
            "restart_exact": bool(whole.losses) and first.losses + again.losses == whole.losses,
            "seconds": round(time.time() - start)}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    workdir = Path(argv[0]).resolve()
    for name in argv[1:] or sorted(CASES):
        print(json.dumps(run_case(name, workdir)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
