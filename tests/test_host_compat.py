"""hf_compat's transformers-4.57 branches (MindSpeed-MM's pin), exercised with stand-ins shaped like 4.57's
return values and signatures: 4.57 cannot be installed beside 5.x in one venv. The installed version's branches
run on the real models in test_host_split.py (5.x in .venv, 4.57 in the torch 2.7 venv: MSF_TORCH=2.7)."""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from mindspeed_flow.hosts.torch import hf_compat


def test_image_features_of_every_version_become_token_rows():
    a, b = torch.randn(4, 8), torch.randn(6, 8)
    v5 = types.SimpleNamespace(pooler_output=(a, b))  # 5.x ModelOutput with per-image tuple
    assert torch.equal(hf_compat._as_token_rows(v5), torch.cat([a, b]))
    assert torch.equal(hf_compat._as_token_rows((a, b)), torch.cat([a, b]))  # 4.57 Qwen: torch.split tuple
    llava = torch.randn(2, 16, 8)  # 4.57 LLaVA: [n_images, tokens, H]
    assert torch.equal(hf_compat._as_token_rows(llava), llava.reshape(32, 8))


class _Owner457(nn.Module):
    """get_rope_index as in 4.57: no mm_token_type_ids; images found through input_ids."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def get_rope_index(self, input_ids=None, image_grid_thw=None, video_grid_thw=None, attention_mask=None):
        self.calls.append({"image_grid_thw": image_grid_thw, "video_grid_thw": video_grid_thw})
        n = input_ids.shape[1]
        return torch.arange(n).view(1, 1, -1).expand(3, 1, -1), torch.zeros(1, 1)


class _Owner5(_Owner457):
    def get_rope_index(self, input_ids, mm_token_type_ids, image_grid_thw=None, video_grid_thw=None,
                       attention_mask=None, **kwargs):
        self.calls.append({"mm_token_type_ids": mm_token_type_ids})
        return super().get_rope_index(input_ids, image_grid_thw, video_grid_thw)


def test_rope_index_passes_mm_token_type_ids_only_where_accepted():
    ids = torch.tensor([381, 380, 380, 382, 5, 6])
    grid = torch.tensor([[1, 2, 4]])
    old, new = _Owner457(), _Owner5()
    assert hf_compat.rope_index(old, ids, grid, image_token=380).shape == (3, 1, 6)
    assert "mm_token_type_ids" not in old.calls[0] and torch.equal(old.calls[0]["image_grid_thw"], grid)
    hf_compat.rope_index(new, ids, grid, image_token=380)
    assert new.calls[0]["mm_token_type_ids"].tolist() == [[0, 1, 1, 0, 0, 0]]


def test_decoder_layer_tuple_output_is_unwrapped():
    class TupleLayer(nn.Module):  # 4.57-style: (hidden_states,) [+ attention weights]
        def forward(self, hidden_states, attention_mask=None, position_ids=None, use_cache=False,
                    position_embeddings=None, **kwargs):
            return (hidden_states * 2, None)

    x = torch.ones(1, 3, 4)
    assert torch.equal(hf_compat.call_decoder_layer(TupleLayer(), x, None, (x, x)), 2 * x)


def test_dtype_kwarg_follows_the_major_version():
    assert hf_compat.dtype_kwarg(torch.bfloat16, "4.57.1") == {"torch_dtype": torch.bfloat16}
    assert hf_compat.dtype_kwarg(torch.bfloat16, "5.24.0") == {"dtype": torch.bfloat16}
    # the installed transformers: 5.x in .venv, 4.57 in .venv-torch27 (MSF_TORCH=2.7)
    import transformers

    installed = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    assert hf_compat.dtype_kwarg(torch.float32) == {installed: torch.float32}


def test_module_lookups_fall_back_and_name_what_is_missing():
    lm = nn.Module()
    old = nn.Module()
    old.model = lm  # pre-4.52 layout: the language model directly at .model, no .model.language_model
    assert hf_compat.language_model(old) is lm
    with pytest.raises(AttributeError, match="lm_head"):
        hf_compat.lm_head(old)
    with pytest.raises(ValueError, match="model.family='internvl'"):
        hf_compat.family_classes("internvl")
