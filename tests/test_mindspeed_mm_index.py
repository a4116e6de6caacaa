"""The MindSpeed-MM host's metadata index and per-side reads, without MindSpeed sources (a fake data set and
collator of MindSpeed-MM's shape: items of token ids and labels, pixels from the collator)."""
from __future__ import annotations

import functools
import multiprocessing
import os
from pathlib import Path

import pytest
import torch

from mindspeed_flow.hosts.mindspeed_mm.data import (FlowDataError, FlowStepSource, IndexedReads, SideNeeds,
                                                    WholeBatchReads, sample_meta)
from mindspeed_flow.hosts.mindspeed_mm.index import index_inputs, load_or_build
from mindspeed_flow.packing import CostModel
from mindspeed_flow.step.layout import Bridge

VSTART, IMG, MERGE, CHANNELS = 1, 2, 2, 3


def _item(i: int) -> dict:
    """Sample i: 0-2 images of 2x2 patches (one image token each), text of 3 + i % 5 tokens."""
    n_images = i % 3
    ids = [10 + i] + [VSTART, IMG] * n_images + [20 + k for k in range(3 + i % 5)]
    labels = [-100] * (1 + 2 * n_images) + ids[1 + 2 * n_images:]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels,
            "images": [f"img{i}_{k}" for k in range(n_images)]}


class Data:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return _item(i)


class Collate:
    """MindSpeed-MM's collator shape: right padding, pixels and grids for the batch's images (value = image)."""

    def __init__(self) -> None:
        self.images_processed = 0

    def __call__(self, features: list[dict]) -> dict:
        images = [im for f in features for im in f.pop("images")]
        self.images_processed += len(images)
        n = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros((len(features), n), dtype=torch.long)
        labels = torch.full((len(features), n), -100, dtype=torch.long)
        mask = torch.zeros((len(features), n), dtype=torch.long)
        for r, f in enumerate(features):
            k = len(f["input_ids"])
            ids[r, :k], labels[r, :k], mask[r, :k] = torch.tensor(f["input_ids"]), torch.tensor(f["labels"]), 1
        batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
        if images:
            batch["image_grid_thw"] = torch.tensor([[1, 2, 2]] * len(images))
            batch["pixel_values"] = torch.cat([torch.full((4, CHANNELS), float(hash(im) % 97)) for im in images])
        return batch


def _inputs(tmp_path: Path, n: int, seq_length: int = 128) -> dict:
    param = {"dataset_type": "huggingface", "preprocess_parameters": {"model_name_or_path": str(tmp_path / "proc")},
             "basic_parameters": {"dataset": str(tmp_path / "data.json"), "cache_dir": str(tmp_path / "cache")},
             "attr": {"images": "images"}}
    return index_inputs(param, seq_length, Data(n), {"vision_start_id": VSTART, "image_token_id": IMG,
                                                     "merge_size": MERGE})


def _files(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir(exist_ok=True)
    (tmp_path / "proc" / "preprocessor_config.json").write_text('{"max_pixels": 12544}')
    (tmp_path / "data.json").write_text("[1, 2, 3]")


def test_index_is_reused_and_rebuilt_when_data_processor_or_cutoff_change(tmp_path) -> None:
    _files(tmp_path)
    n, built, lines = 12, [], []
    collate = Collate()

    def describe(i: int):
        built.append(i)
        return sample_meta(Data(n), collate, VSTART, IMG, MERGE, i)

    def index(**kw):
        built.clear()
        out = load_or_build(tmp_path / "cache" / "idx", _inputs(tmp_path, n, **kw), describe, n, log=lines.append)
        return out, len(built)

    first, calls = index()
    assert calls == n and "built 12 samples" in lines[-1]
    for i in range(n):  # what the index says is what the collator gave
        m, item = first.meta(i), _item(i)
        assert m.length == len(item["input_ids"]) and m.image_tokens == len(item["images"])
        assert m.loss_tokens == sum(1 for x in item["labels"][1:] if x != -100)
        assert (m.grid is None) == (not item["images"])
    again, calls = index()
    assert calls == 0 and "reused" in lines[-1] and torch.equal(again.grids, first.grids)
    (tmp_path / "data.json").write_text("[1, 2, 3, 4]")  # the data file changed: another key, built again
    _, calls = index()
    assert calls == n and "built" in lines[-1]
    st = os.stat(tmp_path / "proc" / "preprocessor_config.json")
    (tmp_path / "proc" / "preprocessor_config.json").write_text('{"max_pixels": 99999}')  # same size, new content
    os.utime(tmp_path / "proc" / "preprocessor_config.json", ns=(st.st_atime_ns, st.st_mtime_ns))
    _, calls = index()
    assert calls == n
    _, calls = index(seq_length=64)  # the cutoff changes the token ids
    assert calls == n
    _, calls = index(seq_length=64)
    assert calls == 0
    # built with loader worker processes (the job's --num-workers): the same index
    par = load_or_build(tmp_path / "cache" / "par", _inputs(tmp_path, n, seq_length=64),
                        functools.partial(sample_meta, Data(n), Collate(), VSTART, IMG, MERGE), n, workers=2,
                        log=lines.append)
    again, _ = index(seq_length=64)
    assert all(torch.equal(getattr(par, f), getattr(again, f)) for f in ("lengths", "loss_tokens", "grids"))


def _build_in_process(tmp: str, n: int, out: str) -> None:
    def describe(i: int):
        with open(out, "a") as fh:
            fh.write(f"{i}\n")
        return sample_meta(Data(n), Collate(), VSTART, IMG, MERGE, i)

    load_or_build(Path(tmp) / "cache" / "idx", _inputs(Path(tmp), n), describe, n, log=lambda _: None)


def test_ranks_starting_together_build_the_index_once(tmp_path) -> None:
    """Four processes at once: one builds under the lock, the others wait and read it (whatever the timing)."""
    _files(tmp_path)
    n, out = 40, tmp_path / "described.txt"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_build_in_process, args=(str(tmp_path), n, str(out))) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sorted(int(x) for x in out.read_text().split()) == list(range(n))  # every sample described once


def _source(reads, gbs: int = 8) -> FlowStepSource:
    return FlowStepSource(reads, global_batch_size=gbs, micro_batch_size=2,
                          bridges={"encoder": Bridge.build([0, 1], [2, 3])}, token_budget=32, cost_model=CostModel(),
                          scheduler="flow", min_microbatches=1, oversize_policy="error", merge_size=MERGE)


def _batch_sampler(replica: int, n: int):
    """Replica r's micro-batches of 2 (DP 2), one pass over n samples."""
    order = list(range(n))[replica::2]
    return [order[k:k + 2] for k in range(0, len(order) - 1, 2)]


def test_each_side_loads_only_what_it_uses_and_plans_as_whole_reads(tmp_path) -> None:
    _files(tmp_path)
    n = 24
    index = load_or_build(tmp_path / "cache" / "idx", _inputs(tmp_path, n),
                          lambda i: sample_meta(Data(n), Collate(), VSTART, IMG, MERGE, i), n, log=lambda _: None)
    sides = {"enc0": SideNeeds(encoder_leader=0), "enc1": SideNeeds(encoder_leader=1),
             "dec0_first": SideNeeds(decoder_dp=0), "dec0_last": SideNeeds(decoder_dp=0, labels=True),
             "dec1_last": SideNeeds(decoder_dp=1, labels=True)}
    collates = {name: Collate() for name in sides}
    sources = {name: _source(IndexedReads(Data(n), collates[name], [_batch_sampler(r, n) for r in range(2)], index,
                                          need, VSTART, IMG, MERGE)) for name, need in sides.items()}
    whole_collate = Collate()
    loaders = [[whole_collate([_item(i) for i in b]) for b in _batch_sampler(r, n)] for r in range(2)]
    whole = _source(WholeBatchReads(loaders, VSTART, IMG, MERGE))
    pixels_whole = 0
    for _ in range(4):  # 4 steps: two passes over the data (the samplers cycle)
        ref = next(whole)
        steps = {name: next(src) for name, src in sources.items()}
        image_ids = {sid for sid, s in ref.samples.items() if s.image_tokens}
        for name, step in steps.items():  # every rank plans the whole batch's plan from the index alone
            assert step.work.plan.microbatches == ref.work.plan.microbatches
            assert step.work.encode_order == ref.work.encode_order and step.counts == ref.counts
        enc = [{sid for sid, s in steps[e].samples.items() if s.pixel_values is not None} for e in ("enc0", "enc1")]
        assert enc[0] | enc[1] == image_ids and not enc[0] & enc[1]
        for e, have in zip(("enc0", "enc1"), enc):
            for sid in have:
                assert torch.equal(steps[e].samples[sid].pixel_values, ref.samples[sid].pixel_values)
            assert all(s.input_ids is None and s.labels is None for s in steps[e].samples.values())
        for name in ("dec0_first", "dec0_last", "dec1_last"):
            dp = sides[name].decoder_dp
            mine = {sid for ids in ref.microbatches(dp) for sid in ids}
            for sid, s in steps[name].samples.items():
                assert s.pixel_values is None
                assert (s.input_ids is not None) == (sid in mine)
                assert (s.labels is not None) == (sid in mine and sides[name].labels)
                if sid in mine:
                    assert torch.equal(s.input_ids, ref.samples[sid].input_ids)
                    if s.labels is not None:
                        assert torch.equal(s.labels, ref.samples[sid].labels)
                    assert s.loss_tokens == ref.samples[sid].loss_tokens
                    assert s.batch_loss_tokens == ref.samples[sid].batch_loss_tokens
        pixels_whole = whole.pixel_bytes_read
    assert whole.pixel_bytes_read == sum(sources[e].pixel_bytes_read for e in ("enc0", "enc1")) == pixels_whole > 0
    assert all(sources[d].pixel_bytes_read == 0 and collates[d].images_processed == 0
               for d in ("dec0_first", "dec0_last", "dec1_last"))
    assert sources["enc0"].pixel_bytes_read < whole.pixel_bytes_read


def test_a_changed_image_stops_the_encoder_naming_the_sample(tmp_path) -> None:
    _files(tmp_path)
    n = 8
    index = load_or_build(tmp_path / "cache" / "idx", _inputs(tmp_path, n),
                          lambda i: sample_meta(Data(n), Collate(), VSTART, IMG, MERGE, i), n, log=lambda _: None)

    class Resized(Collate):
        def __call__(self, features: list[dict]) -> dict:
            batch = super().__call__(features)
            if "image_grid_thw" in batch:
                batch["image_grid_thw"] = batch["image_grid_thw"] * torch.tensor([1, 2, 1]) // torch.tensor([1, 1, 2])
            return batch

    reads = IndexedReads(Data(n), Resized(), [_batch_sampler(r, n) for r in range(2)], index,
                         SideNeeds(encoder_leader=0), VSTART, IMG, MERGE)
    with pytest.raises(FlowDataError, match=r"data set sample \d+: its image_grid_thw .* differs from the metadata"):
        next(_source(reads, gbs=4))


def _video_batch(n_videos: int, with_images: bool = False) -> dict:
    """A collated batch of one sample with `n_videos` videos as MindSpeed-MM's collator gives it: grids of 2
    temporal patches, one second per grid step each, vision tokens at IMG (model.json's img_context_token_id set
    to the video pad id)."""
    ids = torch.tensor([[10] + [VSTART, IMG, IMG] * n_videos + [20, 21]])
    labels = torch.full_like(ids, -100)
    labels[0, -2:] = ids[0, -2:]
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids),
             "video_grid_thw": torch.tensor([[2, 2, 2]] * n_videos),
             "pixel_values_videos": torch.arange(8 * n_videos * CHANNELS, dtype=torch.float32).reshape(-1, CHANNELS),
             "second_per_grid_ts": [0.5 + v for v in range(n_videos)]}
    if with_images:
        batch["image_grid_thw"], batch["pixel_values"] = torch.tensor([[1, 2, 2]]), torch.zeros((4, CHANNELS))
    return batch


def test_video_samples_are_split_as_mindspeed_mm_renames_them() -> None:
    from mindspeed_flow.hosts.mindspeed_mm.data import collate_rows, split_batch

    batch = _video_batch(2)
    (s,) = split_batch(batch, 0, VSTART, IMG, MERGE)
    assert torch.equal(s.image_grid_thw, batch["video_grid_thw"])  # the grid the ViT gets, as in get_batch
    assert torch.equal(s.pixel_values, batch["pixel_values_videos"])
    assert s.image_tokens == 4 and s.second_per_grid_ts.tolist() == [0.5, 1.5]
    rows = collate_rows([s])
    assert rows["second_per_grid_ts"] == [0.5, 1.5] and torch.equal(rows["image_grid_thw"], s.image_grid_thw)


def test_video_tokens_elsewhere_than_img_context_token_id_are_named() -> None:
    from mindspeed_flow.hosts.mindspeed_mm.data import split_batch

    with pytest.raises(ValueError, match="img_context_token_id set to the <\\|video_pad\\|> id"):
        split_batch(_video_batch(1), 0, VSTART, IMG + 1, MERGE)


def test_images_and_videos_in_one_batch_are_refused() -> None:
    from mindspeed_flow.hosts.mindspeed_mm.data import split_batch

    with pytest.raises(FlowDataError, match="carry both images and videos"):
        split_batch(_video_batch(1, with_images=True), 0, VSTART, IMG, MERGE)


def test_index_keeps_video_grids_and_seconds() -> None:
    from mindspeed_flow.hosts.mindspeed_mm.index import MetadataIndex, SampleMeta

    metas = [SampleMeta(5, 1, 2, False, torch.tensor([[1, 2, 2]])),
             SampleMeta(9, 4, 2, True, torch.tensor([[2, 2, 2], [2, 2, 2]]), torch.tensor([0.5, 1.5])),
             SampleMeta(3, 0, 2, False, None)]
    index = MetadataIndex.from_metas(metas)
    got = index.meta(1)
    assert got.has_video and got.grid.tolist() == [[2, 2, 2], [2, 2, 2]] and got.seconds.tolist() == [0.5, 1.5]
    assert index.meta(0).seconds is None and index.meta(2).grid is None


def test_audio_clips_are_cut_per_sample_and_batched_back_in_order() -> None:
    """Qwen2.5-Omni: a batch's clips ([clips, mel, frames] and their masks) belong to the samples in order, one per
    <|audio_bos|>; a decoder microbatch concatenates them again, the video seconds under Omni's key (a tensor), and
    a microbatch without clips (or without samples) carries an empty mask for the rope index."""
    from mindspeed_flow.hosts.mindspeed_mm.data import AUDIO_START_ID, OMNI_SECONDS_KEY, collate_rows, split_batch

    audio = [AUDIO_START_ID, 7, 7, 8]
    ids = torch.tensor([[5] + audio + audio + [6], [5, 3, 3, 3, 3, 3, 3, 3, 3, 6], [5] + audio + [6, 0, 0, 0, 0]])
    mask = (ids != 0).long()
    features = torch.arange(3 * 2 * 5, dtype=torch.float32).reshape(3, 2, 5)
    clip_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask, "input_features": features,
             "feature_attention_mask": clip_mask}
    two, none, one = split_batch(batch, 0, VSTART, IMG, MERGE)
    assert torch.equal(two.audio_features, features[:2]) and torch.equal(two.audio_mask, clip_mask[:2])
    assert none.audio_features is None and none.audio_mask is None
    assert torch.equal(one.audio_features, features[2:]) and torch.equal(one.audio_mask, clip_mask[2:])
    rows = collate_rows([one, none, two], seconds_key=OMNI_SECONDS_KEY, audio=True)
    assert torch.equal(rows["input_features"], torch.cat([features[2:], features[:2]]))
    assert torch.equal(rows["feature_attention_mask"], torch.cat([clip_mask[2:], clip_mask[:2]]))
    silent = collate_rows([none], audio=True)
    assert "input_features" not in silent and silent["feature_attention_mask"].shape[0] == 0
    assert collate_rows([], audio=True)["feature_attention_mask"].shape[0] == 0
    video = split_batch(_video_batch(2), 0, VSTART, IMG, MERGE)[0]
    seconds = collate_rows([video], seconds_key=OMNI_SECONDS_KEY, audio=True)[OMNI_SECONDS_KEY]
    assert torch.is_tensor(seconds) and seconds.tolist() == [0.5, 1.5]


def test_clip_frames_round_trip_through_the_index_and_batch_without_features() -> None:
    """Each clip's frame count is indexed, so ranks that only need the feature mask (the decoder's, with the audio
    encoder on a part of its own) rebuild it without reading a clip; a batch pads masks (and features where a rank
    has them) to its widest clip. A mask that is not right-padded is refused."""
    from mindspeed_flow.hosts.mindspeed_mm.data import FlowDataError, FlowSample, clip_frames, clip_mask, collate_rows
    from mindspeed_flow.hosts.mindspeed_mm.index import MetadataIndex, SampleMeta

    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    clips = clip_frames(mask, 0)
    assert clips.tolist() == [[3, 5], [5, 5]] and torch.equal(clip_mask(clips), mask)
    index = MetadataIndex.from_metas([SampleMeta(9, 0, 2, False, None, None, 6, clips),
                                      SampleMeta(3, 0, 2, False, None),
                                      SampleMeta(5, 0, 2, False, None, None, 2, torch.tensor([[2, 3]]))])
    assert index.meta(0).audio_tokens == 6 and torch.equal(clip_mask(index.meta(0).clips), mask)
    assert index.meta(1).clips is None and index.meta(2).clips.tolist() == [[2, 3]]
    a = FlowSample(0, torch.ones(9, dtype=torch.long), None, None, None, 0, audio_mask=clip_mask(index.meta(0).clips))
    b = FlowSample(1, torch.ones(5, dtype=torch.long), None, None, None, 0, audio_mask=clip_mask(index.meta(2).clips))
    rows = collate_rows([b, a], audio=True)
    assert "input_features" not in rows
    assert rows["feature_attention_mask"].tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    b.audio_features, a.audio_features = torch.ones(1, 2, 3), torch.ones(2, 2, 5)
    assert collate_rows([b, a], audio=True)["input_features"].shape == (3, 2, 5)
    with pytest.raises(FlowDataError, match="not right-padded"):
        clip_frames(torch.tensor([[0, 1, 1]]), 4)
