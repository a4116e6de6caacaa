"""End to end through `mindspeed-flow train`: decoupled vs coupled parity, streaming, loss falls, resume, and
clear errors for bad recipes and a world that does not match the layout.

Each run goes through the real launcher (torchrun's elastic agent, fork, gloo) and writes metrics.jsonl.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from mindspeed_flow.resilience.checkpoint import load_flat
from mindspeed_flow.runtime import launch


def train(run_dir: Path, *overrides: str) -> list[dict]:
    rc = launch.main([f"run_dir={run_dir}", "trainer.progress=false", *overrides])
    assert rc == 0, f"train {overrides} exited {rc}"
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


# "parity_dp2_fsdp": parity_dp2 with the backbone sharded by FSDP2, whose gradient reduction the runtime measures
# per group (gloo in torch 2.7.1 sums where it should average): the loss scale must follow it.
# "qwen3_vl_*": Qwen3-VL, whose image rows carry the deepstack maps to the backbone (dense LLM with 2 backbone DP
# ranks; MoE LLM with 2 encoder DP ranks).
EXTRA = {"parity_dp2_fsdp": ("parity_dp2", ["parallel.backbone_dp_impl=fsdp"]),
         "qwen3_vl_dp2": ("parity_dp2", ["model=tiny_qwen3_vl"]),
         "qwen3_vl_moe_enc2": ("parity_enc2", ["model=tiny_qwen3_vl_moe"])}


@pytest.mark.parametrize("experiment", ["parity_dp2", "parity_pp2", "parity_enc2", "frozen_encoder",
                                        "parity_dp2_fsdp", "qwen3_vl_dp2", "qwen3_vl_moe_enc2"])
def test_decoupled_matches_coupled(tmp_path: Path, experiment: str) -> None:
    """Same seed and recipe: the same loss every step (rel <= 1e-5) and the same final parameters."""
    recipe, extra = EXTRA.get(experiment, (experiment, []))
    # qwen3_vl_dp2: after 8 Adam steps one element of 4,096 in one projection differs by 1.2e-6 (summation order of
    # the two modes' microbatches; every step's loss agrees to 1e-5): parameters are compared to atol 2e-6 there.
    _assert_parity(tmp_path, recipe, extra, param_atol=2e-6 if experiment == "qwen3_vl_dp2" else 1e-6)


def test_pool_smaller_than_a_microbatch_does_not_deadlock(tmp_path: Path) -> None:
    """A pool of a few embeddings (less than one microbatch) only slows the encoder down: consumers take items in
    their producer's put order, so every credit the encoder waits for is one a consumer is about to return."""
    lines = train(tmp_path / "tiny_pool", "experiment=default", "trainer.steps=2", "flow.pool_capacity_mb=0.05",
                  "flow.timeout_s=60")
    assert [x["step"] for x in lines] == [0, 1]


def test_pipeline_per_step_shapes_match_coupled(tmp_path: Path) -> None:
    """A pipeline padding each step to its longest pack (pad_multiple) trains exactly like the coupled baseline,
    and the steps really ran at several sequence lengths (one schedule per shape)."""
    dec = _assert_parity(tmp_path, "parity_pp2", ["packing.pad_multiple=16"])
    seq_lens = {x["padded_tokens"] // x["microbatches"] for x in dec}  # padded_tokens: padding included
    assert len(seq_lens) > 1 and all(n % 16 == 0 for n in seq_lens), seq_lens


def test_encoder_batching_matches_coupled(tmp_path: Path) -> None:
    """Encoder ranks encoding several samples per forward (up to 4096 ViT patches) train like the coupled
    baseline, which encodes one sample per forward."""
    dec = _assert_parity(tmp_path, "parity_enc2", ["flow.encoder_batch_tokens=4096"])
    assert all(0 < x["encoder_forwards"] < x["encoder_samples"] for x in dec), dec


def test_coupled_pipeline_matches_decoupled(tmp_path: Path) -> None:
    """Coupled PP2 on 2 ranks (MindSpeed-MM's layout: the ViT on stage 0, uneven LLM layers [1, 3] to balance it)
    trains like decoupled 1 encoder + 1 backbone rank: same losses, same final parameters under the same names."""
    _assert_parity(tmp_path, "parity_dp2", ["parallel.backbone.dp=1"],
                   coupled_extra=["parallel.coupled.pp=2", "parallel.coupled.layer_split=[1,3]"])


def test_uneven_backbone_pipeline_matches_coupled(tmp_path: Path) -> None:
    """A decoupled backbone pipeline with layers [3, 1] per stage (parallel.backbone.layer_split) trains like the
    coupled baseline."""
    _assert_parity(tmp_path, "parity_pp2", ["parallel.backbone.layer_split=[3,1]"])


def _assert_parity(tmp_path: Path, recipe: str, extra: list[str], coupled_extra: tuple[str, ...] = (),
                   param_atol: float = 1e-6) -> list[dict]:
    runs = {}
    for mode in ("decoupled", "coupled"):
        runs[mode] = train(tmp_path / mode, f"experiment={recipe}", "trainer.steps=8", f"flow.mode={mode}",
                           "trainer.save_final=true", *extra, *(coupled_extra if mode == "coupled" else ()))
    dec, cou = runs["decoupled"], runs["coupled"]
    assert [x["step"] for x in dec] == list(range(8)) == [x["step"] for x in cou]
    for a, b in zip(dec, cou):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
    pa = load_flat(tmp_path / "decoupled" / "checkpoints" / "step-7")
    pb = load_flat(tmp_path / "coupled" / "checkpoints" / "step-7")
    assert sorted(pa) == sorted(pb) and any(k.startswith("encoder.") for k in pa) and any(
        k.startswith("backbone.") for k in pa)
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=1e-4, atol=param_atol, msg=lambda m: f"{k}: {m}")
    # The runs trained: parameters moved away from their initial values in both modes.
    assert dec[-1]["loss"] < dec[0]["loss"]
    return dec


def test_encoder_recompute_matches_kept_activations(tmp_path: Path) -> None:
    """flow.keep_encoder_activations=false recomputes each sample's ViT forward at backward time: same training."""
    kept = train(tmp_path / "keep", "experiment=parity_enc2", "trainer.steps=3")
    recomputed = train(tmp_path / "recompute", "experiment=parity_enc2", "trainer.steps=3",
                       "flow.keep_encoder_activations=false")
    for a, b in zip(kept, recomputed):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert sum(x["encoder_busy_s"] for x in recomputed) > 0


def test_streaming_backbone_starts_before_encoder_finishes(tmp_path: Path) -> None:
    lines = train(tmp_path, "experiment=default", "trainer.steps=4")
    overlapped = [x for x in lines[1:] if x["backbone_first_mb_start_s"] < x["encoder_last_sample_done_s"]]
    assert overlapped, [(x["backbone_first_mb_start_s"], x["encoder_last_sample_done_s"]) for x in lines]
    needed = {"step", "loss", "samples", "real_tokens", "padded_tokens", "step_seconds", "encoder_busy_s",
              "encoder_wait_s", "backbone_busy_s", "backbone_wait_s", "pool_occupancy_peak_bytes", "grad_norm",
              "mfu"}
    assert needed <= set(lines[0]), needed - set(lines[0])
    assert all(x["pool_occupancy_peak_bytes"] > 0 and x["mfu"] > 0 for x in lines)


def test_default_demo_loss_falls_over_50_steps(tmp_path: Path) -> None:
    lines = train(tmp_path, "experiment=default", "trainer.steps=50")
    losses = [x["loss"] for x in lines]
    assert len(losses) == 50
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.75 * first, (first, last)


def test_resume_continues_exactly(tmp_path: Path) -> None:
    """Checkpoint at step 3, resume, and the next steps equal an uninterrupted run's."""
    full = train(tmp_path / "full", "experiment=parity_dp2", "trainer.steps=6")
    train(tmp_path / "part", "experiment=parity_dp2", "trainer.steps=4", "trainer.checkpoint_every=2")
    resumed = train(tmp_path / "part", "experiment=parity_dp2", "trainer.steps=6", "trainer.resume=true",
                    "trainer.checkpoint_every=2")
    assert [x["step"] for x in resumed] == list(range(6))
    for a, b in zip(full[4:], resumed[4:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


PACKS = ("experiment=parity_dp2", "data=infovqa_tiny_large", "packing.token_budget=1024", "packing.step_mode=packs",
         "packing.lookahead=16", "packing.packs_per_rank=2")


def test_packs_steps_resume_continues_exactly(tmp_path: Path) -> None:
    """Token-defined steps: every step runs dp x packs_per_rank packs (samples wait in the look-ahead buffer), the
    metrics' padding is what those packs pad to the budget, and a resumed run (buffer restored from the checkpoint)
    continues exactly like an uninterrupted one."""
    full = train(tmp_path / "full", *PACKS, "trainer.steps=6")
    train(tmp_path / "part", *PACKS, "trainer.steps=4", "trainer.checkpoint_every=2")
    resumed = train(tmp_path / "part", *PACKS, "trainer.steps=6", "trainer.resume=true", "trainer.checkpoint_every=2")
    assert [x["step"] for x in resumed] == list(range(6))
    for x in full:
        assert x["microbatches"] == 4 and x["padded_tokens"] == 4 * 1024
        assert x["padding_fraction"] == pytest.approx(1 - x["real_tokens"] / x["padded_tokens"])
    assert len({x["samples"] for x in full}) > 1  # steps are defined by packs, not by a sample count
    for a, b in zip(full[4:], resumed[4:]):
        assert (a["samples"], a["real_tokens"]) == (b["samples"], b["real_tokens"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


WINDOW = ("experiment=parity_dp2", "data=infovqa_tiny_large", "packing.token_budget=1024", "packing=flow_window",
          "packing.pad_multiple=64", "packing.lookahead=12")


def test_window_steps_resume_continues_exactly(tmp_path: Path) -> None:
    """Window steps: every step trains exactly trainer.global_batch_size samples (chosen from a pool of packs), the
    metrics' padding is what the plan pads to, and a resumed run (pool restored from the checkpoint) continues
    exactly like an uninterrupted one."""
    full = train(tmp_path / "full", *WINDOW, "trainer.steps=6")
    train(tmp_path / "part", *WINDOW, "trainer.steps=4", "trainer.checkpoint_every=2")
    resumed = train(tmp_path / "part", *WINDOW, "trainer.steps=6", "trainer.resume=true", "trainer.checkpoint_every=2")
    assert [x["step"] for x in resumed] == list(range(6))
    for x in full:
        assert x["samples"] == 12 and x["microbatches"] % 2 == 0
        assert x["padding_fraction"] == pytest.approx(1 - x["real_tokens"] / x["padded_tokens"])
    for a, b in zip(full[4:], resumed[4:]):
        assert (a["samples"], a["real_tokens"], a["padded_tokens"]) == (b["samples"], b["real_tokens"],
                                                                         b["padded_tokens"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["parallel.backbone.pp=9", "parallel.backbone.dp=1"], r"parallel.backbone.pp=9: more pipeline stages"),
        (["parallel.world_size=5"], r"parallel.world_size=5 but the layout needs 3"),
        (["trainer.global_batch_size=7"], r"global_batch_size=7 is not divisible by parallel.backbone.dp=2"),
        (["flow.mode=sideways"], r"flow.mode='sideways'"),
        (["+trainer.bogus=1"], r"bogus"),
        (["trainer.steps=abc"], r"trainer.steps"),
        (["packing.token_budget=8"], r"packing.token_budget=8"),
        (["packing.step_mode=tokens"], r"packing.step_mode='tokens': 'samples', 'packs' or 'window'"),
        (["packing.step_mode=packs", "packing.pad_multiple=64"], r"packing.pad_multiple=64: packing.step_mode=packs"),
        (["packing.step_mode=packs", "packing.lookahead=5000"], r"packing.lookahead=5000: packing.step_mode=packs "
                                                                r"needs it below data.num_samples=4096"),
        (["model.preset=huge"], r"model.preset='huge' is unknown"),
        (["parallel.backbone.dp=1", "parallel.backbone.pp=2", "parallel.backbone.layer_split=[1,2]"],
         r"parallel.backbone.layer_split=\[1, 2\]: must list 2 stage\(s\).*sum to the 4 LLM layers"),
        (["parallel.backbone.layer_split=[4]", "parallel.backbone.dp=1", "parallel.backbone.pp=2"],
         r"parallel.backbone.layer_split=\[4\]: must list 2 stage"),
        (["flow.mode=coupled", "parallel.coupled.pp=2"], r"parallel.coupled.pp=2: must be an integer >= 1 that "
                                                          r"divides the 3 ranks"),
        (["flow.mode=coupled", "parallel.backbone.dp=1", "parallel.coupled.pp=2", "parallel.coupled.layer_split=[0,4]"],
         r"parallel.coupled.layer_split=\[0, 4\]: must list 2 stage\(s\) \(parallel.coupled.pp\), each >= 1"),
        (["parallel.encoder.layer_split=[1]"], r"parallel.encoder.layer_split=\[1\]: the encoder part is not "
                                              r"pipelined"),
        (["model=tiny_qwen3_vl", "parallel.backbone.dp=1", "parallel.backbone.pp=2"],
         r"parallel.backbone.pp=2 with model.family='qwen3_vl': .*data parallel parts only"),
        (["model=tiny_qwen3_vl_moe", "parallel.encoder.tp=2"], r"parallel.encoder.tp=2 with model.family="),
        (["flow.fix_sp_embedding_grad=true"], r"flow.fix_sp_embedding_grad=true: a fix for MindSpeed-MM's VLMModel"),
    ],
)
def test_bad_recipe_names_field_and_rule(tmp_path: Path, capsys, overrides: list[str], match: str) -> None:
    """Rejected before any worker starts (exit code 2), with the field and the rule on stderr."""
    rc = launch.main([f"run_dir={tmp_path}", *overrides])
    assert rc == 2
    assert re.search(match, capsys.readouterr().err)


def _sharegpt_dir(root: Path, good: int, bad: int) -> Path:
    """A LLaVA/ShareGPT-style JSON with `good` readable images and `bad` entries whose image is corrupt or gone."""
    from PIL import Image

    rows = []
    for i in range(good + bad):
        name = f"img{i}.png"
        if i < good:
            Image.new("RGB", (56 + 28 * (i % 3), 84), ((37 * i) % 255, 90, 160)).save(root / name)
        elif i % 2:
            (root / name).write_bytes(b"\x89PNG\r\n\x1a\n truncated")  # corrupt
        # else: the file is missing
        rows.append({"id": i, "image": name, "conversations": [
            {"from": "human", "value": "<image>\nWhat is the main colour?"},
            {"from": "gpt", "value": f"colour {i % 4}"}]})
    path = root / "train.json"
    path.write_text(json.dumps(rows))
    return path


def test_corrupt_samples_are_skipped_and_counted_then_stop_the_job(tmp_path: Path, capfd) -> None:
    data = _sharegpt_dir(tmp_path, good=12, bad=2)
    common = ["experiment=default", "data=sharegpt", f"data.path={data}", "data.num_samples=14",
              "trainer.global_batch_size=12", "trainer.steps=2"]
    lines = train(tmp_path / "ok", *common)
    assert [x["bad_samples_total"] for x in lines] == [2, 2] and all(x["samples"] == 12 for x in lines)
    # Each skip is one line, once (not once per rank), with the record's id, its file and the cause.
    skips = [x for x in capfd.readouterr().out.splitlines() if "skipped bad sample" in x]
    assert len(skips) == 2, skips
    for sid in (12, 13):
        assert any(f"skipped bad sample {sid} (id {sid}, {data}): " in x for x in skips), skips
    rc = launch.main([f"run_dir={tmp_path / 'stop'}", "trainer.progress=false", *common, "data.max_bad_samples=1"])
    assert rc == 1
    err = capfd.readouterr().err
    assert "more than data.max_bad_samples=1" in err and "sample 12" in err and "sample 13" in err, err[-2000:]
    # By rate: 2 bad of the 14 samples read (14 %) is above 10 %; judged once the whole (small) dataset was read.
    rc = launch.main([f"run_dir={tmp_path / 'rate'}", "trainer.progress=false", *common, "data.max_bad_fraction=0.1"])
    assert rc == 1
    err = capfd.readouterr().err
    assert "of the 14 samples read so far, more than data.max_bad_fraction=0.1" in err, err[-2000:]


def _worker_with_wrong_world(rank: int, world: int, config_path: str) -> None:
    from mindspeed_flow.hosts.torch.trainer import run_worker

    run_worker(config_path)


def test_world_size_mismatch_is_reported(tmp_path: Path) -> None:
    """An outer launcher with 2 ranks for a 3-rank layout: every rank stops with the cause, no hang."""
    from mindspeed_flow.utils.multiproc import RankFailure, run_ranks

    path, nproc = launch.prepare([f"run_dir={tmp_path}", "experiment=default"])
    assert nproc == 3
    with pytest.raises(RankFailure, match="launched with 2 ranks but the layout needs 3"):
        run_ranks(_worker_with_wrong_world, 2, str(path), timeout_s=30)


def test_window_steps_match_coupled(tmp_path: Path) -> None:
    """Window steps choose their samples by the backbone's DP size: decoupled 1 encoder + 1 backbone rank and
    MindSpeed-MM's coupled PP2 layout (both DP 1) train the same steps, with the same losses and final parameters."""
    _assert_parity(tmp_path, "parity_dp2", ["parallel.backbone.dp=1", *WINDOW[1:]],
                   coupled_extra=["parallel.coupled.pp=2", "parallel.coupled.layer_split=[1,3]"])


def test_packs_steps_match_coupled(tmp_path: Path) -> None:
    """Token-defined steps are cut by the backbone's DP size and packs per rank: decoupled 1 encoder + 1 backbone
    rank and coupled PP2 (both DP 1) train the same steps, with the same losses and final parameters."""
    _assert_parity(tmp_path, "parity_dp2", ["parallel.backbone.dp=1", *PACKS[1:]],
                   coupled_extra=["parallel.coupled.pp=2", "parallel.coupled.layer_split=[1,3]"])
