"""Fake `torchair` (mindspeed-flow emulation): imported by MindSpeed's op builders only to declare graph-mode
converters, which never run on the host CPU."""
from torchair import ge  # noqa: F401


def register_fx_node_ge_converter(target):
    def decorator(fn):
        return fn

    return decorator
