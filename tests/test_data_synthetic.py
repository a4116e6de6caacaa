"""SyntheticInfoVQA: determinism (also across processes), shapes == samples, InfoVQA-like statistics, learnability."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mindspeed_flow.data.content import NUM_CLASSES, answer_ids
from mindspeed_flow.data.image import CLIP_MEAN, CLIP_STD
from mindspeed_flow.data.sample import IGNORE_INDEX, VLMSample
from mindspeed_flow.data.synthetic import SyntheticInfoVQA, SyntheticParams
from mindspeed_flow.data.tokens import token_spec_from_hf_config
from mindspeed_flow.model_presets import hf_config_dict
from mindspeed_flow.utils.multiproc import run_ranks

TINY_DEMO = dict(min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28)
QWEN2_VL_MAX_PIXELS = 12845056  # preprocessor_config.json of the released Qwen2-VL checkpoints
QWEN2_VL_COMMON_MAX_PIXELS = 1280 * 28 * 28


def _spec(family: str = "qwen2_vl"):
    return token_spec_from_hf_config(hf_config_dict(family, "tiny"))


def _digest(s: VLMSample) -> str:
    h = hashlib.sha256()
    for t in (s.input_ids, s.labels, s.pixel_values, s.image_grid_thw):
        if t is not None:
            h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def _digests_on_rank(rank: int, world_size: int, ids: list[int]) -> list[str]:
    ds = SyntheticInfoVQA(SyntheticParams(num_samples=64, seed=7, text_only_fraction=0.2, **TINY_DEMO), _spec())
    order = ids if rank == 0 else list(reversed(ids))  # a different access order must not matter
    got = {i: _digest(ds.sample(i)) for i in order}
    return [got[i] for i in ids]


def test_same_sample_twice_and_across_processes() -> None:
    ids = [0, 3, 17, 42, 63]
    ds = SyntheticInfoVQA(SyntheticParams(num_samples=64, seed=7, text_only_fraction=0.2, **TINY_DEMO), _spec())
    here = [_digest(ds.sample(i)) for i in ids]
    assert here == [_digest(ds.sample(i)) for i in ids]
    assert len(set(here)) == len(ids)
    assert run_ranks(_digests_on_rank, 2, ids, timeout_s=60) == [here, here]
    other_seed = SyntheticInfoVQA(SyntheticParams(num_samples=64, seed=8, text_only_fraction=0.2, **TINY_DEMO), _spec())
    assert [_digest(other_seed.sample(i)) for i in ids] != here


_FRESH_INTERPRETER = """
import json, sys
sys.path.insert(0, {tests!r})
from test_data_synthetic import _digests_on_rank
print(json.dumps(_digests_on_rank(1, 1, {ids!r})))
"""


def test_same_samples_in_a_fresh_interpreter() -> None:
    """Not a fork: another interpreter, another PYTHONHASHSEED, reversed access order."""
    ids = [0, 5, 63]
    code = _FRESH_INTERPRETER.format(tests=str(Path(__file__).parent), ids=ids)
    env = {**os.environ, "PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         cwd=str(Path(__file__).parents[1]))
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == _digests_on_rank(0, 1, ids)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava"])
def test_shape_matches_sample_for_every_index(family: str) -> None:
    spec = _spec(family)
    ds = SyntheticInfoVQA(SyntheticParams(num_samples=48, seed=3, text_only_fraction=0.25, **TINY_DEMO), spec)
    n_text_only = 0
    for i in range(len(ds)):
        full, light = ds.sample(i), ds.sample(i, with_pixels=False)
        shape = ds.shape(i)
        assert full.shape(spec.merge_size) == shape == light.shape(spec.merge_size)
        assert shape.sample_id == i
        assert torch.equal(full.input_ids, light.input_ids) and torch.equal(full.labels, light.labels)
        assert light.pixel_values is None
        if not shape.num_images:
            n_text_only += 1
            assert full.pixel_values is None and full.image_grid_thw is None
            continue
        assert int((full.input_ids == spec.image_token_id).sum()) == shape.image_tokens
        if spec.image_format == "qwen2":
            assert tuple(full.pixel_values.shape) == (shape.vit_patches, 3 * 2 * 14 * 14)
        else:
            assert tuple(full.pixel_values.shape) == (1, 3, 56, 56) and shape.image_tokens == 16
        assert full.label_tokens > 0 and int(full.labels[-1]) == spec.eos_id
    assert 0 < n_text_only < len(ds)


def test_text_ids_stay_below_the_special_ids_of_a_real_vocabulary() -> None:
    spec = token_spec_from_hf_config(hf_config_dict("qwen2_vl", "7b"))  # specials 151645.., vocab 152064
    ds = SyntheticInfoVQA(SyntheticParams(num_samples=32, seed=0, text_only_fraction=0.3, **TINY_DEMO), spec)
    specials = {spec.image_token_id, spec.vision_start_id, spec.vision_end_id, spec.eos_id}
    seen_high = False
    for i in range(len(ds)):
        s = ds.sample(i, with_pixels=False)
        ordinary = [t for t in s.input_ids.tolist() if t not in specials]
        assert all(0 <= t < spec.first_special_id for t in ordinary)
        seen_high |= max(ordinary) > 1000  # questions span the whole ordinary range, not a tiny corner of it
        assert s.input_ids.tolist().count(spec.vision_start_id) == s.shape().num_images
    assert seen_high


def test_infovqa_like_statistics_at_full_resolution() -> None:
    spec = _spec()
    n = 1500
    ds = SyntheticInfoVQA(SyntheticParams(num_samples=n, seed=1, min_pixels=3136, max_pixels=QWEN2_VL_MAX_PIXELS),
                          spec)
    shapes = ds.shapes()
    image = sum(s.image_tokens for s in shapes)
    total = sum(s.llm_tokens for s in shapes)
    assert image / total > 0.9
    sizes = np.array([ds.original_size(i) for i in range(n)])  # (height, width)
    heights, widths = sizes[:, 0], sizes[:, 1]
    assert 600 <= widths.min() and widths.max() <= 6250 and heights.max() <= 9400
    assert 800 <= np.median(widths) <= 1250 and 2400 <= np.median(heights) <= 3600  # "typically 1000 x 3000"
    assert np.mean(heights > widths) > 0.9  # tall infographics
    turns = [ds._plan(i).turns for i in range(200)]
    assert 5.0 <= np.mean([len(t) for t in turns]) <= 6.0 and min(len(t) for t in turns) >= 1
    assert all(10 <= len(q) <= 20 and 1 <= len(a) <= 5 for ts in turns for q, a in ts)
    # At the cap most deployments use (1280 tokens per image) the set is still over 90% image tokens.
    capped = SyntheticInfoVQA(SyntheticParams(num_samples=n, seed=1, max_pixels=QWEN2_VL_COMMON_MAX_PIXELS), spec)
    shapes = capped.shapes()
    assert sum(s.image_tokens for s in shapes) / sum(s.llm_tokens for s in shapes) > 0.9
    assert max(s.image_tokens for s in shapes) <= 1280


def _class_from_pixels(pixels: torch.Tensor) -> int:
    """Read the hidden class back from the mean colour, the way a model could."""
    per_channel = pixels.view(pixels.shape[0], 3, -1).mean(dim=(0, 2))
    rgb = per_channel * torch.tensor(CLIP_STD) + torch.tensor(CLIP_MEAN)
    return sum(1 << c for c in range(3) if rgb[c] > 0.5)


def test_answers_are_a_function_of_the_image_and_question() -> None:
    spec = _spec()
    ds = SyntheticInfoVQA(SyntheticParams(num_samples=64, seed=5, **TINY_DEMO), spec)
    classes = set()
    for i in range(len(ds)):
        s = ds.sample(i)
        klass = _class_from_pixels(s.pixel_values)
        classes.add(klass)
        ids, labels = s.input_ids.tolist(), s.labels.tolist()
        # Walk the turns: a question is the unlabeled run before each labeled answer + eos.
        pos = ids.index(spec.vision_end_id) + 1
        while pos < len(ids):
            q_start = pos
            while labels[pos] == IGNORE_INDEX:
                pos += 1
            end = labels.index(spec.eos_id, pos)
            question, answer = ids[q_start:pos], ids[pos:end]
            assert tuple(answer) == answer_ids(klass, question, len(answer), spec), i
            pos = end + 1
    assert len(classes) == NUM_CLASSES  # the signal is there and varied, not a constant


def test_shapes_are_planned_without_rendering(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank plans from shapes, so shape() must stay cheap: it draws the plan, never pixels or token ids."""
    import mindspeed_flow.data.synthetic as synthetic

    ds = SyntheticInfoVQA(SyntheticParams(num_samples=4096, seed=0, **TINY_DEMO), _spec())
    rendered = []
    real_render = synthetic.render_sample
    monkeypatch.setattr(synthetic, "render_sample", lambda *a, **k: rendered.append(a) or real_render(*a, **k))
    shapes = [ds.shape(i) for i in range(4096)]
    assert rendered == []
    assert all(ds.shape(i) is shapes[i] for i in range(0, 4096, 97))  # planned once, then cached
    for i in range(16):  # and the shape is the rendered sample's
        sample = ds.sample(i)
        assert shapes[i].llm_tokens == sample.llm_tokens, i
    assert len(rendered) == 16


def test_invalid_parameters_name_the_field() -> None:
    with pytest.raises(ValueError, match="data.max_pixels"):
        SyntheticParams(min_pixels=1000, max_pixels=10)
    with pytest.raises(ValueError, match="data.question_tokens"):
        SyntheticParams(question_tokens=(20, 10))
    with pytest.raises(ValueError, match="data.answer_tokens"):
        SyntheticParams(answer_tokens=(0, 3))
    with pytest.raises(ValueError, match="data.text_only_fraction"):
        SyntheticParams(text_only_fraction=1.5)
    with pytest.raises(ValueError, match="data.seed"):
        SyntheticParams(seed=-1)
    ds = SyntheticInfoVQA(SyntheticParams(num_samples=4), _spec())
    with pytest.raises(IndexError, match="out of range"):
        ds.shape(4)
