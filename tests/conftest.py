"""Shared pytest setup: one thread per process, and the `mindspeed_mm` marker for source-dependent tests."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "mindspeed_mm: needs MindSpeed-MM/MindSpeed/Megatron sources (MINDSPEED_MM_HOME ...)")
    config.addinivalue_line("markers", "slow: longer end-to-end runs")
