"""Qwen2.5-Omni on MindSpeed-MM's Megatron path (`pretrain_vlm.py`) as a flow job vs the unpatched job.

The tiny job is MindSpeed-MM's own Omni example scaled down (`tiny_omni.prepare_omni_workdir`: model_7b.json and
data_7b.json with their keys, token ids, frozen encoders and `qwen2_omni` template; tiny widths): every sample holds
one video and one audio clip. The vision encoder runs on its own ranks; the audio encoder runs on the decoder's
ranks, whole on its first stage, and its features reach them through MindSpeed-MM's collator as in the unpatched
job. Both jobs load the same coupled checkpoint (audio encoder included) and run 10 bf16 iterations with
`--calculate-per-token-loss`; the flow job's loss must equal the unpatched job's (first iteration within 5e-3, all
within 2e-2 relative; gradient norms within 1e-2) with the vision encoder on 2 DP ranks, with the decoder on more
ranks than the encoder (TP 2), and on two decoder stages as the example splits it, stopped and resumed with the same
command. Further down: the audio encoder as its own part (three parts), mixed samples (audio only, video or image
only, both), and sequence parallelism, which MindSpeed-MM's audio encoder runs only with its model.json section's
sequence parallelism off (it never splits its frames over TP).
"""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from flow_helpers import GROUPS_LINE, assert_flow_matches, check_part_groups, nranks, rel, write_recipe

from mindspeed_flow.emulation.jobs import JobResult, TinyJob, emulate_job, parse_grad_norms

pytestmark = [pytest.mark.mindspeed_mm, pytest.mark.slow, pytest.mark.timeout(2400)]

ITERS = 10
SAMPLES = 16
LAYOUTS = {
    # name: encoder (dp, tp), decoder (dp, tp, pp)
    "enc_dp2_dec1": ({"dp": 2, "tp": 1}, {"dp": 1, "tp": 1, "pp": 1}),
    "enc1_dec_tp2": ({"dp": 1, "tp": 1}, {"dp": 1, "tp": 2, "pp": 1}),
}


def _job(assets: dict, iters: int, **kw) -> TinyJob:
    """The job `tiny_omni` prints for users (the example's flags), with the test's checkpoints and flags."""
    from mindspeed_flow.emulation.tiny_omni import omni_job

    return omni_job(assets, iters, **kw)


@pytest.fixture(scope="module")
def omni_assets(mm_sources, tmp_path_factory) -> dict[str, Path]:
    for module, why in (("av", "MindSpeed-MM reads videos with PyAV"), ("librosa", "MindSpeed-MM reads audio with it")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} absent: {why}")
    from mindspeed_flow.emulation import tiny_omni

    return tiny_omni.prepare_omni_workdir(tmp_path_factory.mktemp("tiny_omni"), mm_sources.mindspeed_mm.root,
                                          n_samples=SAMPLES)


@pytest.fixture(scope="module")
def omni_checkpoint(omni_assets) -> Path:
    """Two iterations of the unpatched 1-rank job, saved: the common starting point (its audio encoder too)."""
    ckpt = omni_assets["workdir"] / "ckpt"
    result = emulate_job("omni_coupled_save", _job(omni_assets, 2, save=ckpt).argv(),
                         log_dir=omni_assets["workdir"], nproc=1)
    result.assert_trained(2)
    return ckpt


def _finetune(assets: dict, ckpt: Path, **kw) -> TinyJob:
    return _job(assets, ITERS, load=ckpt, more=["--finetune"], **kw)


@pytest.fixture(scope="module")
def omni_reference(omni_assets, omni_checkpoint) -> JobResult:
    return emulate_job("omni_coupled_ref", _finetune(omni_assets, omni_checkpoint).argv(),
                       log_dir=omni_assets["workdir"], nproc=1)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_flow_job_trains_omni_as_the_unpatched_job(layout, omni_assets, omni_checkpoint, omni_reference, run_job,
                                                   tmp_path) -> None:
    enc, dec = LAYOUTS[layout]
    recipe = write_recipe(tmp_path / f"{layout}.yaml", enc, dec)
    result = run_job(layout, _finetune(omni_assets, omni_checkpoint).argv(), nproc=nranks(enc, dec),
                     flow_recipe=recipe)
    assert_flow_matches(result, omni_reference, layout, ITERS)
    check_part_groups(result.output, enc, dec)
    assert sum(result.losses[-3:]) / 3 < sum(result.losses[:3]) / 3, result.losses


def test_omni_flow_on_two_decoder_stages_resumes_with_the_same_command(omni_assets, omni_checkpoint, omni_reference,
                                                                      run_job, tmp_path) -> None:
    """The example's own decoder split (two stages, the audio encoder whole on the first): the flow job stops after
    iteration 6 (`--exit-interval`), then the same command with `--load` at its own save runs 7-10. All ten match
    the unpatched job, so the per-part saves (the audio encoder's tensors with the decoder's first stage) resume
    exactly what was left."""
    enc, dec = {"dp": 1, "tp": 1}, {"dp": 1, "tp": 1, "pp": 2}
    recipe = write_recipe(tmp_path / "enc1_dec_pp2.yaml", enc, dec)
    stopped, resumed = _stop_and_resume("pp2", omni_assets, omni_checkpoint, recipe, nranks(enc, dec), run_job,
                                        tmp_path / "save")
    check_part_groups(stopped.output, enc, dec)
    _assert_resumed_matches(stopped, resumed, omni_reference, "pp2 resumed")


def _stop_and_resume(name: str, assets: dict, ckpt: Path, recipe: Path, nproc: int, run_job, save: Path) -> tuple:
    """The flow job from the coupled checkpoint, stopped after iteration 6 (`--exit-interval`), then the same
    command with `--load` at its own save: (the first run, the resumed run)."""
    first = _job(assets, ITERS, load=ckpt, save=save, save_interval=3, more=["--finetune", "--exit-interval", "6"])
    stopped = run_job(f"{name}_first", first.argv(), nproc=nproc, flow_recipe=recipe)
    stopped.assert_trained(6)
    again = _job(assets, ITERS, load=save, save=save, save_interval=3)
    resumed = run_job(f"{name}_resumed", again.argv(), nproc=nproc, flow_recipe=recipe)
    resumed.assert_trained(ITERS - 6, first=7)
    return stopped, resumed


def _assert_resumed_matches(stopped, resumed, reference, what: str) -> None:
    """The stopped and resumed runs together match the unpatched job's ten iterations."""
    flow = stopped.losses + resumed.losses
    norms = parse_grad_norms(stopped.output) + parse_grad_norms(resumed.output)
    loss_rel = rel(flow, reference.losses)
    norm_rel = rel(norms, parse_grad_norms(reference.output))
    print(f"{what}: flow {flow}\nunpatched {reference.losses}\nlargest relative difference: loss "
          f"{max(loss_rel):.1e}, grad norm {max(norm_rel):.1e}")
    assert len(flow) == len(norms) == ITERS
    assert loss_rel[0] <= 5e-3 and max(loss_rel) <= 2e-2, (loss_rel, flow)
    assert max(norm_rel) <= 1e-2, norms


@pytest.fixture(scope="module")
def mixed_assets(mm_sources, omni_assets, tmp_path_factory) -> dict[str, Path]:
    """Samples in turn: a video and a clip, a clip alone, a video alone; read in order (no shuffle), so each
    global batch of 4 holds all three kinds."""
    from mindspeed_flow.emulation import tiny_omni

    return tiny_omni.prepare_omni_workdir(tmp_path_factory.mktemp("tiny_omni_mixed"), mm_sources.mindspeed_mm.root,
                                          n_samples=SAMPLES, videos_per_sample=(1, 0, 1),
                                          audios_per_sample=(1, 1, 0), shuffle=False)


def test_omni_flow_trains_audio_only_video_only_and_mixed_samples(mixed_assets, run_job, tmp_path) -> None:
    """Every kind of sample in one step, the decoder on two DP ranks. MindSpeed-MM's collator gives a batch without
    a video a blank image, whose ViT rows then find no place at img_context_token_id (the video pad): the unpatched
    job fails on a clip-only microbatch ("shape mismatch: value tensor of shape [4, 64] cannot be broadcast to
    indexing result of shape [0, 64]", checked by hand), so it trains this data set only with each global batch as
    one microbatch (`--micro-batch-size 4`), the reference here. The flow job builds its own microbatches: one with
    clips and no video gets an empty set of vision rows, which opens the model's branch that scatters audio rows,
    and one without clips an empty clip mask for the rope index. The token budget gives about one sample per
    microbatch, so both happen; with the first disabled by hand the gradient norms here differ by 34 %."""
    ckpt = mixed_assets["workdir"] / "ckpt"
    saved = emulate_job("mixed_save", _job(mixed_assets, 2, save=ckpt, micro_batch_size=4).argv(),
                        log_dir=mixed_assets["workdir"], nproc=1)
    saved.assert_trained(2)
    reference = emulate_job("mixed_ref", _finetune(mixed_assets, ckpt, micro_batch_size=4).argv(),
                            log_dir=mixed_assets["workdir"], nproc=1)
    enc, dec = {"dp": 1, "tp": 1}, {"dp": 2, "tp": 1, "pp": 1}
    recipe = write_recipe(tmp_path / "enc1_dec_dp2.yaml", enc, dec)
    # A budget of about one sample per microbatch, so that some microbatch holds a clip and no video.
    recipe.write_text(recipe.read_text().replace("token_budget: 256", "token_budget: 96"))
    result = run_job("mixed_enc1_dec_dp2", _finetune(mixed_assets, ckpt).argv(), nproc=nranks(enc, dec),
                     flow_recipe=recipe)
    assert_flow_matches(result, reference, "mixed", ITERS)
    check_part_groups(result.output, enc, dec)


# ------------------------------------------------------------------ the audio encoder as its own part (three parts)

READ_LINE = re.compile(r"rank (\d+) \((encoder|audio encoder|decoder) dp\d+[^)]*\) read (\d+) samples, (\d+) bytes of "
                       r"pixels, (\d+) bytes of audio features")
PART_BYTES = re.compile(r"gradient bytes sent \d+ \(decoder, this step: image encoder (\d+), audio encoder (\d+)\)")


def three_part_recipe(path: Path, vision: dict, audio: dict, dec: dict, token_budget: int = 256) -> Path:
    """A flow recipe with the vision encoder, the audio encoder and the LLM each on its own ranks."""
    def sizes(p: dict) -> str:
        return f"{{dp: {p['dp']}, tp: {p.get('tp', 1)}, pp: {p.get('pp', 1)}, cp: 1}}"

    path.write_text("\n".join([
        "# mindspeed-flow emulate --nproc N --flow-recipe THIS.yaml -- pretrain_vlm.py <Qwen2.5-Omni job args>",
        "parallel:", "  encoders:", f"    vision: {sizes(vision)}", f"    audio: {sizes(audio)}",
        f"  backbone: {sizes(dec)}", "packing:", f"  token_budget: {token_budget}"]) + "\n")
    return path


def check_three_parts(output: str, vision: dict, audio: dict, dec: dict) -> None:
    """Every rank's Megatron groups lie inside its own part (vision, audio, decoder in rank order), with the part's
    sizes; no rank but the vision encoder's reads a pixel, none but the audio encoder's a clip."""
    sizes = {"encoder": vision, "audio": audio, "backbone": dec}
    first = {"encoder": 0, "audio": vision["dp"] * vision.get("tp", 1)}
    first["backbone"] = first["audio"] + audio["dp"] * audio.get("tp", 1)
    world = first["backbone"] + dec["dp"] * dec.get("tp", 1) * dec.get("pp", 1)
    rows = GROUPS_LINE.findall(output)
    assert sorted(int(r) for r, _, _ in rows) == list(range(world)), output[-3000:]
    for rank, part, text in rows:
        lay = sizes[part]
        own = range(first[part], first[part] + lay["dp"] * lay.get("tp", 1) * lay.get("pp", 1))
        groups = {k: json.loads(v) for k, v in re.findall(r"(\w+)=(\[[^\]]*\])", text)}
        assert int(rank) in own and all(r in own for g in groups.values() for r in g), (rank, part, groups)
        assert len(groups["tp"]) == lay.get("tp", 1) and len(groups["dp"]) == lay["dp"], (rank, groups)
    # Each side reads what it uses only: pixels on the vision encoder, clips on the audio encoder, neither on
    # the decoder (its rope index takes the clips' frame counts from the metadata index).
    reads = READ_LINE.findall(output)
    assert len(reads) == world, reads
    for _, side, n, pixels, clips in reads:
        assert int(n) > 0 and (int(pixels) > 0) == (side == "encoder"), reads
        assert (int(clips) > 0) == (side == "audio encoder"), reads


def test_omni_audio_encoder_as_its_own_part_resumes_with_the_same_command(omni_assets, omni_checkpoint,
                                                                          omni_reference, run_job,
                                                                          tmp_path) -> None:
    """Three parts as MindSpeed-MM's example freezes them: the vision encoder on rank 0, the audio encoder on its
    own two DP ranks (each clip encoded once, by one of them, and sent to the decoder as its `<|AUDIO|>` rows), the
    LLM on the last rank. The flow job stops after iteration 6 and the same command resumes from its own save
    (the audio part in its own `mp_audio_encoder_rank_*` folders); all ten iterations match the unpatched job."""
    vision, audio, dec = {"dp": 1}, {"dp": 2}, {"dp": 1}
    recipe = three_part_recipe(tmp_path / "v1_a2_d1.yaml", vision, audio, dec)
    save = tmp_path / "save"
    stopped, resumed = _stop_and_resume("three", omni_assets, omni_checkpoint, recipe, 4, run_job, save)
    check_three_parts(stopped.output, vision, audio, dec)
    assert "audio encoder frozen" in stopped.output
    folders = sorted(p.name for p in (save / "iter_0000006").iterdir())
    assert folders == ["mp_audio_encoder_rank_00", "mp_image_encoder_rank_00", "mp_text_decoder_rank_00"], folders
    _assert_resumed_matches(stopped, resumed, omni_reference, "three parts resumed")


@pytest.fixture(scope="module")
def mixed_trained_assets(mm_sources, omni_assets, tmp_path_factory) -> dict[str, Path]:
    """The mixed samples of `mixed_assets`, with model.json's audio encoder trained (`freeze: false`)."""
    from mindspeed_flow.emulation import tiny_omni

    assets = tiny_omni.prepare_omni_workdir(tmp_path_factory.mktemp("tiny_omni_audio_trained"),
                                            mm_sources.mindspeed_mm.root, n_samples=SAMPLES,
                                            videos_per_sample=(1, 0, 1), audios_per_sample=(1, 1, 0), shuffle=False)
    model = json.loads(assets["model_json"].read_text())
    model["audio_encoder"]["audio_encoder"]["freeze"] = False
    assets["model_json"].write_text(json.dumps(model, indent=4))
    return assets


def test_omni_three_parts_train_the_audio_encoder_on_audio_only_video_only_and_mixed_samples(
        mixed_trained_assets, run_job, tmp_path) -> None:
    """Every kind of sample in one step (video + clip, clip alone, video alone), the audio encoder trained on its
    own rank, the LLM on two DP ranks (more than either encoder). The decoder returns each clip's gradient to the
    audio rank that encoded it, and counts those bytes apart from the image encoder's (frozen here: none). The
    global gradient norm is the audio part's and the decoder's together, once: Megatron's distributed optimizer
    reduces a part's norm over "the whole world", which in a flow job is the part (without that the norm here was
    the decoder's twice, sqrt(2) too large). Reference: the unpatched job with each global batch as one microbatch
    (see the two-part mixed test)."""
    per_part = _three_parts_with_audio_trained(mixed_trained_assets, run_job, tmp_path, "trained", {"dp": 1},
                                               {"dp": 1}, {"dp": 2}, "three parts, audio trained")
    assert all(v == 0 and a > 0 for v, a in per_part), per_part


def _three_parts_with_audio_trained(assets: dict[str, Path], run_job, tmp_path: Path, tag: str, vision: dict,
                                    audio: dict, dec: dict, what: str) -> list[tuple[int, int]]:
    """Two coupled iterations saved, then the unpatched job (each global batch one microbatch) against the flow job
    in three parts from that checkpoint: parity every iteration, the parts' ranks, the audio encoder trained; the
    gradient bytes each step returned to (the image encoder, the audio encoder)."""
    ckpt = assets["workdir"] / "ckpt"
    emulate_job(f"{tag}_save", _job(assets, 2, save=ckpt, micro_batch_size=4).argv(), log_dir=assets["workdir"],
                nproc=1).assert_trained(2)
    reference = emulate_job(f"{tag}_ref", _finetune(assets, ckpt, micro_batch_size=4).argv(),
                            log_dir=assets["workdir"], nproc=1)
    name = f"v{vision['dp']}_a{audio['dp']}_d{dec['dp']}"
    recipe = three_part_recipe(tmp_path / f"{name}.yaml", vision, audio, dec, token_budget=96)
    result = run_job(f"three_{tag}", _finetune(assets, ckpt).argv(), nproc=4, flow_recipe=recipe)
    assert_flow_matches(result, reference, what, ITERS)
    check_three_parts(result.output, vision, audio, dec)
    assert "audio encoder trainable" in result.output
    per_part = [(int(v), int(a)) for v, a in PART_BYTES.findall(result.output)]
    print(f"gradient bytes per step (image encoder, audio encoder): {per_part}")
    assert len(per_part) == ITERS, per_part
    return per_part


@pytest.fixture(scope="module")
def image_assets(mm_sources, omni_assets, tmp_path_factory) -> dict[str, Path]:
    """Samples in turn: an image and a clip, a clip alone, an image alone (read in order, so every global batch of 4
    holds all three kinds), with both encoders trained (`freeze: false` in model.json). With images, model.json's
    `img_context_token_id` is the image pad (`tiny_omni.prepare_omni_workdir`)."""
    from mindspeed_flow.emulation import tiny_omni

    assets = tiny_omni.prepare_omni_workdir(tmp_path_factory.mktemp("tiny_omni_images"), mm_sources.mindspeed_mm.root,
                                            n_samples=SAMPLES, images_per_sample=(1, 0, 1), videos_per_sample=(0,),
                                            audios_per_sample=(1, 1, 0), shuffle=False)
    model = json.loads(assets["model_json"].read_text())
    model["image_encoder"]["vision_encoder"]["freeze"] = False
    model["image_encoder"]["vision_projector"]["freeze"] = False
    model["audio_encoder"]["audio_encoder"]["freeze"] = False
    assets["model_json"].write_text(json.dumps(model, indent=4))
    return assets


def test_omni_three_parts_train_both_encoders_on_image_only_audio_only_and_mixed_samples(image_assets, run_job,
                                                                                         tmp_path) -> None:
    """Images instead of videos: image + clip, clip alone and image alone in one step, the vision encoder on two DP
    ranks, the audio encoder on one, the LLM on one, both encoders trained. Each part gets its own gradients back and
    the log counts them apart, every step: image rows to the vision rank that encoded them, clip rows to the audio
    rank. Reference: the unpatched job with each global batch as one microbatch (a microbatch without an image
    fails there, as one without a video does; see the two-part mixed test)."""
    per_part = _three_parts_with_audio_trained(image_assets, run_job, tmp_path, "images", {"dp": 2}, {"dp": 1},
                                               {"dp": 1}, "three parts, images, both encoders trained")
    assert all(v > 0 and a > 0 for v, a in per_part), per_part


# ------------------------------------------------------------------ sequence parallelism with the audio encoder

SP_LAYOUTS = {
    # name: (vision, audio or None (on the decoder's first stage), decoder, extra flags)
    "three_audio_tp2": ({"dp": 1}, {"dp": 1, "tp": 2}, {"dp": 1, "tp": 2}, []),
    "two_parts_dec_tp2": ({"dp": 1, "tp": 1}, None, {"dp": 1, "tp": 2, "pp": 1}, []),
    "three_audio_tp1_mc2": ({"dp": 1}, {"dp": 1, "tp": 1}, {"dp": 1, "tp": 2}, ["--use-ascend-mc2"]),
}


@pytest.fixture(scope="module")
def sp_assets(mm_sources, omni_assets, tmp_path_factory) -> dict:
    """The Omni example with `"sequence_parallel": false` in model.json's audio encoder section (MindSpeed-MM's
    audio encoder never splits its frames over TP, so that is how it runs under --sequence-parallel, unpatched or
    not), a coupled TP 2 + SP checkpoint after one iteration, and the unpatched TP 2 + SP job from it (bf16 sums
    in another TP order drift apart, so the reference runs the decoder's TP)."""
    from mindspeed_flow.emulation import tiny_omni

    assets = tiny_omni.prepare_omni_workdir(tmp_path_factory.mktemp("tiny_omni_sp"), mm_sources.mindspeed_mm.root,
                                            n_samples=SAMPLES)
    model = json.loads(assets["model_json"].read_text())
    model["audio_encoder"]["audio_encoder"]["sequence_parallel"] = False
    assets["model_json"].write_text(json.dumps(model, indent=4))
    ckpt = assets["workdir"] / "ckpt_tp2"
    emulate_job("sp_save", _job(assets, 1, save=ckpt, tp=2, sequence_parallel=True).argv(),
                log_dir=assets["workdir"], nproc=2).assert_trained(1)
    reference = emulate_job("sp_ref", _finetune(assets, ckpt, tp=2, sequence_parallel=True).argv(),
                            log_dir=assets["workdir"], nproc=2)
    return {"assets": assets, "ckpt": ckpt, "reference": reference}


@pytest.mark.parametrize("layout", list(SP_LAYOUTS))
def test_omni_with_sequence_parallel_matches_the_unpatched_job(layout, sp_assets, run_job, tmp_path) -> None:
    """The decoder on TP 2 with --sequence-parallel, the audio encoder on its own two TP ranks or on the decoder's
    first stage (both with its model.json section's sequence parallelism off), or on its own rank without TP under
    MC2 (MindSpeed refuses MC2 in a TP module without sequence parallelism, so the audio encoder can run beside MC2
    only as a part without TP; the unpatched job cannot run MC2 with Omni at all, and MC2 computes what TP + SP
    does, so the reference stays the TP 2 + SP job). Every layout matches the unpatched job."""
    vision, audio, dec, flags = SP_LAYOUTS[layout]
    if audio is None:
        recipe, nproc = write_recipe(tmp_path / f"{layout}.yaml", vision, dec), nranks(vision, dec)
    else:
        recipe = three_part_recipe(tmp_path / f"{layout}.yaml", vision, audio, dec)
        nproc = 1 + audio["tp"] + dec["tp"]
    job = _job(sp_assets["assets"], ITERS, load=sp_assets["ckpt"], tp=2, sequence_parallel=True,
               more=["--finetune", *flags])
    result = run_job(layout, job.argv(), nproc=nproc, flow_recipe=recipe)
    assert_flow_matches(result, sp_assets["reference"], layout, ITERS)
    if audio is not None:
        check_three_parts(result.output, vision, audio, dec)


def test_fix_sp_embedding_grad_gives_the_gradients_of_the_job_without_sequence_parallelism(sp_assets, run_job,
                                                                                          tmp_path) -> None:
    """MindSpeed-MM's VLMModel gathers the text embeddings out of the sequence-parallel region with a backward that
    sums the TP ranks' identical gradients: under --sequence-parallel the word embedding gets TP times its
    gradient, and the unpatched job's gradient norms differ from the same job's without sequence parallelism. With
    `flow.fix_sp_embedding_grad: true` the flow job (decoder TP 2 + SP) matches the unpatched job WITHOUT sequence
    parallelism from the same checkpoint, losses and norms."""
    assets, ckpt = sp_assets["assets"], sp_assets["ckpt"]
    no_sp = emulate_job("no_sp_ref", _finetune(assets, ckpt, tp=2).argv(), log_dir=assets["workdir"], nproc=2)
    upstream, exact = parse_grad_norms(sp_assets["reference"].output), parse_grad_norms(no_sp.output)
    print(f"unpatched TP 2 gradient norms: with SP {upstream}\nwithout SP {exact}")
    assert len(upstream) == len(exact) == ITERS and max(rel(upstream, exact)) > 0.1, (upstream, exact)
    vision, dec = {"dp": 1, "tp": 1}, {"dp": 1, "tp": 2, "pp": 1}
    recipe = write_recipe(tmp_path / "fixed.yaml", vision, dec)
    recipe.write_text(recipe.read_text() + "flow:\n  fix_sp_embedding_grad: true\n")
    job = _job(assets, ITERS, load=ckpt, tp=2, sequence_parallel=True, more=["--finetune"])
    result = run_job("fixed_sp_grad", job.argv(), nproc=nranks(vision, dec), flow_recipe=recipe)
    assert "sequence-parallel embedding gradient split, not summed" in result.output
    assert_flow_matches(result, no_sp, "SP embedding gradient fixed vs unpatched without SP", ITERS)
