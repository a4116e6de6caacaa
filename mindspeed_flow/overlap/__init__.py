"""Communication/computation overlap for tensor-parallel linears with sequence parallelism.

`ColumnParallelLinearSP` / `RowParallelLinearSP` (and their functional forms) run the all-gather -> matmul and
matmul -> reduce-scatter of Megatron-style TP+SP with torch_npu's MC2 fused ops on Ascend, with a chunked
async-collective decomposition everywhere else, or with a plain blocking reference; `select_impl` picks one per
call and says why MC2 was not used.
"""
from mindspeed_flow.overlap.collectives import all_gather_rows, reduce_scatter_rows
from mindspeed_flow.overlap.linear import (IMPLS, ColumnParallelLinearSP, RowParallelLinearSP,
                                           column_parallel_linear_sp, explain_impl, mc2_rejections,
                                           row_parallel_linear_sp, select_impl)

__all__ = ["IMPLS", "ColumnParallelLinearSP", "RowParallelLinearSP", "all_gather_rows", "column_parallel_linear_sp",
           "explain_impl", "mc2_rejections", "reduce_scatter_rows", "row_parallel_linear_sp", "select_impl"]
