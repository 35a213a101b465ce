"""`deepspeed.comm`: DeepSpeed's collective API, mapped onto `torch.distributed`.

DeepSpeed's functions take extra keyword arguments for its communication logger
(`prof`, `log_name`, `debug`); they are accepted and have no effect here (use
torch.profiler, or fsdpx telemetry, to see collectives). `init_distributed` is
`fsdpx.deepspeed.init_distributed`.
"""

from typing import Any as _Any

import torch as _torch
import torch.distributed as _dist
from torch.distributed import (
    ProcessGroup,
    ReduceOp,
    all_to_all_single,
    barrier,
    destroy_process_group,
    get_global_rank,
    get_rank,
    get_world_size,
    irecv,
    is_available,
    is_initialized,
    isend,
    new_group,
    recv,
    send,
)

from fsdpx.deepspeed._initialize import init_distributed


def get_local_rank() -> int:
    """This process's rank on its node (torchrun's LOCAL_RANK; 0 without a launcher)."""
    import os

    return int(os.environ.get("LOCAL_RANK", "0"))


def all_reduce(
    tensor: _torch.Tensor,
    op: _Any = ReduceOp.SUM,
    group: _Any = None,
    async_op: bool = False,
    **kwargs: _Any,
) -> _Any:
    return _dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(
    tensor: _torch.Tensor, src: int, group: _Any = None, async_op: bool = False, **kwargs: _Any
) -> _Any:
    return _dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(
    tensor_list: list[_torch.Tensor],
    tensor: _torch.Tensor,
    group: _Any = None,
    async_op: bool = False,
    **kwargs: _Any,
) -> _Any:
    return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(
    output_tensor: _torch.Tensor,
    tensor: _torch.Tensor,
    group: _Any = None,
    async_op: bool = False,
    **kwargs: _Any,
) -> _Any:
    return _dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output_tensor: _torch.Tensor,
    tensor: _torch.Tensor,
    op: _Any = ReduceOp.SUM,
    group: _Any = None,
    async_op: bool = False,
    **kwargs: _Any,
) -> _Any:
    return _dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce(
    tensor: _torch.Tensor,
    dst: int,
    op: _Any = ReduceOp.SUM,
    group: _Any = None,
    async_op: bool = False,
    **kwargs: _Any,
) -> _Any:
    return _dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def all_to_all(
    output_tensor_list: list[_torch.Tensor],
    input_tensor_list: list[_torch.Tensor],
    group: _Any = None,
    async_op: bool = False,
    **kwargs: _Any,
) -> _Any:
    return _dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


__all__ = [
    "ProcessGroup",
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "destroy_process_group",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter_tensor",
    "send",
]
