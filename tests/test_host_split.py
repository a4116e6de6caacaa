"""The torch host's split is exact, and packed microbatches equal their unpacked samples."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mindspeed_flow.data.sample import IGNORE_INDEX
from mindspeed_flow.hosts.torch import build_vlm, hf_compat, split_vlm
from mindspeed_flow.hosts.torch.exactness import encode as _encode
from mindspeed_flow.hosts.torch.exactness import packed_vs_unpacked, split_vs_whole, tiny_model
from mindspeed_flow.hosts.torch.packed import shifted_labels
from mindspeed_flow.hosts.torch.split import token_loss_sum
from mindspeed_flow.hosts.torch.testing import make_samples
from mindspeed_flow.model_presets import hf_config_dict

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "llava", "qwen3_vl", "qwen3_vl_moe"]


def _model(family: str, attn: str = "sdpa", seed: int = 0):
    return tiny_model(family, attn, seed)


@pytest.mark.parametrize("family", FAMILIES)
def test_split_equals_whole_model_per_sample(family):
    """(a) encoder -> backbone gives the whole model's summed loss and identical gradients, sample by sample."""
    assert any(s.pixel_values is None for s in make_samples(family, 4))  # text-only sample included
    assert any(len(s.image_token_counts) == 2 for s in make_samples(family, 4))  # two-image sample included
    errors = split_vs_whole(family, n_samples=4)
    assert errors["loss_abs_diff"] == 0.0, errors
    assert errors["grad_max_abs_diff"] <= 1e-7, errors


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_loss_is_hf_own_loss(family):
    """Guard the label convention of the reference: HF's own mean loss x label count == our summed loss."""
    model = _model(family)
    for s in make_samples(family, 2):
        kwargs = hf_compat.whole_model_inputs(model, s.input_ids, s.pixel_values, s.image_grid_thw)
        summed = token_loss_sum(model(**kwargs).logits, shifted_labels(s.labels)[None])
        hf_mean = model(**kwargs, labels=s.labels[None]).loss
        n_labels = int((s.labels[1:] != IGNORE_INDEX).sum())
        assert torch.allclose(hf_mean * n_labels, summed, rtol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_split_partitions_parameters_without_copies(family):
    model = _model(family)
    encoder, backbone = split_vlm(model)
    enc = {id(p) for p in encoder.parameters()}
    bb = {id(p) for p in backbone.parameters()}
    everything = {id(p) for p in model.parameters()}
    assert enc and bb and not (enc & bb) and (enc | bb) == everything
    vision_names = {n for n, p in model.named_parameters() if id(p) in enc}
    assert all(("visual" in n) or ("vision_tower" in n) or ("multi_modal_projector" in n) for n in vision_names)
    if family.startswith("qwen3_vl"):  # the deepstack mergers belong to the encoder part
        assert any("deepstack_merger_list" in n for n in vision_names)
    # shared tensors: an in-place change through the part is seen by the whole model
    with torch.no_grad():
        backbone.norm.weight.add_(1.0)
    assert torch.equal(hf_compat.language_model(model).norm.weight, backbone.norm.weight)


@pytest.mark.parametrize("family,attn", [(f, "sdpa") for f in FAMILIES] + [("qwen2_vl", "eager"), ("llava", "eager")])
def test_packed_equals_sum_of_unpacked(family, attn):
    """(b) one packed microbatch (with a padding tail) == the sum of its samples' unpacked losses, same gradients."""
    errors = packed_vs_unpacked(family, attn, n_samples=4, pad=9)
    assert errors["loss_rel_diff"] <= 1e-6, errors
    assert errors["max_abs_rel"] <= 1e-6 and errors["global_rel"] <= 1e-6, errors


def test_packed_batch_layout():
    model = _model("llava")
    encoder, backbone = split_vlm(model)
    samples = make_samples("llava", 3)
    embeds = _encode(encoder, samples)
    budget = sum(s.llm_tokens for s in samples) + 9
    packed = backbone.pack(samples, embeds, budget)
    lens = [s.llm_tokens for s in samples]
    assert packed.input_ids.shape == (1, budget) and packed.pad_tokens == 9 and packed.seq_lens == lens
    assert packed.cu_seqlens.tolist() == [0, lens[0], lens[0] + lens[1], sum(lens), budget]
    assert packed.n_label_tokens == sum(int((s.labels[1:] != IGNORE_INDEX).sum()) for s in samples)
    assert (packed.labels[0, sum(lens):] == IGNORE_INDEX).all()
    # the last token of a sample never predicts the next sample's first token
    assert all(packed.labels[0, int(end) - 1] == IGNORE_INDEX for end in packed.cu_seqlens[1:])


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_samples_never_attend_to_each_other(family):
    model = _model(family)
    encoder, backbone = split_vlm(model)
    samples = make_samples(family, 3, seed=2)
    budget = sum(s.llm_tokens for s in samples) + 5

    def logits_of(batch):
        embeds = _encode(encoder, batch)
        packed = backbone.pack(batch, embeds, budget)
        hidden = backbone.run_layers(backbone.embed(packed, embeds), packed.position_ids, packed.segments,
                                     backbone.layers)
        return backbone.logits(hidden)[0], packed

    with torch.no_grad():
        base, packed = logits_of(samples)
        changed = [samples[0].__class__(**{**samples[0].__dict__})]
        changed[0].input_ids = samples[0].input_ids.clone()
        text = changed[0].input_ids < 370
        changed[0].input_ids[text] = (changed[0].input_ids[text] + 7) % 370
        if changed[0].pixel_values is not None:
            changed[0].pixel_values = changed[0].pixel_values + 1.0
        after, _ = logits_of(changed + samples[1:])
    first = samples[0].llm_tokens
    assert not torch.equal(after[:first], base[:first])  # the perturbation is real
    assert torch.equal(after[first:], base[first:])  # ... and invisible to every other sample and the padding

    # position ids restart per sample: each segment's positions equal that sample packed alone
    start = 0
    for s in samples:
        alone = backbone.pack([s], None, s.llm_tokens).position_ids
        assert torch.equal(packed.position_ids[..., start:start + s.llm_tokens], alone)
        start += s.llm_tokens
    assert int(packed.position_ids[..., start].max()) == 0  # padding tail restarts too


def test_mrope_positions_are_3d_and_image_aware():
    model = _model("qwen2_vl")
    _, backbone = split_vlm(model)
    s = make_samples("qwen2_vl", 1)[0]
    pos = backbone.pack([s], None, s.llm_tokens).position_ids
    assert pos.shape == (3, 1, s.llm_tokens)
    image = s.input_ids == hf_compat.image_token_id(model.config)
    assert not torch.equal(pos[1, 0, image], pos[2, 0, image])  # height and width differ inside the image


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_empty_microbatch_gives_zero_loss(family):
    model = _model(family)
    _, backbone = split_vlm(model)
    packed = backbone.pack([], [], token_budget=16)
    loss, n = backbone(packed, [])
    loss.backward()
    assert n == 0 and loss.item() == 0.0 and packed.input_ids.shape == (1, 16)
    assert all(p.grad is None or not p.grad.any() for p in backbone.parameters())


def test_dense_stage_input_equals_scatter():
    """The pipeline's stage-0 input path (dense image tensor + embed_dense) equals embed(): values and grads."""
    model = _model("qwen2_5_vl")
    encoder, backbone = split_vlm(model)
    samples = make_samples("qwen2_5_vl", 3, seed=3)
    budget = sum(s.llm_tokens for s in samples) + 3
    grads = []
    for use_dense in (False, True):
        embeds = [e.detach().requires_grad_() if e is not None else None for e in _encode(encoder, samples)]
        packed = backbone.pack(samples, embeds, budget)
        x = backbone.embed_dense(packed.input_ids, backbone.image_dense(packed, embeds)) if use_dense \
            else backbone.embed(packed, embeds)
        loss, _ = backbone(packed, inputs_embeds=x)
        loss.backward()
        grads.append([e.grad for e in embeds if e is not None] + [backbone.embed_tokens.weight.grad.clone()])
        model.zero_grad(set_to_none=True)
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_pack_errors_name_the_samples():
    model = _model("qwen2_vl")
    encoder, backbone = split_vlm(model)
    samples = make_samples("qwen2_vl", 2)
    with pytest.raises(ValueError, match=r"token_budget=10.*1000:"):
        backbone.pack(samples, None, token_budget=10)
    embeds = _encode(encoder, samples)
    with pytest.raises(ValueError, match=r"sample 1000: \d+ image placeholder tokens"):
        backbone.pack(samples, [embeds[0][:-1], embeds[1]], token_budget=200)
    packed = backbone.pack(samples, None, token_budget=200)
    with pytest.raises(ValueError, match="no image embeddings"):
        backbone(packed, None)
    broken = dataclasses.replace(samples[0], image_token_counts=[samples[0].image_token_counts[0] + 1])
    with pytest.raises(ValueError, match=r"sample 1000: \d+ image placeholder tokens in input_ids"):
        backbone.pack([broken], None, token_budget=200)
    grid = samples[0].image_grid_thw.clone()
    grid[0, 1] *= 2
    with pytest.raises(ValueError, match=r"sample 1000: image_grid_thw gives"):
        backbone.pack([dataclasses.replace(samples[0], image_grid_thw=grid)], None, token_budget=200)


def test_build_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = _model("llava", seed=5)
    assert torch.equal(torch.rand(1), before)
    b, c = _model("llava", seed=5), _model("llava", seed=6)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))
    with pytest.raises(ValueError, match="attn_implementation"):
        _model("llava", attn="flash_attention_2")


def test_pretrained_path_roundtrip(tmp_path):
    model = _model("qwen2_vl", seed=3)
    model.save_pretrained(tmp_path)
    loaded = build_vlm("qwen2_vl", {}, seed=0, pretrained_path=str(tmp_path))
    ref = dict(model.named_parameters())
    got = dict(loaded.named_parameters())
    assert ref.keys() == got.keys()
    for n in ref:
        assert torch.equal(ref[n], got[n]), n
    assert loaded.training
    with pytest.raises(FileNotFoundError, match="pretrained_path"):
        build_vlm("qwen2_vl", {}, seed=0, pretrained_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="model_type='qwen2_vl' but model.family='llava'"):
        build_vlm("llava", {}, seed=0, pretrained_path=str(tmp_path))


@pytest.mark.parametrize("family,overrides", [(f, {}) for f in FAMILIES] + [("llava", {"vision_feature_layer": -2})])
def test_every_trainable_parameter_gets_a_gradient(family, overrides):
    """DDP without find_unused_parameters needs it; parameters on no path to the loss are frozen by split_vlm."""
    model = build_vlm(family, hf_config_dict(family, "tiny", overrides), seed=0)
    encoder, backbone = split_vlm(model)
    samples = [s for s in make_samples(family, 3) if s.pixel_values is not None]
    embeds = _encode(encoder, samples)
    loss, _ = backbone(backbone.pack(samples, embeds, sum(s.llm_tokens for s in samples)), embeds)
    loss.backward()
    names = {id(p): n for n, p in model.named_parameters()}
    missing = [names[id(p)] for p in model.parameters() if p.requires_grad and p.grad is None]
    frozen = [names[id(p)] for p in model.parameters() if not p.requires_grad]
    assert missing == []
    if family == "llava":
        assert any("post_layernorm" in n for n in frozen)
        assert any("encoder.layers.1." in n for n in frozen) == ("vision_feature_layer" in overrides)
    else:
        assert frozen == []


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_presets_keep_the_token_contract(family):
    """vocab 384 with the special ids 380..383, rope sections that fit the head dim, LLaVA's 16 image tokens."""
    from mindspeed_flow.model_presets import tiny

    cfg = _model(family).config
    text = cfg.text_config
    assert text.vocab_size == tiny.TINY_VOCAB == 384
    assert hf_compat.image_token_id(cfg) == tiny.IMAGE_TOKEN_ID == 380
    assert (tiny.VISION_START_ID, tiny.VISION_END_ID, tiny.EOS_ID) == (381, 382, 383)
    assert text.eos_token_id == 383 and 0 <= text.bos_token_id < 384
    if family == "llava":
        vision = cfg.vision_config
        assert cfg.image_seq_length == (vision.image_size // vision.patch_size) ** 2
    else:
        assert cfg.vision_start_token_id == 381
        head_dim = text.hidden_size // text.num_attention_heads
        assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
        raw = hf_config_dict(family, "tiny")["text_config"]  # the 4.57 spelling agrees with the 5.x one
        assert raw["rope_scaling"]["mrope_section"] == raw["rope_parameters"]["mrope_section"]
        assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"]


@pytest.mark.parametrize("family", FAMILIES)
def test_encoder_batch_equals_one_image_per_forward(family):
    """Several samples' images in one encoder forward: the same embeddings and parameter gradients as one
    forward per sample (Qwen: concatenated patches with their grids; LLaVA: stacked images)."""
    model = _model(family)
    encoder, _ = split_vlm(model)
    samples = [s for s in make_samples(family, 6, seed=5) if s.pixel_values is not None]
    assert len(samples) >= 3 and any(len(s.image_token_counts) == 2 for s in samples)
    one = [encoder(s.pixel_values, s.image_grid_thw) for s in samples]
    # rows are H wide, H * (1 + D) with Qwen3-VL's deepstack maps
    grads_out = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(one)]
    torch.autograd.backward(one, grads_out)
    ref = {n: p.grad.clone() for n, p in encoder.named_parameters() if p.grad is not None}
    encoder.zero_grad(set_to_none=True)
    batched = encoder.encode_many(samples)
    torch.autograd.backward(batched, grads_out)
    for a, b in zip(batched, one):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ref.keys() == {n for n, p in encoder.named_parameters() if p.grad is not None}
    for n, p in encoder.named_parameters():
        if n in ref:
            torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_deepstack_maps_travel_in_the_image_rows_and_reach_the_decoder(family):
    """Qwen3-VL: each image row the encoder part sends holds the merged embedding and the D deepstack maps side by
    side ([n, H * (1 + D)]); the backbone adds map i after layer i. Changing only a deepstack map of the received
    rows changes the loss, and the loss's gradient reaches every map (so it flows back to the ViT's mergers)."""
    model = _model(family)
    encoder, backbone = split_vlm(model)
    d, h = hf_compat.deepstack_layers(model.config), backbone.hidden_size
    assert d == 2 and backbone.embed_width == 3 * h
    samples = make_samples(family, 3, seed=4)
    budget = sum(s.llm_tokens for s in samples) + 4
    embeds = _encode(encoder, samples)
    assert all(e is None or e.shape[-1] == 3 * h for e in embeds)
    leaves = [e.detach().requires_grad_() if e is not None else None for e in embeds]
    packed = backbone.pack(samples, leaves, budget)
    loss, _ = backbone(packed, leaves)
    loss.backward()
    for leaf in leaves:
        if leaf is not None:
            for i in range(1 + d):  # the embedding and each map get a gradient
                assert leaf.grad[:, i * h:(i + 1) * h].abs().sum() > 0, i
    for i in range(1, 1 + d):
        changed = [e.detach().clone() if e is not None else None for e in embeds]
        changed[0][:, i * h:(i + 1) * h] += 5.0
        with torch.no_grad():
            after, _ = backbone(backbone.pack(samples, changed, budget), changed)
        assert abs(after.item() - loss.item()) > 1e-5 * abs(loss.item()), (i, after.item(), loss.item())
    with pytest.raises(ValueError, match=rf"need \[\d+, {3 * h}\]"):  # rows without their maps are refused
        backbone.pack(samples, [e[:, :h] if e is not None else None for e in embeds], budget)
