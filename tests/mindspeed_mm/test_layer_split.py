"""The decoder's pipeline split reaches the built model whole, and a coupled pipeline checkpoint loads by share.

A scaled copy of MindSpeed-MM's `examples/qwen2.5vl/model_3b.json` (tied embeddings, frozen ViT and projector)
with a 4-layer LLM. The unpatched job runs as a coupled PP 2 pipeline (ViT on stage 0, LLM layers [1, 3]) for one
iteration and saves; a flow job (encoder 1 + decoder PP 2) loads that checkpoint with --finetune, trains one
iteration and saves its parts. Its decoder split is [1, 3] from one of two sources:

- the recipe's `parallel.backbone.layer_split` (model.json's `pipeline_num_layers` is [4], one stage);
- model.json's `text_decoder.pipeline_num_layers` [1, 3] (one entry per decoder stage; the recipe gives none).

Each stage's layer count is read from the built model (the host's line per stage counts the module's layers) and
from the layer keys of the flow job's saved stage folders. Loading the coupled checkpoint, every rank reads only
the coupled folders holding its tensors: the encoder rank and the first decoder stage open one of the two stage
files, and every rank reads fewer tensor bytes than the checkpoint holds.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from flow_helpers import check_part_groups, load_models, nranks, write_recipe

from mindspeed_flow.emulation.jobs import TinyJob, emulate_job
from mindspeed_flow.emulation.scaled import VIT_LAYERS, scaled_model_json, write_user_like_data_json

pytestmark = [pytest.mark.mindspeed_mm, pytest.mark.slow, pytest.mark.timeout(1800)]

FLAGS = ["--variable-seq-lengths", "--calculate-per-token-loss", "--use-distributed-optimizer"]
SPLIT = [1, 3]
ENC, DEC = {"dp": 1, "tp": 1}, {"dp": 1, "tp": 1, "pp": 2}
STAGE_LINE = re.compile(r"\[mindspeed-flow\] text_decoder stage (\d+): built (\d+) layers "
                        r"\(split (\[[\d, ]*\]) from ([\w.]+ [\w.]+)\)")
READ_LINE = re.compile(r"\[mindspeed-flow\] rank (\d+) \((\w+) tp\d+ pp(\d+)\): read (\d+) bytes of tensor data from "
                       r"(\d+) of (\d+) coupled rank files \([\d.]+% of their (\d+) bytes")
LAYER_KEY = re.compile(r"^text_decoder\.decoder\.layers\.(\d+)\.")


def _model(mm_root: Path, root: Path, text_split: list[int]) -> Path:
    return scaled_model_json(mm_root, "3b", root, **{
        "text_decoder.num_layers": sum(SPLIT), "text_decoder.pipeline_num_layers": text_split,
        "image_encoder.vision_encoder.pipeline_num_layers": [VIT_LAYERS] + [0] * (len(text_split) - 1)})


def _job(model: Path, data: Path, extra: tuple[str, ...] = (), **kw) -> TinyJob:
    return TinyJob(model, data, train_iters=1, global_batch_size=4, seq_length=256, extra=FLAGS + list(extra), **kw)


@pytest.fixture(scope="module")
def coupled(mm_sources, tiny_assets, tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, data.json): one iteration of the unpatched job as a coupled PP 2 pipeline, LLM layers [1, 3]."""
    root = tmp_path_factory.mktemp("coupled_pp2")
    data = write_user_like_data_json(Path(tiny_assets["workdir"]))
    ckpt = root / "ckpt"
    save = _job(_model(mm_sources.mindspeed_mm.root, root, SPLIT), data, pp=2, save=ckpt)
    emulate_job("coupled_pp2_save", save.argv(), log_dir=root, nproc=2).assert_trained(1)
    assert sorted(p.name for p in (ckpt / "iter_0000001").iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    return ckpt, data


@pytest.mark.parametrize("source", ["recipe", "model_json"])
def test_decoder_split_reaches_the_model_and_the_coupled_load_reads_by_share(source, coupled, mm_sources, run_job,
                                                                            tmp_path) -> None:
    ckpt, data = coupled
    if source == "recipe":
        model = _model(mm_sources.mindspeed_mm.root, tmp_path, [sum(SPLIT)])
        recipe = write_recipe(tmp_path / "split.yaml", ENC, {**DEC, "layer_split": SPLIT})
        want_from = "split.yaml parallel.backbone.layer_split"
    else:
        model = _model(mm_sources.mindspeed_mm.root, tmp_path, SPLIT)
        recipe = write_recipe(tmp_path / "split.yaml", ENC, DEC)
        want_from = f"{model.name} text_decoder.pipeline_num_layers"
    saved = tmp_path / "flow_ckpt"
    job = _job(model, data, ("--finetune",), load=ckpt, save=saved)
    result = run_job(f"split_{source}", job.argv(), nproc=nranks(ENC, DEC), flow_recipe=recipe)
    result.assert_trained(1)
    check_part_groups(result.output, ENC, DEC)
    flow_lines = "\n".join(line for line in result.output.splitlines() if "[mindspeed-flow]" in line)
    assert f"decoder pipeline layers {SPLIT} (from {want_from})" in result.output, flow_lines
    # The built model's layers per stage (the host counts the decoder's module list on each stage).
    built = {int(s): (int(n), split, src) for s, n, split, src in STAGE_LINE.findall(result.output)}
    assert built == {0: (1, str(SPLIT), want_from), 1: (3, str(SPLIT), want_from)}, flow_lines
    # The saved stage folders hold those layers, numbered from 0 on each stage.
    models = load_models(saved)
    per_stage = [sorted({int(m.group(1)) for m in map(LAYER_KEY.match, models[f"mp_text_decoder_rank_00_00{s}"])
                         if m}) for s in range(2)]
    assert per_stage == [list(range(n)) for n in SPLIT], per_stage
    # The coupled load: each rank read only its share of the checkpoint.
    reads = {int(r): (part, int(pp), int(b), int(opened), int(files), int(total))
             for r, part, pp, b, opened, files, total in READ_LINE.findall(result.output)}
    assert sorted(reads) == [0, 1, 2], flow_lines
    for rank, (part, pp, read, opened, files, total) in reads.items():
        assert files == 2 and read < total, (rank, reads[rank])
        print(f"{source}: rank {rank} ({part} pp{pp}) read {read} of {total} bytes, {opened} of {files} files")
    assert reads[0][3] == 1 and reads[1][3] == 1  # encoder and decoder stage 0: coupled stage 0 only
