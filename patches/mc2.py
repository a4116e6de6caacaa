"""MC2 linear layers accept 2-D input (MindSpeed `--use-ascend-mc2` with MindSpeed-MM's vision projector).

MindSpeed's MC2 column/row-parallel linears (`mc2_feature/linear_function.py`) flatten `[s, b, h]` with
`input_.reshape(shape[0] * shape[1], shape[2])`. MindSpeed-MM's multimodal projector (`lnmlp`) feeds them
`[tokens, h]`, so every TP + SP + `--use-ascend-mc2` VLM run dies with `IndexError: tuple index out of range`
(on NPU as under emulation: it is the same Python). Megatron's own parallel linears accept 2-D input and gather /
scatter along dim 0; these wrappers give the MC2 layers the same contract by viewing `[t, h]` as `[t, 1, h]`
around the original forward and dropping the unit batch dim from the output.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

COLUMN_TARGET = ("mindspeed.core.tensor_parallel.mc2_feature.mc2_column_parallel_linear."
                 "MC2ColumnParallelLinearImpl.forward")
ROW_TARGET = "mindspeed.core.tensor_parallel.mc2_feature.mc2_row_parallel_linear.MC2RowParallelLinearImpl.forward"
TARGET_MODULES = ("mindspeed.core.tensor_parallel.mc2_feature.mc2_column_parallel_linear",
                  "mindspeed.core.tensor_parallel.mc2_feature.mc2_row_parallel_linear")


def _squeeze_batch(result: tuple[Any, Any]) -> tuple[Any, Any]:
    output, output_bias = result
    return output.squeeze(1), output_bias


def mc2_column_forward_2d_wrapper(forward: Callable) -> Callable:
    """Wrap `MC2ColumnParallelLinearImpl.forward(self, input_, weight=None, runtime_gather_output=None, **kw)`."""

    @functools.wraps(forward)
    def wrapped(self: Any, input_: Any, weight: Any = None, runtime_gather_output: Any = None,
                **kwargs: Any) -> tuple[Any, Any]:
        if input_.dim() != 2:
            return forward(self, input_, weight, runtime_gather_output, **kwargs)
        return _squeeze_batch(forward(self, input_.unsqueeze(1), weight, runtime_gather_output, **kwargs))

    return wrapped


def mc2_row_forward_2d_wrapper(forward: Callable) -> Callable:
    """Wrap `MC2RowParallelLinearImpl.forward(self, input_, **kwargs)`."""

    @functools.wraps(forward)
    def wrapped(self: Any, input_: Any, **kwargs: Any) -> tuple[Any, Any]:
        if input_.dim() != 2:
            return forward(self, input_, **kwargs)
        return _squeeze_batch(forward(self, input_.unsqueeze(1), **kwargs))

    return wrapped


def register(patch_manager: Any) -> None:
    """Register both wrappers (names end in `wrapper`, so MindSpeed stacks them as decorators)."""
    patch_manager.register_patch(COLUMN_TARGET, mc2_column_forward_2d_wrapper)
    patch_manager.register_patch(ROW_TARGET, mc2_row_forward_2d_wrapper)
