"""The documented torch_npu MC2 API, and a check of every call the overlap layer makes against it.

The mc2 path cannot run here (no Ascend), and the CPU emulation of torch_npu is this project's own code, so agreeing
with the emulation proves little about the real ops. This module holds the op prototypes as Ascend documents them and
the rules its constraint tables state, and `check_call` binds a call's arguments to every documented release of the
prototype and checks those rules. The overlap layer runs it before each fused call (cheap: one signature bind), so a
convention slip (a transposed first input, a bias handed to the op, gather_index 1) is an error at the call site, on
CPU under emulation and on NPU alike. The `get_hccl_comm_name` prototype is bound by tests/test_overlap.py, which
checks that the layer passes the global rank.

Sources (torch_npu API reference, "torch_npu.npu_all_gather_base_mm" / "torch_npu.npu_mm_reduce_scatter_base" /
"get_hccl_comm_name"): https://www.hiascend.com/document/detail/zh/Pytorch/60RC2/apiref/apilist/ (6.0.RC2 form, the
keyword-only one MindSpeed calls) and the op-plugin 7.3.0 docs, https://gitcode.com/Ascend/op-plugin (newer form with
quantisation arguments; `npu_mm_all_reduce_base` is documented there for Atlas A2). MindSpeed's own calls (mindspeed/core/tensor_parallel/mc2_feature/linear_function.py) use
the same conventions: 2-D inputs, `weight.t()` as x2, bias=None with the bias added afterwards, gather_index=0.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

# k (the contraction size) must lie in [256, 65535); world sizes the C++ op accepts; dtypes of both inputs.
K_RANGE = (256, 65535)
WORLD_SIZES = (2, 4, 8, 16, 32)
DTYPES = (torch.float16, torch.bfloat16)


# The prototypes, written as Python stubs only so that `inspect.signature` can bind calls against them.
def _all_gather_base_mm_6_0(input, x2, hcom, world_size, *, bias=None, gather_index=0,  # noqa: A002, ANN001
                            gather_output=True, comm_turn=0): ...  # noqa: ANN202


def _all_gather_base_mm_7_3(x1, x2, hcom, world_size, bias=None, x1_scale=None, x2_scale=None,  # noqa: ANN001
                            gather_index=0, gather_output=True, comm_turn=0, output_dtype=None,
                            comm_mode=None): ...  # noqa: ANN202


def _mm_reduce_scatter_base_6_0(input, x2, hcom, world_size, *, reduce_op="sum", bias=None,  # noqa: A002, ANN001
                                comm_turn=0): ...  # noqa: ANN202


def _mm_reduce_scatter_base_7_3(input, x2, hcom, world_size, *, reduce_op="sum", bias=None,  # noqa: A002, ANN001
                                x1_scale=None, x2_scale=None, comm_turn=0, output_dtype=None,
                                comm_mode=None): ...  # noqa: ANN202


def _mm_all_reduce_base_7_3(x1, x2, hcom, *, reduce_op="sum", bias=None, antiquant_scale=None,  # noqa: ANN001
                            antiquant_offset=None, x3=None, dequant_scale=None, pertoken_scale=None,
                            comm_quant_scale_1=None, comm_quant_scale_2=None, comm_turn=0,
                            antiquant_group_size=0): ...  # noqa: ANN202


def _get_hccl_comm_name(rankid, init_comm=True): ...  # noqa: ANN001, ANN202


PROTOTYPES: dict[str, tuple[inspect.Signature, ...]] = {
    "npu_all_gather_base_mm": (inspect.signature(_all_gather_base_mm_6_0), inspect.signature(_all_gather_base_mm_7_3)),
    "npu_mm_reduce_scatter_base": (inspect.signature(_mm_reduce_scatter_base_6_0),
                                   inspect.signature(_mm_reduce_scatter_base_7_3)),
    "npu_mm_all_reduce_base": (inspect.signature(_mm_all_reduce_base_7_3),),
    "get_hccl_comm_name": (inspect.signature(_get_hccl_comm_name),),
}


def _bind_all(op: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """The call bound to every documented release (defaults applied), and how it fails to bind where it does."""
    bound, errors = [], []
    for sig in PROTOTYPES[op]:
        try:
            b = sig.bind(*args, **kwargs)
        except TypeError as err:
            errors.append(f"{op}{sig}: {err}")
            continue
        b.apply_defaults()
        bound.append(dict(b.arguments))
    return bound, errors


def _check_matmul_inputs(op: str, a: Any, b: Any, errors: list[str]) -> Optional[int]:
    """2-D (m, k) @ (k, n), fp16/bf16 both, first input not a transposed view; returns m (None if unusable)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        errors.append(f"{op}: both inputs must be tensors")
        return None
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        errors.append(f"{op}: needs 2-D (m, k) @ (k, n), got {tuple(a.shape)} @ {tuple(b.shape)}")
        return None
    if not a.is_contiguous():
        errors.append(f"{op}: the first input must not be a transposed/strided view (x2 may be)")
    if a.dtype not in DTYPES or b.dtype != a.dtype:
        errors.append(f"{op}: dtypes {a.dtype}/{b.dtype}, both must be float16 or bfloat16")
    k = a.shape[1]
    if op != "npu_mm_all_reduce_base" and not K_RANGE[0] <= k < K_RANGE[1]:  # the range is AG/RS's
        errors.append(f"{op}: k={k} outside [{K_RANGE[0]}, {K_RANGE[1]})")
    return a.shape[0]


MATMUL_OPS = ("npu_all_gather_base_mm", "npu_mm_reduce_scatter_base", "npu_mm_all_reduce_base")


def check_call(op: str, args: Sequence[Any], kwargs: Mapping[str, Any],
               expected_hcom: Optional[str] = None, group_size: Optional[int] = None) -> list[str]:
    """Every way the call `torch_npu.<op>(*args, **kwargs)` breaks the documented API (empty: it conforms).

    It must bind to every documented release of the prototype (so it runs on old and new torch_npu alike), and
    obey the constraint tables: 2-D inputs (the all-reduce op also takes a 3-D first input, but this layer always
    flattens), k range, dtypes, world size, bias None, gather_index 0, comm_turn 0, reduce_op "sum", m divisible by
    the world size for the reduce-scatter, and the TP group's own communicator.
    """
    if op not in MATMUL_OPS:
        raise KeyError(f"no documented MC2 prototype for {op!r}")
    bound, errors = _bind_all(op, args, kwargs)
    if not bound:
        return errors
    call = bound[0]
    first = call.get("input", call.get("x1"))
    m = _check_matmul_inputs(op, first, call["x2"], errors)
    if expected_hcom is not None and call["hcom"] != expected_hcom:
        errors.append(f"{op}: hcom {call['hcom']!r} is not the TP group's communicator {expected_hcom!r}")
    if call["bias"] is not None:
        errors.append(f"{op}: bias must be None (current releases reject it; add the bias after the op)")
    if call["comm_turn"] != 0:
        errors.append(f"{op}: comm_turn={call['comm_turn']}, must be 0")
    if call.get("reduce_op", "sum") != "sum":
        errors.append(f"{op}: reduce_op={call['reduce_op']!r}, only 'sum' is supported")
    if op == "npu_mm_all_reduce_base":  # no world size argument; the communicator carries it
        return errors
    world = call["world_size"]
    if world not in WORLD_SIZES:
        errors.append(f"{op}: world_size={world} not in {WORLD_SIZES}")
    if group_size is not None and world != group_size:
        errors.append(f"{op}: world_size={world} but the TP group has {group_size} ranks")
    if op == "npu_all_gather_base_mm" and call["gather_index"] != 0:
        errors.append(f"{op}: gather_index={call['gather_index']}, must be 0 (gather the first input)")
    if op == "npu_mm_reduce_scatter_base":
        if m is not None and isinstance(world, int) and world > 0 and m % world:
            errors.append(f"{op}: m={m} is not divisible by world_size={world}")
    return errors


def checked(op: str, fn: Callable[..., Any], expected_hcom: Optional[str], group_size: int) -> Callable[..., Any]:
    """`fn` (the torch_npu op) guarded by `check_call`: a non-conforming call raises before it reaches HCCL."""

    def call(*args: Any, **kwargs: Any) -> Any:
        errors = check_call(op, args, kwargs, expected_hcom, group_size)
        if errors:
            raise ValueError("MC2 call breaks the documented torch_npu API: " + "; ".join(errors))
        return fn(*args, **kwargs)

    return call
