"""Moving routed tokens to their experts' ranks and back: all-to-all with uneven split sizes.

A sender lists its kept (token, expert) pairs by *slot* (the experts numbered
rank by rank, each rank in its local order), so rank r's rows are one
contiguous block.  Two layouts:

* ``dispatch_exact`` sends exactly the routed rows.  Each rank first tells
  every other rank how many rows it sends to each of that rank's experts (one
  ``all_to_all_single`` of counts), then the rows go with uneven split sizes.
* ``dispatch_capacity`` (DeepSpeed's and GShard's layout, with token
  dropping) sends every expert ``capacity`` rows from every rank, padded with
  zeros: the split sizes follow from the placement and the ranks' capacities
  (``n_r x capacity`` rows to rank r, uneven when the placement is; only the
  capacities are exchanged, not the routing), and each rank's expert
  compute is fixed by its expert count, whatever the routing.

Both return the rows regrouped by local expert and a ``back`` function that
returns the experts' outputs to their senders, in the senders' pair order.
``all_to_all`` is ``all_to_all_single`` made differentiable: its backward
sends the gradients back along the same routes.  Works over gloo and NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from het_strategy.moe.placement import ExpertPlacement

__all__ = ["Dispatched", "dispatch_exact", "dispatch_capacity", "announce_capacity", "all_to_all"]


@dataclass
class Dispatched:
    """Rows received by this rank, grouped by local expert."""

    rows: torch.Tensor
    """``[N, h]``: local expert i's rows are the i-th block of ``sizes[i]`` rows."""
    sizes: list[int]
    back: Callable[[torch.Tensor], torch.Tensor]
    """Expert outputs (``rows``' layout) -> this rank's pairs' outputs, in the order they were dispatched."""


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


def dispatch_exact(rows: torch.Tensor, slot: torch.Tensor, placement: ExpertPlacement, rank: int,
                   group: Any = None) -> Dispatched:
    """Send ``rows`` (one per kept pair, sorted by ``slot``) to their experts' ranks, exactly as many as routed."""
    counts = torch.bincount(slot, minlength=placement.num_experts)
    if placement.world_size == 1:
        return _regroup(rows, [], [], counts[None, :], group)
    local = _from_sources(counts, placement, rank, group)()
    per_slot, send, start = counts.tolist(), [], 0
    for n in placement.counts:
        send.append(sum(per_slot[start:start + n]))
        start += n
    return _regroup(rows, send, local.sum(dim=1).tolist(), local, group)


def announce_capacity(capacity: int, placement: ExpertPlacement, rank: int,
                      group: Any = None) -> Callable[[], torch.Tensor]:
    """Start telling every rank this rank's capacity (async); the returned call waits for the
    ``[source, local expert]`` capacities.  Started before the gate runs, its latency hides behind it."""
    mine = torch.full((placement.num_experts,), capacity, dtype=torch.long)
    if placement.world_size == 1:
        return lambda: mine[None, :]
    return _from_sources(mine, placement, rank, group)


def dispatch_capacity(rows: torch.Tensor, slot: torch.Tensor, position: torch.Tensor, capacity: int,
                      placement: ExpertPlacement, rank: int, group: Any = None,
                      announced: Callable[[], torch.Tensor] | None = None) -> Dispatched:
    """Send every expert ``capacity`` rows from this rank (``rows`` at ``position`` of their expert's block).

    Ranks with other token counts have other capacities: each rank tells the
    others its capacity first (``announce_capacity``, the same small all-to-all
    as the exact layout's counts, started before the gate), the only thing
    exchanged before the rows.
    """
    world = placement.world_size
    index = slot * capacity + position
    buffer = rows.new_zeros((placement.num_experts * capacity, rows.shape[1])).index_copy(0, index, rows)
    local = (announced or announce_capacity(capacity, placement, rank, group))()
    sent = _regroup(buffer, [n * capacity for n in placement.counts] if world > 1 else [],
                    local.sum(dim=1).tolist() if world > 1 else [], local, group)
    back = sent.back
    sent.back = lambda y: back(y)[index]
    return sent


def _from_sources(per_slot: torch.Tensor, placement: ExpertPlacement, rank: int,
                  group: Any) -> Callable[[], torch.Tensor]:
    """Start one all-to-all of ``per_slot`` (this rank's figure for every expert slot; each rank gets the
    entries of its own experts); the returned call waits for ``[source, local expert]``."""
    world, n_local = placement.world_size, placement.counts[rank]
    local = per_slot.new_empty(world * n_local)
    work = dist.all_to_all_single(local, per_slot, output_split_sizes=[n_local] * world,
                                  input_split_sizes=placement.counts, group=group, async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        return local.view(world, n_local)

    return wait


def _regroup(rows: torch.Tensor, send: list[int], recv: list[int], local: torch.Tensor, group: Any) -> Dispatched:
    """Send ``rows`` with split sizes ``send``/``recv`` (none for one rank) and group what arrives by expert.

    ``local[s, i]``: rows source s sends to local expert i.
    """
    world = len(send)
    received = all_to_all(rows, send, recv, group) if world > 1 else rows
    perm = _expert_major(local)
    grouped = received[perm]

    def back(y: torch.Tensor) -> torch.Tensor:
        y = y.new_empty(y.shape).index_copy(0, perm.to(y.device), y)  # back to the order received
        return all_to_all(y, recv, send, group) if world > 1 else y

    return Dispatched(grouped, local.sum(dim=0).tolist(), back)


def _expert_major(local: torch.Tensor) -> torch.Tensor:
    """Row order that regroups rows received by source (each source's by local expert) by expert, then source."""
    sources, experts = local.shape
    flat = local.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # where each (source, expert) block starts in the received rows
    order = torch.arange(sources * experts, device=local.device).view(sources, experts).t().reshape(-1)
    lengths, block_starts = flat[order], starts[order]
    out_starts = torch.cumsum(lengths, 0) - lengths
    total = int(lengths.sum())
    return torch.arange(total, device=local.device) + torch.repeat_interleave(block_starts - out_starts, lengths)
