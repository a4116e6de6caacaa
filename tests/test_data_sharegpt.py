"""ShareGPT/LLaVA JSON reader on a real folder of PIL-written images, with broken entries skipped and counted."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mindspeed_flow.data.guard import BadSample, SampleGuard, TooManyBadSamples
from mindspeed_flow.data.length_table import export_length_table
from mindspeed_flow.data.records import DataError
from mindspeed_flow.data.prefetch import Prefetcher
from mindspeed_flow.data.sampler import iter_global_batches
from mindspeed_flow.data.sharegpt import ShareGPTDataset
from mindspeed_flow.data.tokens import load_local_tokenizer, token_spec_from_hf_config
from mindspeed_flow.model_presets import hf_config_dict
from mindspeed_flow.utils.multiproc import run_ranks

Image = pytest.importorskip("PIL.Image")

SPEC = token_spec_from_hf_config(hf_config_dict("qwen2_vl", "tiny"))
LIMITS = dict(min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28)
GOOD = [0, 1, 5, 6]
BAD_CAUSES = {  # index -> a fragment the recorded cause must contain
    2: "truncated",
    3: "not found",
    4: "conversations",
    7: "cannot be read",
    8: "tag",
    9: "not an object",
    10: "videos",
}


def _noise_image(rng: np.random.Generator, h: int, w: int) -> "Image.Image":
    return Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))


def _conv(*turns: str) -> list[dict]:
    return [{"from": "human" if k % 2 == 0 else "gpt", "value": t} for k, t in enumerate(turns)]


def make_folder(root: Path) -> Path:
    """A ShareGPT folder: good PNG/JPEG images, a truncated JPEG, a garbage file, and broken entries."""
    rng = np.random.default_rng(0)
    img_dir = root / "images"
    img_dir.mkdir(parents=True)
    _noise_image(rng, 300, 120).save(img_dir / "a.png")
    _noise_image(rng, 200, 640).save(img_dir / "b.jpg", quality=90)
    _noise_image(rng, 40, 50).save(img_dir / "c.png")
    _noise_image(rng, 480, 640).save(img_dir / "full.jpg", quality=90)
    data = (img_dir / "full.jpg").read_bytes()
    (img_dir / "trunc.jpg").write_bytes(data[: len(data) * 6 // 10])  # header intact, scan data cut
    (img_dir / "garbage.png").write_bytes(b"definitely not a PNG file" * 20)
    entries = [
        {"id": "a", "image": "images/a.png", "conversations": _conv("<image>\nWhat is shown?", "A chart.")},
        {"id": "b", "images": ["images/b.jpg", "images/c.png"],
         "conversations": _conv("<image><image>Compare.", "Same.", "Why?", "Colours.")},
        {"id": "trunc", "image": "images/trunc.jpg", "conversations": _conv("<image>Q?", "A.")},
        {"id": "missing", "image": "images/nope.png", "conversations": _conv("<image>Q?", "A.")},
        {"id": "malformed", "image": "images/a.png"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image>Q?"},
                      {"role": "assistant", "content": "A."}], "images": ["images/c.png"]},
        {"id": "text", "conversations": _conv("Hello", "Hi")},
        {"id": "garbage", "image": "images/garbage.png", "conversations": _conv("<image>Q?", "A.")},
        {"id": "tags", "image": "images/a.png", "conversations": _conv("<image><image>Q?", "A.")},
        "not a dict",
        {"id": "video", "video": "clip.mp4", "conversations": _conv("<video>Q?", "A.")},
    ]
    path = root / "data.json"
    path.write_text(json.dumps(entries))
    return path


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    return make_folder(tmp_path)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def test_good_entries_tokens_pixels_and_shapes(folder: Path) -> None:
    proc_mod = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    ds = ShareGPTDataset(str(folder), SPEC, **LIMITS)
    assert len(ds) == 11 and ds.record_id(0) == "a" and ds.record_id(5) == 5
    for i in GOOD:
        s = ds.sample(i)
        assert s.shape(SPEC.merge_size) == ds.shape(i) == ds.sample(i, with_pixels=False).shape(SPEC.merge_size)
    a = ds.sample(0)
    end = a.input_ids.tolist().index(SPEC.vision_end_id) + 1
    assert a.input_ids[end:].tolist() == _bytes("What is shown?") + _bytes("A chart.") + [SPEC.eos_id]
    assert a.labels[end:].tolist() == [-100] * len("What is shown?") + _bytes("A chart.") + [SPEC.eos_id]
    # Two images: pixels are the HF processor's, concatenated in order; two vision blocks before the text.
    b = ds.sample(1)
    hf = proc_mod.Qwen2VLImageProcessorPil(**LIMITS)
    ref = hf(images=[Image.open(folder.parent / "images" / n) for n in ("b.jpg", "c.png")], return_tensors="np")
    np.testing.assert_allclose(b.pixel_values.numpy(), ref["pixel_values"], rtol=0, atol=1e-5)
    assert b.image_grid_thw.tolist() == ref["image_grid_thw"].tolist()
    assert int((b.input_ids == SPEC.vision_start_id).sum()) == 2 and b.label_tokens == len("Same.Colours.") + 2
    # messages format + system prompt (before the first question, unlabeled)
    m = ds.sample(5)
    end = m.input_ids.tolist().index(SPEC.vision_end_id) + 1
    assert m.input_ids[end:].tolist() == _bytes("Be brief.\nQ?") + _bytes("A.") + [SPEC.eos_id]
    t = ds.sample(6)
    assert t.pixel_values is None and t.image_grid_thw is None and t.image_token_counts == []


def test_llava_format_from_the_same_folder(folder: Path) -> None:
    spec = token_spec_from_hf_config(hf_config_dict("llava", "tiny"))
    ds = ShareGPTDataset(str(folder), spec)
    s = ds.sample(1)
    assert tuple(s.pixel_values.shape) == (2, 3, 56, 56) and s.image_token_counts == [16, 16]
    assert s.shape(spec.merge_size) == ds.shape(1)


def test_bad_entries_are_skipped_and_counted_with_cause(folder: Path) -> None:
    ds = ShareGPTDataset(str(folder), SPEC, **LIMITS)
    guard = SampleGuard(max_bad=len(BAD_CAUSES))
    good = [i for i in range(len(ds)) if guard.shape(ds, i) is not None]
    assert good == GOOD
    assert sorted(guard.bad) == sorted(BAD_CAUSES)
    for i, fragment in BAD_CAUSES.items():
        assert fragment in guard.bad[i], (i, guard.bad[i])
    # Met again (a later epoch): not counted twice, and the dataset's verdict does not flip.
    assert guard.shape(ds, 2) is None and guard.num_bad == len(BAD_CAUSES)
    with pytest.raises(BadSample, match="truncated"):
        ds.shape(2)


def test_threshold_raises_listing_ids_and_causes(folder: Path) -> None:
    ds = ShareGPTDataset(str(folder), SPEC, **LIMITS)
    guard = SampleGuard(max_bad=3)
    with pytest.raises(TooManyBadSamples) as info:
        for i in range(len(ds)):
            guard.shape(ds, i)
    msg = str(info.value)
    assert "data.max_bad_samples=3" in msg and sorted(info.value.bad) == [2, 3, 4, 7]
    for i in (2, 3, 4, 7):
        assert f"sample {i}: " in msg
    assert "nope.png" in msg and "truncated" in msg


def _batches_on_rank(rank: int, world_size: int, path: str) -> tuple[list[list[int]], dict[int, str]]:
    ds = ShareGPTDataset(path, SPEC, **LIMITS)
    sampler = iter_global_batches(ds, 2, seed=11, max_bad=10)
    return [next(sampler) for _ in range(6)], sampler.guard.bad


def test_every_rank_skips_the_same_samples(folder: Path) -> None:
    results = run_ranks(_batches_on_rank, 2, str(folder), timeout_s=60)
    assert results[0] == results[1]
    batches, bad = results[0]
    assert sorted(bad) == sorted(BAD_CAUSES)
    for epoch in range(3):  # 4 good samples, batch 2: each epoch is two batches covering all good ids
        assert sorted(batches[2 * epoch] + batches[2 * epoch + 1]) == GOOD


def test_header_only_mode_fails_loudly_at_load_time(folder: Path) -> None:
    ds = ShareGPTDataset(str(folder), SPEC, verify_images=False, **LIMITS)
    assert ds.shape(2).num_images == 1  # the header of the truncated JPEG is fine
    with pytest.raises(BadSample, match="after its shape was planned"):
        ds.sample(2)
    with Prefetcher(lambda i: ds.sample(i), [0, 2, 1], depth=2) as loader:
        assert next(loader).sample_id == 0
        with pytest.raises(BadSample, match="truncated"):  # re-raised unchanged in the consumer
            next(loader)


def test_jsonl_bad_line_bad_tokenizer_and_file_errors(tmp_path: Path) -> None:
    lines = [json.dumps({"conversations": _conv("Hi", "Yo")}), "{not json",
             json.dumps({"conversations": _conv("a", "b")})]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    ds = ShareGPTDataset(str(path), SPEC)
    assert len(ds) == 3 and ds.shape(0).text_tokens == 2 + 2 + 1
    with pytest.raises(BadSample, match="line 2 .* not valid JSON"):
        ds.shape(1)
    bad_tok = ShareGPTDataset(str(path), SPEC, tokenizer=lambda text: [SPEC.image_token_id])
    with pytest.raises(BadSample, match="token id 380"):
        bad_tok.shape(0)
    (tmp_path / "obj.json").write_text("{}")
    with pytest.raises(DataError, match="obj.json: the top level is a JSON dict; it must be a list of records"):
        ShareGPTDataset(str(tmp_path / "obj.json"), SPEC)
    with pytest.raises(DataError, match="data.path=.*nothing.json' does not exist"):
        ShareGPTDataset(str(tmp_path / "nothing.json"), SPEC)
    (tmp_path / "latin1.json").write_bytes('[{"id": "caf\u00e9"}]'.encode("latin-1"))
    with pytest.raises(DataError, match="latin1.json, line 1 column 13: byte 0xe9 is not UTF-8"):
        ShareGPTDataset(str(tmp_path / "latin1.json"), SPEC)


def test_shape_table_validates_once_and_plans_without_images(folder: Path, tmp_path: Path) -> None:
    table = tmp_path / "good_shapes.csv"
    skipped = export_length_table(ShareGPTDataset(str(folder), SPEC, **LIMITS), table)
    assert sorted(skipped) == sorted(BAD_CAUSES)
    full = ShareGPTDataset(str(folder), SPEC, **LIMITS)
    (folder.parent / "images" / "a.png").rename(folder.parent / "images" / "moved.png")  # after validation
    fast = ShareGPTDataset(str(folder), SPEC, shape_table=str(table), **LIMITS)
    for i in GOOD:
        assert fast.shape(i) == ShareGPTDataset(str(folder), SPEC, shape_table=str(table), **LIMITS).shape(i)
    assert fast.shape(0).num_images == 1  # planned from the table: the moved file is not even opened
    with pytest.raises(BadSample, match="after its shape was planned"):
        fast.sample(0)
    assert fast.sample(1).shape(SPEC.merge_size) == fast.shape(1)
    with pytest.raises(BadSample, match="not in the shape table"):
        fast.shape(2)
    stale = ShareGPTDataset(str(folder), SPEC, shape_table=str(table), tokenizer=lambda t: [1] * (len(t) + 1))
    with pytest.raises(BadSample, match="stale table, or another tokenizer"):
        stale.shape(1)
    with pytest.raises(BadSample, match="not found"):
        full.shape(0)


def test_local_hf_tokenizer_with_the_reader(folder: Path, tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[BOS]": 1, "what": 2, "is": 3, "shown": 4, "?": 5, "a": 6, "chart": 7, ".": 8}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.normalizer = tokenizers.normalizers.Lowercase()
    core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", bos_token="[BOS]")
    fast.save_pretrained(str(tmp_path / "ckpt"))
    expected = [2, 3, 4, 5, 6, 7, 8, SPEC.eos_id]
    for tokenizer in (load_local_tokenizer(str(tmp_path / "ckpt")), fast):  # a callable, or the tokenizer itself
        s = ShareGPTDataset(str(folder), SPEC, tokenizer=tokenizer, **LIMITS).sample(0, with_pixels=False)
        end = s.input_ids.tolist().index(SPEC.vision_end_id) + 1
        assert s.input_ids[end:].tolist() == expected
    with pytest.raises(FileNotFoundError, match="model.pretrained_path"):
        load_local_tokenizer(str(tmp_path / "no_such_checkpoint"))


class _Exploding:
    """A dataset whose shape() fails with a system error: the guard must not count it."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __len__(self) -> int:
        return 4

    def shape(self, i: int):
        raise self.exc


@pytest.mark.parametrize("exc", [MemoryError(), KeyboardInterrupt(), RecursionError("deep")])
def test_system_errors_are_never_swallowed(exc: BaseException) -> None:
    guard = SampleGuard(max_bad=100)
    with pytest.raises(type(exc)):
        guard.shape(_Exploding(exc), 0)
    assert guard.num_bad == 0


def test_ordinary_errors_in_a_reader_are_counted() -> None:
    guard = SampleGuard(max_bad=100)
    assert guard.shape(_Exploding(ZeroDivisionError("boom")), 1) is None
    assert guard.bad == {1: "ZeroDivisionError: boom"}
    state = guard.state_dict()
    fresh = SampleGuard(max_bad=100)
    fresh.load_state_dict(json.loads(json.dumps(state)))  # checkpoint-friendly (JSON keys are strings)
    assert fresh.bad == guard.bad


def test_malformed_jsonl_line_is_named_by_its_record_id_and_skips_state_the_limit(tmp_path: Path, capsys) -> None:
    """Issue 25 item 8: a malformed .jsonl line was reported as "id 1" (its index, as if a record id); a skip line
    did not say when the job stops. The id the line still shows names it; a line with none is named by its line
    number only; each skip line states data.max_bad_samples and data.max_bad_fraction."""
    lines = [json.dumps({"id": "a", "conversations": _conv("Hi", "Yo")}),
             '{"id": "rec-7", "conversations": [{"from": "human" "value": "x"}]}',  # a missing comma
             '{"conversations": [',
             json.dumps({"id": "d", "conversations": _conv("a", "b")})]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    ds = ShareGPTDataset(str(path), SPEC)
    guard = SampleGuard(max_bad=5, max_bad_fraction=0.5, log_skips=True)
    assert guard.shape(ds, 1) is None and guard.shape(ds, 2) is None
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2, out
    assert f"skipped bad sample 1 (id 'rec-7', {path}): line 2 of" in out[0], out[0]
    assert f"skipped bad sample 2 ({path}): line 3 of" in out[1], out[1]
    for x in out:
        assert "the job stops above data.max_bad_samples=5 or above data.max_bad_fraction=0.5" in x, x
