"""Fake `torchair.ge`: any public attribute is an inert placeholder class (used in annotations only)."""


class Tensor:
    pass


class TensorSpec:
    pass


class DataType:
    pass


def __getattr__(name):
    # Dunder lookups must fail: inspect.getmodule (inside torch.library) probes __file__ and friends.
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (), {})
