"""The MC2 2-D input wrappers (mindspeed_flow_patches.mc2) and the patch launcher's usage checks, without MindSpeed.

The end-to-end proof (crash without the patch, training with it, MC2 ops called) is
tests/mindspeed_mm/test_mc2_patch.py; here the wrappers run around forwards that, like MindSpeed's MC2 linears,
index `input_.shape[2]` and return `(output, bias)`.
"""
from __future__ import annotations

import pytest
import torch

from mindspeed_flow_patches import launch, mc2


class _Linear3D:
    """Stand-in with MindSpeed's MC2 forward contract: [s, b, h] in, ([s, b, n], bias) out."""

    def __init__(self) -> None:
        self.weight = torch.randn(5, 3)
        self.calls: list[tuple[int, ...]] = []

    def column_forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                       runtime_gather_output: bool | None = None, **kwargs: object) -> tuple:
        self.calls.append(tuple(input_.shape))
        s, b, h = input_.shape[0], input_.shape[1], input_.shape[2]
        return (input_.reshape(s * b, h) @ self.weight.t()).view(s, b, -1), None

    def row_forward(self, input_: torch.Tensor, **kwargs: object) -> tuple:
        return self.column_forward(input_)


def test_wrappers_feed_2d_input_as_unit_batch_and_return_2d() -> None:
    layer, x = _Linear3D(), torch.randn(4, 3)
    column = mc2.mc2_column_forward_2d_wrapper(_Linear3D.column_forward)
    row = mc2.mc2_row_forward_2d_wrapper(_Linear3D.row_forward)
    with pytest.raises(IndexError):
        _Linear3D.column_forward(layer, x)  # the unpatched failure mode
    for fn in (column, row):
        out, bias = fn(layer, x)
        torch.testing.assert_close(out, x @ layer.weight.t())
        assert bias is None
    assert layer.calls[-2:] == [(4, 1, 3), (4, 1, 3)]


def test_wrappers_leave_3d_input_untouched() -> None:
    layer, x = _Linear3D(), torch.randn(4, 2, 3)
    out, _ = mc2.mc2_column_forward_2d_wrapper(_Linear3D.column_forward)(layer, x, None, None)
    torch.testing.assert_close(out, _Linear3D.column_forward(layer, x)[0])
    assert layer.calls[0] == (4, 2, 3)


def test_registration_targets_real_names_as_decorators() -> None:
    registered: list[tuple[str, str]] = []

    class _Manager:
        @staticmethod
        def register_patch(target: str, fn: object) -> None:
            registered.append((target, fn.__name__))

    mc2.register(_Manager)
    # MindSpeed stacks a patch as a decorator only when its name ends in "wrapper".
    assert all(name.endswith("wrapper") for _, name in registered)
    assert [t for t, _ in registered] == [mc2.COLUMN_TARGET, mc2.ROW_TARGET]
    assert all(t.rsplit(".", 2)[0] in mc2.TARGET_MODULES for t, _ in registered)


def test_launcher_usage_errors(capsys: pytest.CaptureFixture) -> None:
    assert launch.main([]) == 2
    assert launch.main(["no_such_script.py"]) == 2
    assert "not found" in capsys.readouterr().err
