"""All-gather and reduce-scatter of one flat tensor cut into pieces of unequal sizes (gloo and NCCL).

``torch.distributed``'s single-tensor collectives (``all_gather_single``, ``reduce_scatter_single``; the
``*_into_tensor`` / ``*_tensor`` names before torch 2.13) need one size per rank.  A flat parameter of
``hetero_fsdp`` is cut by memory, so rank ``r`` holds ``sizes[r]`` elements (maybe 0), the pieces lying one after
another: rank ``r``'s piece starts at ``sum(sizes[:r])``.  As ``ds_runtime/holder_sharding.py`` does for its
chunks, both collectives here pad every piece to the largest size, run the equal-size collective, and trim:

- ``all_gather_uneven``: 1. this rank's piece is copied into a zeroed buffer of ``max(sizes)``;
  2. ``all_gather_single`` puts rank ``r``'s padded piece at ``r * max(sizes)``; 3. each piece's first
  ``sizes[r]`` elements are copied to ``sum(sizes[:r])`` of the output.  With equal sizes the gather writes
  straight into the output (no padding, no copy).
- ``reduce_scatter_uneven``: 1. rank ``r``'s piece of the full tensor is copied to ``r * max(sizes)`` of a zeroed
  buffer; 2. ``reduce_scatter_single`` sums every rank's buffer and hands rank ``r`` block ``r``; 3. its first
  ``sizes[r]`` elements are the result.  Either may run asynchronously: ``(tensor, work)``, valid after the wait.

Invariant: every rank of ``group`` calls with the same ``sizes`` (in group-rank order) and the same dtype, in the
same order relative to its other collectives on ``group``; the padding is the same everywhere, so every rank sends
and receives ``world * max(sizes)`` elements.  All sizes 0: no collective at all (on every rank alike).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from het_strategy.core.errors import field_error
from het_strategy.core.shard_sizes import shard_offsets

__all__ = ["all_gather_uneven", "reduce_scatter_uneven"]


def _gather_into(output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool) -> Any:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


class _Done:
    """The work handle of a collective that had nothing to move (every size 0)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _ThenCopy:
    """A collective's work handle whose ``wait()`` also runs the trimming copy that makes the output valid, and
    that holds the collective's buffers (``keep``) until then."""

    def __init__(self, work: Any, copy_out: Callable[[], None], keep: tuple = ()) -> None:
        self.work, self.copy_out, self.keep, self.done = work, copy_out, keep, False

    def wait(self, timeout: Any = None) -> bool:
        if not self.done:
            self.work.wait()
            self.copy_out()  # on NCCL enqueued on the current stream, after the wait made it wait for the gather
            self.done, self.keep = True, ()
        return True

    def is_completed(self) -> bool:
        return self.done


def _check_sizes(sizes: Sequence[int], group: Any, what: str) -> int:
    world = dist.get_world_size(group=group)
    if len(sizes) != world or any(int(s) < 0 for s in sizes):
        raise field_error(f"{what}.sizes", list(sizes), f"be {world} sizes >= 0, one per rank of the group")
    return world


def all_gather_uneven(shard: torch.Tensor, sizes: Sequence[int], group: Any = None, async_op: bool = False,
                      out: torch.Tensor | None = None) -> Any:
    """Every rank's 1-D ``shard`` (rank ``r``'s of ``sizes[r]`` elements), concatenated in rank order: a tensor of
    ``sum(sizes)`` elements (written into ``out`` when given: contiguous, 1-D, that size, the shard's dtype).

    ``async_op=True`` returns ``(tensor, work)``: the tensor is valid once ``work.wait()`` returned (the wait
    also trims the padding).  A collective over ``group``: every rank calls it with the same ``sizes``."""
    world = _check_sizes(sizes, group, "all_gather_uneven")
    rank = dist.get_rank(group=group)
    if shard.dim() != 1 or shard.numel() != int(sizes[rank]):
        raise field_error("all_gather_uneven.shard", tuple(shard.shape), f"be 1-D with sizes[{rank}] = "
                          f"{int(sizes[rank])} elements (this rank's piece)")
    total, per = sum(int(s) for s in sizes), max(int(s) for s in sizes)
    if out is None:
        out = torch.empty(total, dtype=shard.dtype, device=shard.device)
    elif out.dim() != 1 or out.numel() != total or not out.is_contiguous() or out.dtype != shard.dtype:
        raise field_error("all_gather_uneven.out", (tuple(out.shape), out.dtype),
                          f"be contiguous, 1-D, of {total} elements of {shard.dtype}")
    if per == 0:
        return (out, _Done()) if async_op else out
    if all(int(s) == per for s in sizes):  # even: the gather's layout is the flat layout
        work = _gather_into(out, shard.contiguous(), group, async_op)
        return (out, work) if async_op else out
    padded = torch.zeros(per, dtype=shard.dtype, device=shard.device)
    padded[:shard.numel()].copy_(shard)
    blocks = torch.empty(world * per, dtype=shard.dtype, device=shard.device)

    def copy_out() -> None:
        for r, (at, size) in enumerate(zip(shard_offsets(sizes), sizes)):
            out[at:at + int(size)].copy_(blocks[r * per:r * per + int(size)])

    work = _gather_into(blocks, padded, group, async_op)
    if async_op:
        return out, _ThenCopy(work, copy_out, keep=(padded, blocks))
    copy_out()
    return out


def reduce_scatter_uneven(full: torch.Tensor, sizes: Sequence[int], rank: int, group: Any = None,
                          async_op: bool = False) -> Any:
    """This rank's piece (``sizes[rank]`` elements from ``sum(sizes[:rank])``) of the 1-D ``full`` summed over
    every rank of ``group``; ``rank`` is this rank's rank in ``group``.  ``async_op=True`` returns
    ``(tensor, work)``: the tensor is valid once ``work.wait()`` returned (``full`` may be dropped before).  A
    collective: every rank calls it with the same ``sizes``."""
    world = _check_sizes(sizes, group, "reduce_scatter_uneven")
    if full.dim() != 1 or full.numel() != sum(int(s) for s in sizes):
        raise field_error("reduce_scatter_uneven.full", tuple(full.shape),
                          f"be 1-D with sum(sizes) = {sum(int(s) for s in sizes)} elements")
    per = max(int(s) for s in sizes)
    if per == 0:
        return (full.new_empty(0), _Done()) if async_op else full.new_empty(0)
    out = torch.empty(per, dtype=full.dtype, device=full.device)
    if all(int(s) == per for s in sizes):  # even: the flat layout is the scatter's layout
        padded = full.contiguous()
    else:
        padded = torch.zeros(world * per, dtype=full.dtype, device=full.device)
        for r, (at, size) in enumerate(zip(shard_offsets(sizes), sizes)):
            padded[r * per:r * per + int(size)].copy_(full[at:at + int(size)])
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = scatter(out, padded, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    piece = out[:int(sizes[rank])]
    if async_op:  # the handle keeps the input alive until the collective is done with it
        return piece, _ThenCopy(work, lambda: None, keep=(padded, out))
    return piece
