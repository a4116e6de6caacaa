"""mindspeed_flow.data: sample format, synthetic workloads, real readers, loaders (prefetch, skip-bad).

Public API (imported lazily, so `mindspeed_flow.data.shapes` stays importable without torch for the planner):

    token_spec_from_hf_config(cfg) -> TokenSpec            tokens.py
    build_dataset(data_cfg, token_spec, tokenizer=None, hf_config=None)  build.py (synthetic_infovqa | sharegpt |
                                                           length_table | synthetic_omni)
    SyntheticOmni, OmniSample                              omni.py (audio + image samples for the Omni thinker)
    SyntheticInfoVQA, ShareGPTDataset, LengthTableDataset  every one: len(ds), ds.shape(i), ds.sample(i, with_pixels)
    export_length_table(ds, path)                          length_table.py
    iter_global_batches(ds, global_batch_size, seed, ...)  sampler.py (good ids only; state_dict/load_state_dict)
    SampleGuard, BadSample, TooManyBadSamples              guard.py
    Prefetcher(fn, ids, depth), prefetch_samples(ds, ids, with_pixels=, depth=)   prefetch.py
    load_local_tokenizer(path), hf_tokenizer_fn(tok)       tokens.py  (str -> ids callables for the ShareGPT reader)
    smart_resize, patchify_qwen2                           image.py
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TokenSpec": "sample", "VLMSample": "sample", "IGNORE_INDEX": "sample",
    "SampleShape": "shapes", "read_length_table": "shapes", "write_length_table": "shapes",
    "token_spec_from_hf_config": "tokens", "ByteTokenizer": "tokens", "build_conversation": "tokens",
    "smart_resize": "image", "patchify_qwen2": "image", "process_pil_qwen2": "image", "process_pil_llava": "image",
    "VLMDataset": "base",
    "SyntheticInfoVQA": "synthetic", "SyntheticParams": "synthetic",
    "ShareGPTDataset": "sharegpt",
    "SyntheticOmni": "omni", "OmniSample": "omni",
    "LengthTableDataset": "length_table", "export_length_table": "length_table",
    "BadSample": "guard", "TooManyBadSamples": "guard", "SampleGuard": "guard",
    "GlobalBatchSampler": "sampler", "iter_global_batches": "sampler",
    "Prefetcher": "prefetch", "prefetch_samples": "prefetch",
    "hf_tokenizer_fn": "tokens", "load_local_tokenizer": "tokens",
    "build_dataset": "build", "synthetic_params": "build",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mindspeed_flow.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"mindspeed_flow.data.{module}"), name)
