"""A MindSpeed-MM job trained as a flow job (image encoder and text decoder on separate ranks) vs the unpatched job.

Both load the same coupled checkpoint (`--load --finetune`), run 10 bf16 iterations with
`--calculate-per-token-loss` on the same global batches; the flow job's loss must equal the unpatched job's at
every iteration (first within 5e-3, all within 2e-2 relative) and fall, with packed (THD) decoder microbatches (the
default under --use-flash-attn) and with padded rows. The per-token loss is what packing
preserves: it is sum(token losses) / tokens over the global batch whichever microbatch a sample lands in. Without
it MindSpeed-MM averages each microbatch's mean, so regrouping samples changes the loss definition itself.

The cheapest layout also runs with `--tensorboard-dir` and the recipe's `trainer.trace: true` and checks what the
job writes for its users (`check_run_outputs`): metrics.jsonl, `flow/` TensorBoard scalars, trace.json, and
`mindspeed-flow report`'s two PNGs.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flow_helpers import check_part_groups, load_models, nranks, write_recipe

from mindspeed_flow.emulation.jobs import TinyJob, emulate_job

pytestmark = [pytest.mark.mindspeed_mm, pytest.mark.slow, pytest.mark.timeout(2400)]

ITERS = 10
FLOW_LINE = re.compile(r"\[flow\] iteration (\d+) \|(.*)")
COMMON = ["--calculate-per-token-loss", "--variable-seq-lengths", "--sequence-parallel"]

# The project's own tiny config in one layout per shape of part; MindSpeed-MM's example configs are trained in the
# other layouts (decoder PP with an uneven split, TP + SP, MC2, frozen encoders) by test_matrix.py.
LAYOUTS = {
    # name: (encoder dp, tp), (decoder dp, tp, pp), extra job flags of the flow run, decoder microbatch layout
    # Padded rows here (packing.layout: rows); packed (THD) rows, the default, in layout d and in every pair of
    # test_matrix.py (a packed decoder DP 2 there: the 7b pair).
    "a_enc1_dec_dp2_rows": ({"dp": 1, "tp": 1}, {"dp": 2, "tp": 1, "pp": 1}, [], "rows"),
    "d_enc_dp2_dec_tp2_sp_mc2": ({"dp": 2, "tp": 1}, {"dp": 1, "tp": 2, "pp": 1}, ["--use-ascend-mc2"], "auto"),
}
PADDING = re.compile(r"\| padding ([\d.]+)%")
MC2_OPS = {"torch_npu.npu_all_gather_base_mm", "torch_npu.npu_mm_reduce_scatter_base"}
# The layout whose run also writes TensorBoard scalars and a trace (checked by check_run_outputs).
OBSERVED = "a_enc1_dec_dp2_rows"
NUMBERS = ("loss", "samples", "real_tokens", "padded_tokens", "padding_fraction", "microbatches", "global_tokens",
           "step_seconds", "encoder_busy_s", "encoder_wait_s", "backbone_busy_s", "backbone_wait_s",
           "transfer_exposed_s", "transfer_hidden_s", "embedding_bytes", "gradient_bytes", "grad_norm",
           "grad_norm_backbone", "grad_norm_encoder", "mfu", "model_tflops", "lr")


def _job(model_json: Path, data_json: Path, iters: int, **kw) -> TinyJob:
    return TinyJob(model_json, data_json, train_iters=iters, global_batch_size=4, **kw)


@pytest.fixture(scope="module")
def coupled_checkpoint(tiny_assets, tmp_path_factory, mm_sources) -> Path:
    """Two iterations of the unpatched DP2 job, saved: the common starting point of every comparison."""
    folder = tmp_path_factory.mktemp("coupled")
    ckpt = folder / "ckpt"
    job = _job(tiny_assets["model_json"], tiny_assets["data_json"], 2, save=ckpt, extra=list(COMMON))
    emulate_job("coupled_save", job.argv(), log_dir=folder).assert_trained(2)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    return ckpt


def _finetune(model_json: Path, data_json: Path, ckpt: Path) -> TinyJob:
    return _job(model_json, data_json, ITERS, load=ckpt, extra=COMMON + ["--finetune"])


@pytest.fixture(scope="module")
def coupled_losses(tiny_assets, coupled_checkpoint, mm_sources) -> list[float]:
    job = _finetune(tiny_assets["model_json"], tiny_assets["data_json"], coupled_checkpoint)
    result = emulate_job("coupled_ref", job.argv(), log_dir=coupled_checkpoint.parent)
    result.assert_trained(ITERS)
    return result.losses


def assert_parity(flow: list[float], coupled: list[float]) -> None:
    rel = [abs(a - b) / abs(b) for a, b in zip(flow, coupled)]
    assert len(flow) == len(coupled) == ITERS
    assert rel[0] <= 5e-3, (rel, flow, coupled)
    assert max(rel) <= 2e-2, (rel, flow, coupled)
    assert sum(flow[-3:]) / 3 < sum(flow[:3]) / 3, flow


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_flow_job_matches_unpatched_job(layout, tiny_assets, coupled_checkpoint, coupled_losses, run_job,
                                        tmp_path) -> None:
    enc, dec, flags, decoder_layout = LAYOUTS[layout]
    observed = layout == OBSERVED
    run_dir = tmp_path / "run"
    recipe = write_recipe(tmp_path / f"{layout}.yaml", enc, dec, layout=decoder_layout,
                          **({"trainer": "{trace: true}"} if observed else {}))
    job = _finetune(tiny_assets["model_json"], tiny_assets["data_json"], coupled_checkpoint)
    if observed:
        flags = flags + ["--tensorboard-dir", str(run_dir / "tensorboard")]  # RUN_DIR: the folder holding it
    result = run_job(layout, job.argv() + flags, nproc=nranks(enc, dec), flow_recipe=recipe)
    result.assert_trained(ITERS)
    if observed:
        check_run_outputs(run_dir, result.losses, nranks(enc, dec))
    check_part_groups(result.output, enc, dec)
    if "--use-ascend-mc2" in flags:
        # MC2 runs in the decoder part (TP 2) only; the encoder part (TP 1) keeps Megatron's plain linears.
        assert MC2_OPS <= result.log["CALLED"]
        log = (tmp_path / f"{layout}.emulation.log").read_text()
        by_rank = {int(r) for r, op in re.findall(r"rank=(\d+) pid=\d+ CALLED (\S+)", log) if op in MC2_OPS}
        n_enc = enc["dp"] * enc["tp"]
        assert by_rank == set(range(n_enc, nranks(enc, dec))), by_rank
    assert "[mindspeed-flow] decoupled layout" in result.output
    assert "loading its tensors of the coupled checkpoint" in result.output
    flow_lines = FLOW_LINE.findall(result.output)
    assert [int(i) for i, _ in flow_lines] == list(range(1, ITERS + 1)), result.output[-3000:]
    assert all("encoder busy" in rest and "global tokens" in rest for _, rest in flow_lines)
    padding = [float(PADDING.search(rest).group(1)) for _, rest in flow_lines]
    if decoder_layout == "rows":  # rows pad every sample to its microbatch's longest
        assert max(padding) > 0.0, padding
    else:  # packed: at most TP - 1 tokens of padding per microbatch (sequence parallelism), reported as 0.0%
        assert max(padding) < 1.0, padding
    assert_parity(result.losses, coupled_losses)
    print(f"{layout}: flow {result.losses}\n{layout}: coupled {coupled_losses}\n{layout}: padding % {padding}")


def check_run_outputs(run_dir: Path, losses: list[float], world: int) -> None:
    """metrics.jsonl, the flow/ TensorBoard scalars, trace.json and `mindspeed-flow report` of a flow run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == list(range(1, ITERS + 1)), lines
    for ln in lines:
        bad = [k for k in NUMBERS if not (isinstance(ln[k], (int, float)) and math.isfinite(ln[k]))]
        assert not bad, (bad, ln)
        assert 0 <= ln["padding_fraction"] < 1 and ln["real_tokens"] <= ln["padded_tokens"], ln
        assert ln["padding_fraction"] == 1 - ln["real_tokens"] / ln["padded_tokens"], ln
        assert min(ln[k] for k in NUMBERS if k != "loss") >= 0 and ln["mfu"] > 0 and ln["samples"] == 4, ln
        # the global norm is the 2-norm over the two parts; each embedding's gradient has the embedding's bytes
        assert ln["grad_norm"] ** 2 == pytest.approx(ln["grad_norm_encoder"] ** 2 + ln["grad_norm_backbone"] ** 2)
        assert ln["gradient_bytes"] == ln["embedding_bytes"] > 0, ln
        # the decoder leader receives embeddings: its blocked seconds are part of the exposed transfer seconds
        assert ln["transfer_exposed_s"] >= ln["backbone_wait_s"] - 1e-6, ln
    for ln in lines[1:]:  # each part leader's busy + wait lies inside the iteration (see hosts/mindspeed_mm/metrics)
        for part in ("encoder", "backbone"):
            assert ln[f"{part}_busy_s"] + ln[f"{part}_wait_s"] <= ln["step_seconds"] + 1e-3, (part, ln)
    assert [ln["loss"] for ln in lines] == pytest.approx(losses, rel=1e-5)  # Megatron's log prints 6 digits

    acc = EventAccumulator(str(run_dir / "tensorboard" / "flow"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"flow/train/loss", "flow/train/grad_norm_encoder", "flow/throughput/mfu", "flow/parts/encoder_busy_s",
            "flow/pool/transfer_exposed_s", "flow/transfer/embedding_mb"} <= tags, tags
    points = acc.Scalars("flow/train/loss")
    assert [e.step for e in points] == [ln["step"] for ln in lines]
    assert [e.value for e in points] == pytest.approx([ln["loss"] for ln in lines], rel=1e-6)

    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    parts = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == set(range(world))
    names = {p: {e["name"] for e in spans if parts[e["pid"]] == p} for p in ("encoder", "backbone")}
    assert {"encoder.forward", "encoder.backward", "wait.gradient", "optimizer"} <= names["encoder"], names
    assert {"decoder.forward", "decoder.backward", "wait.embedding", "optimizer"} <= names["backbone"], names
    assert {e["args"]["step"] for e in spans} == set(range(1, ITERS + 1))

    out = run_dir / "png"
    done = subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "report", str(run_dir), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert all((out / name).stat().st_size > 10_000 for name in ("curves.png", "timeline.png"))


def _emulate_check(recipe: Path, argv: list[str], nproc: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "emulate", "--nproc", str(nproc),
                           "--flow-recipe", str(recipe), "--dry-run", "--"] + argv,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", ["world", "tp_heads", "unsupported_cp"])
def test_bad_recipe_is_one_clear_error_before_launch(case, tiny_assets, tmp_path, mm_sources) -> None:
    argv = _job(tiny_assets["model_json"], tiny_assets["data_json"], 2).argv()
    if case == "world":
        recipe = write_recipe(tmp_path / "r.yaml", {"dp": 1, "tp": 1}, {"dp": 2, "tp": 1, "pp": 1})
        proc, want = _emulate_check(recipe, argv, 4), "launched with 4"
    elif case == "tp_heads":
        recipe = write_recipe(tmp_path / "r.yaml", {"dp": 1, "tp": 1}, {"dp": 1, "tp": 3, "pp": 1})
        proc, want = _emulate_check(recipe, argv, 4), "parallel.backbone.tp=3"
    else:
        recipe = tmp_path / "r.yaml"
        recipe.write_text("parallel:\n  encoder: {dp: 1}\n  backbone: {dp: 1, cp: 2}\n")
        proc, want = _emulate_check(recipe, argv, 3), "parallel.backbone.cp=2"
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert want in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "convert-checkpoint", *args],
                          capture_output=True, text=True, timeout=600)


def test_coupled_checkpoint_round_trips_through_a_flow_run(tiny_assets, coupled_checkpoint, run_job, tmp_path) -> None:
    """Coupled checkpoint -> flow job (loads it, trains with lr 0, saves its parts) -> coupled: every tensor kept."""
    enc, dec = {"dp": 1, "tp": 1}, {"dp": 1, "tp": 2, "pp": 2}
    recipe = write_recipe(tmp_path / "rt.yaml", enc, dec)
    saved = tmp_path / "flow_ckpt"
    job = _job(tiny_assets["model_json"], tiny_assets["data_json"], 1, load=coupled_checkpoint, save=saved,
               lr=0.0, extra=COMMON + ["--finetune"])
    result = run_job("roundtrip_flow", job.argv(), nproc=nranks(enc, dec), flow_recipe=recipe)
    result.assert_trained(1)
    # Each rank read only its module's tensors of the coupled checkpoint (one DP-replicated file: its own part).
    reads = re.findall(r"rank (\d+) \(\w+ tp\d pp\d\): read (\d+) bytes of tensor data from 1 of 1 coupled rank "
                       r"files \([\d.]+% of their (\d+) bytes", result.output)
    assert sorted(int(r) for r, _, _ in reads) == list(range(nranks(enc, dec))), result.output[-3000:]
    assert all(int(read) < int(total) for _, read, total in reads), reads
    folders = sorted(p.name for p in (saved / "iter_0000001").iterdir())
    assert folders == ["mp_image_encoder_rank_00", "mp_text_decoder_rank_00_000", "mp_text_decoder_rank_00_001",
                       "mp_text_decoder_rank_01_000", "mp_text_decoder_rank_01_001"], folders
    back = tmp_path / "coupled_again"
    proc = _convert("--to", "coupled", "--load", str(saved), "--save", str(back), "--mm-model",
                    str(tiny_assets["model_json"]), "--flow-recipe", str(recipe), "--swiglu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    original = load_models(coupled_checkpoint)["mp_rank_00"]
    again = load_models(back)["mp_rank_00"]
    assert original.keys() == again.keys()
    import torch

    assert [k for k in original if not torch.equal(original[k], again[k])] == []
    # The converter never writes over an earlier checkpoint.
    proc = _convert("--to", "coupled", "--load", str(saved), "--save", str(back), "--mm-model",
                    str(tiny_assets["model_json"]), "--flow-recipe", str(recipe), "--swiglu")
    assert proc.returncode == 2 and "never writes over" in proc.stderr


def test_converted_checkpoint_equals_direct_coupled_load(tiny_assets, coupled_checkpoint, tmp_path) -> None:
    """Offline conversion to the flow layout gives each part exactly what the in-run loader gives it."""
    enc, dec = {"dp": 1, "tp": 1}, {"dp": 1, "tp": 2, "pp": 2}
    recipe = write_recipe(tmp_path / "conv.yaml", enc, dec)
    out = tmp_path / "flow_layout"
    proc = _convert("--to", "decoupled", "--load", str(coupled_checkpoint), "--save", str(out), "--mm-model",
                    str(tiny_assets["model_json"]), "--flow-recipe", str(recipe), "--swiglu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    models = load_models(out)
    assert sorted(models) == ["mp_image_encoder_rank_00", "mp_text_decoder_rank_00_000",
                              "mp_text_decoder_rank_00_001", "mp_text_decoder_rank_01_000",
                              "mp_text_decoder_rank_01_001"]
    first, last = models["mp_text_decoder_rank_00_000"], models["mp_text_decoder_rank_00_001"]
    assert "text_decoder.embedding.word_embeddings.weight" in first and "text_decoder.output_layer.weight" in last
    assert not any(k.startswith("image_encoder.") for k in first)


def test_drop_in_one_line_change_trains_decoupled(tiny_assets, tmp_path, mm_sources) -> None:
    """MindSpeed-MM's launch-script shape, scaled to the tiny model: its flow twin differs by one line and trains.

    (The unchanged script's flags are the ones every coupled job in this folder runs with.)"""
    import difflib

    from mindspeed_flow.emulation.cli import job_env

    examples = Path(__file__).resolve().parents[2] / "scripts" / "examples"
    coupled, flow = examples / "finetune_tiny_qwen2_5_vl.sh", examples / "finetune_tiny_qwen2_5_vl_flow.sh"
    changed = [line for line in difflib.unified_diff(coupled.read_text().splitlines(), flow.read_text().splitlines(),
                                                     lineterm="", n=0) if line[:1] in "+-" and line[:3] not in
               ("+++", "---")]
    assert len(changed) == 2 and "mindspeed_flow_patches.launch --flow-recipe" in changed[1], changed
    env = dict(job_env(mm_sources, None), TINY_WORKDIR=str(tiny_assets["workdir"]), TRAIN_ITERS="6",
               NPUS_PER_NODE="3", MASTER_PORT=str(_free_port()))
    proc = subprocess.run(["bash", str(flow)], cwd=str(mm_sources.mindspeed_mm.root), capture_output=True,
                          text=True, timeout=900, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "[mindspeed-flow] decoupled layout" in out and "[flow] iteration 6" in out
    losses = [float(x) for x in re.findall(r"\| loss: ([0-9.E+-]+)", out)]
    assert len(losses) == 6 and losses[-1] < losses[0], losses


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
