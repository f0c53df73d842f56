"""All-to-all and all-gather that run both directions of a link at once, also on gloo.

The compressed exchanges cross the slow link in both directions at once: every leader sends its payload to
every other and receives theirs.  On NCCL (and any backend but gloo) this module runs the backend's own
collective.  On gloo it posts the same messages as point-to-point operations, **every receive before any
send**, because of how gloo's TCP transport pairs a send with its receive:

- a send of an unbound buffer waits until the peer has announced a matching receive (``Pair::send`` in
  ``gloo/transport/tcp/pair.cc`` sends a ``NOTIFY_SEND_READY`` notice and keeps the data until a
  ``NOTIFY_RECV_READY`` arrives; a receive posts that notice, ``Pair::recv`` -> ``sendNotifyRecvReady``);
- a pair's two directions share one TCP connection, so a notice is written behind whatever this rank has
  already handed the socket (its send buffer is sized to the message, ``Pair::send``);
- gloo's own ``alltoall`` and ring ``allgather`` post each send before its receive (``gloo/alltoall.cc``,
  ``gloo/allgather.cc``).

So when one rank of a pair starts its send before it has posted its receive, and the peer's receive notice
has already arrived, its receive notice follows its whole message over the link, and the peer's data waits for
it: the exchange takes the time of both directions, one after the other.  Whether that happens depends on
which rank arrives first.  Posting every receive first sends each notice before any data, so both directions
run at once (``benchmarks/duplex_exchange.py`` measures both against gloo's own; the figures are in
docs/results.md).

Both functions return a future of their output (on gloo completed already: gloo's compressed exchanges run
each collective to completion, ``exchange.overlaps``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_to_all", "all_gather"]


def _receives_first(group: dist.ProcessGroup) -> bool:
    """Whether the exchange is posted as point-to-point operations, receives first (gloo; module docstring)."""
    return dist.get_backend(group) == dist.Backend.GLOO


def _exchange(group: dist.ProcessGroup, receives: list[tuple[int, torch.Tensor]],
              sends: list[tuple[int, torch.Tensor]], output: torch.Tensor) -> torch.futures.Future:
    """Post every receive (peer's rank in ``group``, buffer), then every send; wait for all; ``output``'s
    future."""
    ops = [dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, peer), group) for peer, buf in receives]
    ops += [dist.P2POp(dist.isend, buf, dist.get_global_rank(group, peer), group) for peer, buf in sends]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(output)
    return done


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> torch.futures.Future:
    """``all_to_all_single`` of equal splits along dim 0: row block j of ``input`` goes to group rank j, and
    ``output``'s block i comes from group rank i.  Both contiguous, of one shape, dim 0 divisible by the group's
    size."""
    if not _receives_first(group):
        return dist.all_to_all_single(output, input, group=group, async_op=True).get_future()
    world, me = group.size(), group.rank()
    outs, ins = output.reshape(world, -1), input.reshape(world, -1)
    outs[me].copy_(ins[me])
    peers = [p for p in range(world) if p != me]
    return _exchange(group, [(p, outs[p]) for p in peers], [(p, ins[p]) for p in peers], output)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> torch.futures.Future:
    """``all_gather_into_tensor``: ``output`` (contiguous, ``size x input.numel()`` elements) gets group rank
    i's ``input`` at block i."""
    if not _receives_first(group):
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(output, input, group=group, async_op=True).get_future()
    world, me = group.size(), group.rank()
    blocks = output.reshape(world, -1)
    flat = input.reshape(-1)
    blocks[me].copy_(flat)
    peers = [p for p in range(world) if p != me]
    return _exchange(group, [(p, blocks[p]) for p in peers], [(p, flat) for p in peers], output)
