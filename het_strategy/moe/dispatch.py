"""Moving routed tokens to their experts' ranks and back: all-to-all with uneven split sizes.

``exchange_counts`` all-gathers every rank's per-expert token counts (``E``
integers per rank), so each rank knows what it sends to and receives from
every other rank.  ``all_to_all`` is ``torch.distributed.all_to_all_single``
with those split sizes, differentiable: its backward sends the gradients back
along the same routes (the splits swapped).  Works over gloo and NCCL.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["exchange_counts", "all_to_all"]


def exchange_counts(counts: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``[world, E]``: every rank's per-expert counts (a collective over ``group``)."""
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts.contiguous(), group=group)
    return torch.stack(gathered)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        back = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Any = None) -> torch.Tensor:
    """Rows ``x[sum(send[:r]) : sum(send[:r+1])]`` go to rank r; returns the rows received, by source rank."""
    return _AllToAll.apply(x, list(send), list(recv), group)
