"""Hierarchical gradient exchange: uncompressed within a node, compressed only across the slow inter-node hop.

On a cluster whose nodes are joined by a slow link, flat compression squeezes
every byte alike, though only the bytes that cross the link are slow.
``hierarchical_hook`` sums each bucket within the node, exchanges the node sums
compressed among the nodes' leaders (``compression_hook`` on the leaders'
``CompressionState``, so ``adaptive`` measures and prices the inter-node link
only) and broadcasts the result within the node; its docstring has the steps.
``node_groups`` makes the process groups, ``HierarchicalState`` holds them.

Invariants: every rank ends with ``sum / world``, bitwise the same tensor on
every rank (with ``method="none"`` equal to the flat mean up to the order of the
fp32 additions).  Every node must hold the same number of ranks: DDP's buckets
are the same on every rank, so every rank runs the same collectives in the same
order.

Usage on any DDP model::

    groups = node_groups(ranks_per_node=2)                  # every rank calls it (it makes process groups)
    state = HierarchicalState(ddp_model, "adaptive", groups)
    ddp_model.register_comm_hook(state, hierarchical_hook)
"""

# no ``from __future__ import annotations``: DDP checks the hook's annotations as objects, not strings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from het_strategy.compression.exchange import Steps, run_steps
from het_strategy.compression.hook import compression_hook
from het_strategy.compression.state import CompressionState
from het_strategy.core.errors import field_error

__all__ = ["NodeGroups", "node_groups", "HierarchicalState", "hierarchical_hook"]


@dataclass
class NodeGroups:
    """This rank's place in the hierarchy, and the process groups of each level."""

    node: int
    """Index of this rank's node (``rank // ranks_per_node``)."""
    ranks_per_node: int
    num_nodes: int
    intra: Any
    """The process group of this rank's node."""
    leaders: Any
    """The process group of every node's first rank (a non-member handle on the other ranks)."""
    leader: int
    """Global rank of this node's leader."""

    @property
    def is_leader(self) -> bool:
        return dist.get_rank() == self.leader


def node_groups(ranks_per_node: int) -> NodeGroups:
    """Split the default group into nodes of ``ranks_per_node`` consecutive ranks; a collective call (every rank
    creates every group, in the same order, as ``torch.distributed.new_group`` requires)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1 \
            or world % ranks_per_node:
        raise field_error("ranks_per_node", ranks_per_node, f"be a positive divisor of the world size ({world})")
    nodes = world // ranks_per_node
    intra = None
    for n in range(nodes):
        group = dist.new_group(list(range(n * ranks_per_node, (n + 1) * ranks_per_node)))
        if n == rank // ranks_per_node:
            intra = group
    leaders = dist.new_group([n * ranks_per_node for n in range(nodes)])
    node = rank // ranks_per_node
    return NodeGroups(node=node, ranks_per_node=ranks_per_node, num_nodes=nodes, intra=intra, leaders=leaders,
                      leader=node * ranks_per_node)


class HierarchicalState:
    """The hook's state: the node groups and, on leaders, the inter-node ``CompressionState``.

    ``bytes_inter`` counts what this rank sent to other nodes (leaders only: the
    inter-node state's ``bytes_sent``); ``bytes_intra`` what it sent within its
    node (the reduce onto the leader and the broadcast back, each counted at a ring's (n-1)/n of the buffer).
    """

    def __init__(self, module: torch.nn.Module, config: Any, groups: NodeGroups) -> None:
        if not isinstance(groups, NodeGroups):
            raise field_error("groups", type(groups).__name__, "be the NodeGroups of node_groups(...)")
        self.groups = groups
        # on a leader, the inter-node exchange's state; on the others one that never exchanges, so that every
        # rank holds a CompressionState (monitors read it, checkpoints gather it from every rank alike)
        self.inter = CompressionState(module, config, process_group=groups.leaders if groups.is_leader else None)
        self.bytes_intra = 0

    @property
    def bytes_sent(self) -> int:
        """Everything this rank sent for the gradients, within its node and to other nodes (``wire_count.py``)."""
        return self.bytes_intra + self.bytes_inter

    @property
    def bytes_inter(self) -> int:
        """Bytes this rank sent to other nodes (0 unless it leads its node)."""
        return self.inter.bytes_sent if self.groups.is_leader else 0


def hierarchical_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: node sum, compressed exchange among node leaders, broadcast.

    1. **within the node**, an uncompressed reduce (sum) of the bucket onto the
       node's leader (its first rank), over the fast link;
    2. **across nodes**, each leader exchanges the node sum with the other
       leaders through ``compression_hook`` on a ``CompressionState`` over the
       leaders' group: per-layer methods, error feedback, warm-up and, for
       ``adaptive``, the controller measure and price the inter-node link only,
       since only leaders are in that group;
    3. **within the node**, the leader broadcasts the result; every rank divides
       by the ranks per node, so all ranks hold ``sum / world``.

    Only step 2 crosses nodes: every node's uplink carries ``2 (N-1)/N`` of the
    *compressed* bucket from one rank, where a flat exchange carries that of every
    rank's share.  On NCCL the three steps are chained on their collectives'
    futures and the hook returns at once; on gloo and every other backend each
    runs to completion inside the hook (``exchange.overlaps``, decided on the
    node's group).
    """
    buffer = bucket.buffer()
    return run_steps(_hierarchical_steps(state, bucket, buffer), state.groups.intra, buffer.device)


def _hierarchical_steps(state: HierarchicalState, bucket: dist.GradBucket, buffer: torch.Tensor) -> Steps[torch.Tensor]:
    """The hook's three steps, each a collective's future; the bucket's buffer holding ``sum / world``."""
    groups = state.groups
    local = groups.ranks_per_node
    if local > 1:
        # the node's sum on its leader, over the fast link (half an allreduce's traffic: the broadcast below
        # overwrites whatever the others' buffers hold after it)
        yield dist.reduce(buffer, dst=groups.leader, group=groups.intra, async_op=True).get_future()
        state.bytes_intra += (local - 1) * buffer.numel() * buffer.element_size() // local
    if groups.num_nodes > 1 and groups.is_leader:
        # the leaders' mean of node sums (compression_hook divides by the leaders' count), in place
        yield compression_hook(state.inter, bucket)
    if local > 1:
        yield dist.broadcast(buffer, src=groups.leader, group=groups.intra, async_op=True).get_future()
        state.bytes_intra += buffer.numel() * buffer.element_size() * (local - 1) // local
    buffer.div_(local)  # sum / world = (mean over nodes of node sums) / ranks per node
    return buffer
