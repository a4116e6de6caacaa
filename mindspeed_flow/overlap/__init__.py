"""Communication/computation overlap for tensor-parallel linears with sequence parallelism.

`ColumnParallelLinearSP` / `RowParallelLinearSP` (and their functional forms) run the all-gather -> matmul and
matmul -> reduce-scatter of Megatron-style TP+SP with torch_npu's MC2 fused ops on Ascend, with a chunked
async-collective decomposition everywhere else, or with a plain blocking reference; the part's `OverlapContext`
picks one per call, says once why MC2 was not used, and holds every cache (no module-level state).
"""
from mindspeed_flow.overlap.collectives import all_gather_rows, reduce_scatter_rows
from mindspeed_flow.overlap.linear import (IMPLS, TP_CTX_ATTR, TP_DIM_ATTR, TP_FUSED_ATTR, ColumnParallelLinear, ColumnParallelLinearSP,
                                           OverlapContext, RowParallelLinear, RowParallelLinearSP,
                                           column_parallel_linear, column_parallel_linear_sp, row_parallel_linear,
                                           checkpoint_tensor, local_shard, row_parallel_linear_sp, shard_of)

__all__ = ["IMPLS", "TP_CTX_ATTR", "TP_DIM_ATTR", "TP_FUSED_ATTR", "checkpoint_tensor", "local_shard", "shard_of", "ColumnParallelLinear", "ColumnParallelLinearSP", "OverlapContext",
           "RowParallelLinear", "RowParallelLinearSP", "all_gather_rows", "column_parallel_linear",
           "column_parallel_linear_sp", "reduce_scatter_rows", "row_parallel_linear", "row_parallel_linear_sp"]
