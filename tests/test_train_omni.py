"""N parts: the tiny Qwen2.5-Omni thinker trained with its audio encoder, vision encoder and LLM in three process
groups, against coupled training of the same model, plus the pieces underneath (the three-part split against the
whole HF model, the audio data path, the N-part layout and its errors).

Multi-rank runs go through the real launcher (torchrun's elastic agent, fork, gloo), as tests/test_train.py.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from mindspeed_flow.resilience.checkpoint import load_flat
from mindspeed_flow.runtime import launch

OMNI = "qwen2_5_omni_thinker"


def _train(run_dir: Path, *overrides: str) -> list[dict]:
    rc = launch.main([f"run_dir={run_dir}", "trainer.progress=false", *overrides])
    assert rc == 0, f"train {overrides} exited {rc}"
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _dataset(n: int = 64):
    from mindspeed_flow.data.omni import AudioSpec, SyntheticOmni
    from mindspeed_flow.data.synthetic import SyntheticParams
    from mindspeed_flow.data.tokens import token_spec_from_hf_config
    from mindspeed_flow.model_presets import hf_config_dict

    cfg = hf_config_dict(OMNI, "tiny")
    params = SyntheticParams(num_samples=n, max_pixels=16 * 28 * 28, qa_turns_mean=2.0)
    return cfg, SyntheticOmni(params, token_spec_from_hf_config(cfg), AudioSpec.from_hf_config(cfg), (40, 300))


def test_audio_data_has_real_mel_features_and_the_towers_lengths() -> None:
    """Every sample: log-mel features [mel bins, frames], as many audio placeholders as the HF audio tower emits
    rows for them, and shape(i) == sample(i).shape; the mix holds audio-only, image-only and both."""
    from mindspeed_flow.hosts.torch import build_vlm
    from mindspeed_flow.hosts.torch.omni import split_omni

    cfg, ds = _dataset()
    audio = split_omni(build_vlm(OMNI, cfg, seed=0, parts=("audio",)))["audio"]
    kinds = set()
    for i in range(12):
        s = ds.sample(i)
        assert s.shape(ds.merge_size) == ds.shape(i)
        n_audio = int((s.input_ids == cfg["audio_token_id"]).sum())
        assert n_audio == sum(s.audio_token_counts) == ds.shape(i).audio_tokens
        assert ds.shape(i).llm_tokens == s.llm_tokens and ds.shape(i).audio_frames == tuple(s.audio_frames)
        kinds.add((bool(s.audio_frames), bool(s.image_token_counts)))
        for f, frames in zip(s.audio_features, s.audio_frames):
            assert f.shape == (cfg["audio_config"]["num_mel_bins"], frames) and torch.isfinite(f).all()
        if s.audio_frames:
            with torch.no_grad():
                rows = audio.encode_many([s])[0]
            assert rows.shape == (n_audio, cfg["text_config"]["hidden_size"])
        # audio placeholders carry no label (and no question token was drawn as one: counts agree above)
        assert (s.labels[s.input_ids == cfg["audio_token_id"]] == -100).all()
    assert kinds == {(True, False), (False, True), (True, True)}, kinds
    assert ds.sample(3, with_pixels=False).audio_features is None


def test_length_table_of_the_audio_data_keeps_its_clips(tmp_path: Path) -> None:
    """A length table written from the Omni data set holds each sample's clips (the planner's audio part)."""
    from mindspeed_flow.data.length_table import export_length_table
    from mindspeed_flow.data.shapes import read_length_table

    _, ds = _dataset()
    export_length_table(ds, tmp_path / "omni.csv")
    assert read_length_table(tmp_path / "omni.csv") == [ds.shape(i) for i in range(len(ds))]
    assert any(ds.shape(i).audio_frames for i in range(len(ds)))


def test_three_part_split_matches_the_whole_hf_model() -> None:
    """Audio part + vision part + packed backbone (one microbatch, block-diagonal attention) give the loss and
    every parameter's gradient of the whole HF thinker run sample by sample."""
    from mindspeed_flow.hosts.torch import build_vlm
    from mindspeed_flow.hosts.torch.omni import split_omni
    from mindspeed_flow.hosts.torch.packed import shifted_labels

    cfg, ds = _dataset()
    samples = [ds.sample(i) for i in range(6)]
    assert any(s.audio_frames and s.image_token_counts for s in samples)
    ref = build_vlm(OMNI, cfg, seed=3)
    model = build_vlm(OMNI, cfg, seed=3)
    parts = split_omni(model)
    embeds = {"audio": [parts["audio"].encode_many([s])[0] if s.audio_frames else None for s in samples],
              "vision": [parts["vision"].encode_many([s])[0] if s.image_token_counts else None for s in samples]}
    budget = sum(s.llm_tokens for s in samples) + 9  # a padding tail too
    loss, n = parts["backbone"](parts["backbone"].pack(samples, embeds, budget), embeds)
    (loss / n).backward()

    ref_loss = torch.zeros(())
    for s in samples:
        # the mask matters: without one the thinker skips its 3-D rope index and uses 1-D positions
        kwargs = {"input_ids": s.input_ids.view(1, -1), "attention_mask": torch.ones(1, s.llm_tokens, dtype=torch.long)}
        if s.audio_frames:
            f = s.audio_features[0]
            kwargs.update(input_features=f.unsqueeze(0), feature_attention_mask=torch.ones(1, f.shape[-1],
                                                                                            dtype=torch.long))
        if s.image_token_counts:
            kwargs.update(pixel_values=s.pixel_values, image_grid_thw=s.image_grid_thw)
        logits = ref(**kwargs).logits[0]
        ref_loss = ref_loss + torch.nn.functional.cross_entropy(logits.float(), shifted_labels(s.labels),
                                                                ignore_index=-100, reduction="sum")
    (ref_loss / n).backward()
    assert abs(float(loss.detach()) - float(ref_loss.detach())) <= 1e-5 * float(ref_loss.detach())
    got = dict(model.named_parameters())
    checked = 0
    for name, p in ref.named_parameters():
        if p.grad is None:
            assert got[name].grad is None or not got[name].grad.any(), name
            continue
        torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        checked += 1
    assert checked > 50


# (recipe overrides, world size): 1 audio + 1 vision + 1 backbone; 2 audio DP + 1 vision + 2 backbone DP
LAYOUTS = {"a1_v1_bb1": ([], 3),
           # 20 samples a step: coupled training runs 5 DP ranks, each must get the same share
           "a2_v1_bb2": (["parallel.encoders.audio.dp=2", "parallel.backbone.dp=2", "trainer.global_batch_size=20"],
                         5)}


def _matches_coupled(tmp_path: Path, capfd, steps: int, extra: list[str], described: str
                     ) -> tuple[list[dict], list[dict]]:
    """Decoupled and coupled training of the same seed and recipe: the decoupled layout is `described`, the loss
    and the global gradient norm of every step agree (rel <= 1e-5 / 1e-4), and so do the final parameters of all
    three parts (rtol 1e-4, atol 1e-6). Returns both runs' metrics."""
    runs = {}
    for mode in ("decoupled", "coupled"):
        runs[mode] = _train(tmp_path / mode, "experiment=omni_3part", f"trainer.steps={steps}", f"flow.mode={mode}",
                            "trainer.save_final=true", *extra)
        if mode == "decoupled":  # three groups really ran, with the layout's sizes
            assert described in capfd.readouterr().out
    dec, cou = runs["decoupled"], runs["coupled"]
    assert [x["step"] for x in dec] == list(range(steps)) == [x["step"] for x in cou]
    for a, b in zip(dec, cou):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"], (a["step"], a["grad_norm"],
                                                                                b["grad_norm"])
        # both encoder groups worked: samples with audio AND an image were encoded twice, once per part
        assert a["encoder_samples"] > a["samples"], a
    pa = load_flat(tmp_path / "decoupled" / "checkpoints" / f"step-{steps - 1}")
    pb = load_flat(tmp_path / "coupled" / "checkpoints" / f"step-{steps - 1}")
    assert sorted(pa) == sorted(pb)
    assert {k.split(".")[0] for k in pa} == {"audio", "vision", "backbone"}
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")
    return dec, cou


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_three_part_omni_matches_coupled(tmp_path: Path, capfd, layout: str) -> None:
    """Same seed and recipe: the loss and the global gradient norm of every step (rel <= 1e-5 / 1e-4) and the final
    parameters of all three parts equal those of coupled training (every rank runs the whole thinker)."""
    extra, world = LAYOUTS[layout]
    dp = {"audio": 2 if world == 5 else 1, "backbone": 2 if world == 5 else 1}
    described = (f"audio[dp{dp['audio']} tp1 pp1] + vision[dp1 tp1 pp1] + backbone[dp{dp['backbone']} "
                 f"tp1 pp1] on {world} x")
    dec, cou = _matches_coupled(tmp_path, capfd, 6, extra, described)
    for a in dec:
        # balance is judged within each part (audio frames never against ViT costs): one producer each is 1.0
        assert a["encoder_imbalance"] == 1.0 if world == 3 else a["encoder_imbalance"] >= 1.0, a
        # pool traffic per part: each encoder part got back as many gradient bytes as it sent embedding bytes
        # (fp32 both ways), and the backbone received and returned exactly the two parts' sums
        parts = a["pool_bytes_by_part"]
        assert sorted(parts) == ["audio", "backbone", "vision"], parts
        for enc in ("audio", "vision"):
            assert parts[enc]["embedding_bytes_sent"] == parts[enc]["gradient_bytes_received"] > 0, parts
        sent = parts["audio"]["embedding_bytes_sent"] + parts["vision"]["embedding_bytes_sent"]
        assert parts["backbone"]["embedding_bytes_received"] == parts["backbone"]["gradient_bytes_sent"] == sent
        assert sent == a["pool_bytes_sent"], (parts, a["pool_bytes_sent"])
    assert all(c["pool_bytes_by_part"] is None for c in cou)  # coupled: nothing crosses a pool
    assert dec[-1]["loss"] < dec[0]["loss"]


# What the N-part runtime runs besides data parallelism, each against coupled training of the same thinker:
# (recipe overrides, the decoupled layout as the writer prints it). Three steps, at most 5 ranks.
FEATURES = {
    "backbone_tp2": (["parallel.backbone.tp=2"], "audio[dp1 tp1 pp1] + vision[dp1 tp1 pp1] + backbone[dp1 tp2 pp1]"),
    # 5 coupled DP ranks: 10 samples a step, each gets the same share
    "encoders_tp2": (["parallel.encoders.audio.tp=2", "parallel.encoders.vision.tp=2", "trainer.global_batch_size=10"],
                     "audio[dp1 tp2 pp1] + vision[dp1 tp2 pp1] + backbone[dp1 tp1 pp1]"),
    "backbone_pp2": (["parallel.backbone.pp=2"], "audio[dp1 tp1 pp1] + vision[dp1 tp1 pp1] + backbone[dp1 tp1 pp2]"),
    "frozen": (["model.freeze_encoder=true"], "audio[dp1 tp1 pp1] + vision[dp1 tp1 pp1] + backbone[dp1 tp1 pp1]"),
    # ViT patches (<= 64 an image here) for the vision part, mel frames (40..300 a clip) for the audio part
    "batching": (["flow.encoder_batch_tokens=600"], "audio[dp1 tp1 pp1] + vision[dp1 tp1 pp1] + backbone[dp1 tp1 pp1]"),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_three_part_feature_matches_coupled(tmp_path: Path, capfd, feature: str) -> None:
    """Tensor parallel encoders or backbone, a pipelined backbone (its first stage takes both parts' embeddings),
    frozen encoders, encoder batching: each trains as coupled training of the same thinker does."""
    extra, described = FEATURES[feature]
    dec, cou = _matches_coupled(tmp_path, capfd, 3, extra, described)
    if feature == "frozen":  # neither encoder part moved from its initial weights (the recipe's seed 0)
        from mindspeed_flow.hosts.torch import build_vlm
        from mindspeed_flow.hosts.torch.omni import split_omni

        cfg, _ = _dataset()
        parts = split_omni(build_vlm(OMNI, cfg, seed=0))
        final = load_flat(tmp_path / "decoupled" / "checkpoints" / "step-2")
        for part in ("audio", "vision"):
            for name, p in parts[part].named_parameters():
                assert torch.equal(final[f"{part}.{name}"], p.detach()), f"{part}.{name} moved"
    if feature == "batching":  # several samples went through one encoder forward
        assert all(a["encoder_forwards"] < a["encoder_samples"] for a in dec), dec


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["parallel.encoders.audio.tp=3"], r"parallel.encoders.audio.tp=3: the attention heads \(2\) must be "
                                           r"divisible by tp"),
        (["flow.mode=coupled", "parallel.coupled.pp=3"], r"parallel.coupled.pp=3 with several encoder parts"),
        (["~parallel.encoders.vision"], r"parallel.encoders=\['audio'\]: model.family='qwen2_5_omni_thinker' has "
                                        r"the encoder parts \['audio', 'vision'\]"),
        (["+parallel.encoders.audio.bogus=1"], r"parallel.encoders.audio: unknown keys \['bogus'\]"),
        (["parallel.encoders.audio.dp=5"], r"global_batch_size=12 is not divisible by parallel.encoders.audio.dp=5"),
    ],
)
def test_bad_multipart_recipe_names_field_and_rule(tmp_path: Path, capsys, overrides: list[str], match: str) -> None:
    rc = launch.main([f"run_dir={tmp_path}", "experiment=omni_3part", *overrides])
    assert rc == 2
    assert re.search(match, capsys.readouterr().err)


def test_encoders_on_a_one_encoder_model_is_refused(tmp_path: Path, capsys) -> None:
    rc = launch.main([f"run_dir={tmp_path}", "experiment=parity_dp2", "+parallel.encoders.audio.dp=1"])
    assert rc == 2
    assert "parallel.encoders=['audio']: model.family='qwen2_vl' has one encoder part" in capsys.readouterr().err


def test_layout_and_bridges_of_three_parts() -> None:
    """Parts take contiguous rank blocks in list order; each encoder part has its own bridge to the same
    backbone consumers; coupled mode spans every rank."""
    from types import SimpleNamespace

    from mindspeed_flow.step.layout import Layout, bridges_of

    enc = {"audio": {"dp": 2}, "vision": {"dp": 1}}
    cfg = SimpleNamespace(encoder=SimpleNamespace(dp=1, tp=1, pp=1, cp=1), encoders=enc,
                          backbone=SimpleNamespace(dp=2, tp=1, pp=1, cp=1))
    layout = Layout.from_config(cfg, "decoupled")
    layout.validate(world_size=5, global_batch_size=4)
    assert layout.encoder_parts == ["audio", "vision"]
    assert [layout.part_ranks(n) for n in ("audio", "vision", "backbone")] == [[0, 1], [2], [3, 4]]
    bridges = bridges_of(layout)
    assert bridges["audio"].producers == [0, 1] and bridges["vision"].producers == [2]
    assert bridges["audio"].consumers == bridges["vision"].consumers == [3, 4]
    assert bridges["audio"].groups == [([0], [3]), ([1], [4])] and bridges["vision"].groups == [([2], [3, 4])]
    assert Layout.from_config(cfg, "coupled").world_size == 5


def test_three_part_resume_continues_exactly(tmp_path: Path) -> None:
    """Checkpoint the three parts at step 2, resume, and the next steps equal an uninterrupted run's."""
    full = _train(tmp_path / "full", "experiment=omni_3part", "trainer.steps=4")
    _train(tmp_path / "part", "experiment=omni_3part", "trainer.steps=2", "trainer.checkpoint_every=2")
    resumed = _train(tmp_path / "part", "experiment=omni_3part", "trainer.steps=4", "trainer.resume=true",
                     "trainer.checkpoint_every=2")
    assert [x["step"] for x in resumed] == list(range(4))
    for a, b in zip(full[2:], resumed[2:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
