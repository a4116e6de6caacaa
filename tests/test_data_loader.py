"""Global-batch sampler (determinism, skipping, resume), prefetcher, length tables, build_dataset and data recipes."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from mindspeed_flow.config.schema import DataConfig
from mindspeed_flow.data.build import build_dataset
from mindspeed_flow.data.guard import BadSample, TooManyBadSamples
from mindspeed_flow.data.length_table import LengthTableDataset, export_length_table, split_text_tokens
from mindspeed_flow.data.prefetch import Prefetcher, prefetch_samples
from mindspeed_flow.data.sampler import iter_global_batches
from mindspeed_flow.data.shapes import SampleShape, read_length_table, write_length_table
from mindspeed_flow.data.synthetic import SyntheticInfoVQA, SyntheticParams
from mindspeed_flow.data.tokens import token_spec_from_hf_config
from mindspeed_flow.model_presets import hf_config_dict
from mindspeed_flow.utils.multiproc import run_ranks

QWEN = token_spec_from_hf_config(hf_config_dict("qwen2_vl", "tiny"))
LLAVA = token_spec_from_hf_config(hf_config_dict("llava", "tiny"))
RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "data"


class _WithBad:
    """A real synthetic set whose listed ids raise BadSample from shape(), as a broken file would."""

    def __init__(self, n: int, bad: set[int]) -> None:
        self.inner = SyntheticInfoVQA(SyntheticParams(num_samples=n, seed=2), QWEN)
        self.bad = bad

    def __len__(self) -> int:
        return len(self.inner)

    def shape(self, i: int) -> SampleShape:
        if i in self.bad:
            raise BadSample(i, f"image of sample {i} is corrupt")
        return self.inner.shape(i)


# ---- sampler -----------------------------------------------------------------------------------------------------
def test_batches_are_seeded_disjoint_and_cover_each_epoch() -> None:
    ds = SyntheticInfoVQA(SyntheticParams(num_samples=40), QWEN)
    a = iter_global_batches(ds, 8, seed=3)
    b = iter_global_batches(ds, 8, seed=3)
    first = [next(a) for _ in range(10)]
    assert first == [next(b) for _ in range(10)]
    for epoch in range(2):
        ids = [i for batch in first[5 * epoch: 5 * epoch + 5] for i in batch]
        assert sorted(ids) == list(range(40))
    assert first[:5] != first[5:]  # a new permutation per epoch
    assert [next(iter_global_batches(ds, 8, seed=4)) for _ in range(1)] != first[:1]
    with pytest.raises(ValueError, match="global_batch_size"):
        iter_global_batches(ds, 0, seed=3)


def test_bad_samples_are_skipped_and_the_incomplete_tail_dropped() -> None:
    ds = _WithBad(30, {1, 5, 9})
    sampler = iter_global_batches(ds, 8, seed=0, max_bad=3)
    epoch0 = [next(sampler) for _ in range(3)]  # 27 good samples: 3 full batches, 3 left over and dropped
    assert sampler.epoch == 0
    ids = [i for b in epoch0 for i in b]
    assert len(set(ids)) == 24 and not set(ids) & {1, 5, 9}
    nxt = next(sampler)
    assert sampler.epoch == 1 and not set(nxt) & {1, 5, 9}
    assert sampler.guard.bad == {i: f"image of sample {i} is corrupt" for i in (1, 5, 9)}
    strict = iter_global_batches(_WithBad(30, {1, 5, 9}), 8, seed=0, max_bad=2)
    with pytest.raises(TooManyBadSamples, match="sample 5: image of sample 5 is corrupt"):
        for _ in range(4):  # the third bad sample is met within the first epoch
            next(strict)
    with pytest.raises(ValueError, match="fewer than trainer.global_batch_size"):
        next(iter_global_batches(_WithBad(10, {0, 1, 2}), 8, seed=0, max_bad=5))


@pytest.mark.parametrize("stop_after", [0, 1, 4, 7])
def test_resume_from_state_dict_continues_exactly(stop_after: int) -> None:
    ds = _WithBad(30, {4, 20})
    reference = iter_global_batches(ds, 7, seed=9, max_bad=5)
    expected = [next(reference) for _ in range(12)]  # crosses several epoch boundaries
    interrupted = iter_global_batches(ds, 7, seed=9, max_bad=5)
    for _ in range(stop_after):
        next(interrupted)
    state = interrupted.state_dict()
    resumed = iter_global_batches(_WithBad(30, {4, 20}), 7, seed=9, max_bad=5)
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(12 - stop_after)] == expected[stop_after:]
    assert resumed.batches_yielded == 12
    with pytest.raises(ValueError, match="trainer.global_batch_size=8 but the checkpoint was saved with trainer.global_batch_size=7"):
        iter_global_batches(ds, 8, seed=9).load_state_dict(state)


def _batches_on_rank(rank: int, world_size: int) -> list[list[int]]:
    sampler = iter_global_batches(_WithBad(50, {3, 17, 33}), 16, seed=5, max_bad=3)
    return [next(sampler) for _ in range(6)]


def test_all_ranks_draw_the_same_batches() -> None:
    results = run_ranks(_batches_on_rank, 3, timeout_s=60)
    assert results[0] == results[1] == results[2]


# ---- prefetcher --------------------------------------------------------------------------------------------------
def test_prefetcher_keeps_order_and_runs_ahead_bounded() -> None:
    depth = 3
    cond = threading.Condition()
    calls: list[tuple[int, int]] = []  # (item, items the consumer had started to take when fn(item) began)
    taking = 0

    def fn(i: int) -> int:
        with cond:
            calls.append((i, taking))
            cond.notify_all()
        return i * i

    with Prefetcher(fn, range(20), depth=depth) as loader:
        out = []
        for _ in range(20):
            with cond:
                taking += 1
            out.append(next(loader))
            if len(out) == 1:  # hold item 0 until the loader has worked ahead to its bound
                with cond:
                    cond.wait_for(lambda: len(calls) >= 1 + depth + 1)
        assert out == [i * i for i in range(20)]
    # Work-ahead is bounded by depth (queued) plus the one being computed, whatever the threads' timing: fn(i)
    # can only start once item i - depth - 1 has left the queue, which the consumer started to take before.
    assert [i for i, _ in calls] == list(range(20))
    assert all(i <= started + depth for i, started in calls), calls
    assert any(i == started + depth for i, started in calls)  # and it does work ahead that far


def test_prefetcher_reraises_at_the_failing_item_and_close_stops_the_thread() -> None:
    def fn(i: int) -> int:
        if i == 3:
            raise ValueError("decode failed")
        return i

    loader = Prefetcher(fn, range(10), depth=2)
    assert [next(loader) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="decode failed") as info:
        next(loader)
    assert any("item 3" in note for note in getattr(info.value, "__notes__", ["item 3"]))
    with pytest.raises(StopIteration):
        next(loader)
    loader.close()
    early = Prefetcher(lambda i: i, range(10**9), depth=2)  # the consumer stops early: close must not hang
    assert next(early) == 0
    early.close()
    assert not early._thread.is_alive()
    with pytest.raises(ValueError, match="depth"):
        Prefetcher(lambda i: i, [], depth=0)


def test_prefetch_samples_loads_a_dataset_in_order() -> None:
    ds = SyntheticInfoVQA(SyntheticParams(num_samples=20), QWEN)
    ids = [7, 3, 11, 0]
    with prefetch_samples(ds, ids, with_pixels=False, depth=2) as loader:
        got = list(loader)
    assert [s.sample_id for s in got] == ids and all(s.pixel_values is None for s in got)
    with prefetch_samples(ds, ids[:1]) as loader:
        assert next(loader).pixel_values is not None


def test_prefetcher_times_out_naming_the_thread() -> None:
    gate = threading.Event()
    loader = Prefetcher(lambda i: gate.wait(10), [0], depth=1, timeout_s=0.1)
    with pytest.raises(TimeoutError, match="no sample arrived within 0.1s"):
        next(loader)
    gate.set()
    loader.close()


# ---- length tables -----------------------------------------------------------------------------------------------
def test_length_table_round_trip(tmp_path: Path) -> None:
    src = SyntheticInfoVQA(SyntheticParams(num_samples=60, seed=4, text_only_fraction=0.2), QWEN)
    path = tmp_path / "lengths.csv"
    assert export_length_table(src, path) == {}
    replay = LengthTableDataset(path, QWEN, seed=1)
    assert len(replay) == 60
    for i in range(60):
        assert replay.shape(i) == src.shape(i)
        s = replay.sample(i)
        assert s.shape(QWEN.merge_size) == replay.shape(i) == replay.sample(i, with_pixels=False).shape(QWEN.merge_size)
    again = tmp_path / "again.csv"
    export_length_table(replay, again)
    assert again.read_text() == path.read_text()


def test_length_table_replays_foreign_rows_and_flags_impossible_ones(tmp_path: Path) -> None:
    rows = [SampleShape(100, 37, ((1, 36, 52), (1, 20, 20))), SampleShape(7, 120, ()),
            SampleShape(8, 1, ((1, 4, 4),)), SampleShape(9, 5, ((2, 8, 6),)), SampleShape(10, 3, ((1, 5, 4),)),
            SampleShape(11, 2, ((1, 4, 4),))]
    path = tmp_path / "foreign.csv"
    write_length_table(path, rows)
    ds = LengthTableDataset(path, QWEN)
    assert ds.source_id(0) == 100 and ds.shape(0).sample_id == 0
    for i in (0, 1, 3, 5):
        assert ds.sample(i).shape(QWEN.merge_size) == ds.shape(i)
    video = ds.sample(3)
    assert tuple(video.pixel_values.shape) == (96, 1176) and video.image_grid_thw.tolist() == [[2, 8, 6]]
    with pytest.raises(BadSample, match="row 4 .*text_tokens 1 < 2 per image"):
        ds.shape(2)
    with pytest.raises(BadSample, match="not a multiple of merge_size 2"):
        ds.shape(4)
    llava = LengthTableDataset(path, LLAVA)
    with pytest.raises(BadSample, match="must be 1x4x4"):
        llava.shape(0)
    assert llava.sample(5).shape(1) == llava.shape(5)
    for remaining in range(0, 60):
        turns = split_text_tokens(np.random.default_rng(remaining), remaining, (10, 20), (1, 5))
        assert sum(q + a + 1 for q, a in turns) == remaining and all(q >= 0 and a >= 0 for q, a in turns)


# ---- build_dataset and recipes -----------------------------------------------------------------------------------
def test_build_dataset_for_each_source(tmp_path: Path) -> None:
    syn = build_dataset(DataConfig(num_samples=10), QWEN)
    assert isinstance(syn, SyntheticInfoVQA) and len(syn) == 10
    table = tmp_path / "t.csv"
    export_length_table(syn, table)
    replay = build_dataset(DataConfig(source="length_table", path=str(table)), QWEN)
    assert [replay.shape(i) for i in range(10)] == [syn.shape(i) for i in range(10)]
    (tmp_path / "d.json").write_text('[{"conversations": [{"from": "human", "value": "hi"}, '
                                     '{"from": "gpt", "value": "yo"}]}]')
    share = build_dataset(DataConfig(source="sharegpt", path=str(tmp_path / "d.json")), QWEN)
    assert share.shape(0).text_tokens == 2 + 2 + 1
    with pytest.raises(ValueError, match="data.source='webdataset' is unknown"):
        build_dataset(DataConfig(source="webdataset"), QWEN)
    with pytest.raises(ValueError, match="needs data.path"):
        build_dataset(DataConfig(source="sharegpt"), QWEN)
    with pytest.raises(FileNotFoundError, match="data.path='/nonexistent.csv'"):
        build_dataset(DataConfig(source="length_table", path="/nonexistent.csv"), QWEN)
    with pytest.raises(ValueError, match="data.max_bad_samples"):
        build_dataset(DataConfig(max_bad_samples=-1), QWEN)
    assert read_length_table(table)[0].sample_id == 0


def test_every_data_recipe_composes_and_builds(tmp_path: Path) -> None:
    from mindspeed_flow.config.load import compose, to_job_config

    table = tmp_path / "t.csv"
    write_length_table(table, [SampleShape(0, 30, ((1, 8, 8),)), SampleShape(1, 12, ())])
    (tmp_path / "d.json").write_text('[{"conversations": [{"from": "human", "value": "hi"}, '
                                     '{"from": "gpt", "value": "yo"}]}]')
    extra = {"sharegpt": [f"data.path={tmp_path / 'd.json'}"], "length_table": [f"data.path={table}"]}
    names = sorted(p.stem for p in RECIPES.glob("*.yaml"))
    assert {"infovqa_tiny", "infovqa_1280", "sharegpt", "length_table"} <= set(names)
    for name in names:
        first_line = (RECIPES / f"{name}.yaml").read_text().splitlines()[0]
        assert first_line.startswith("# mindspeed-flow ") and f"data={name}" in first_line, name
        if name.startswith("omni"):  # audio + image data reads the Omni thinker's config (audio ids, mel bins)
            from mindspeed_flow.config.load import model_hf_config
            from mindspeed_flow.data.tokens import token_spec_from_hf_config

            job = to_job_config(compose([f"data={name}", "model=tiny_qwen2_5_omni"]))
            hf = model_hf_config(job)
            ds = build_dataset(job.data, token_spec_from_hf_config(hf), hf_config=hf)
        else:
            job = to_job_config(compose([f"data={name}", *extra.get(name, [])]))
            ds = build_dataset(job.data, QWEN)
        assert ds.shape(0).llm_tokens > 0, name
    with pytest.raises(ValueError, match="needs data.path"):  # the recipe marks the path as required
        build_dataset(to_job_config(compose(["data=sharegpt"])).data, QWEN)
