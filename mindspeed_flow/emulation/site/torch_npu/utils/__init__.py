"""Fake `torch_npu.utils`."""
from torch_npu.utils import collect_env, flops_count  # noqa: F401


def register_asd_hook(*args, **kwargs):
    """Silent-data-corruption detection hooks: nothing to watch on the host CPU."""
    return None
