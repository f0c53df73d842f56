"""Which comm hook a ``hetero`` run's compression registers, built once per fit.

``compression.scope="all"`` (the default) is ``compression_hook`` over every rank;
``"inter_node"`` is ``hierarchical_hook``: the cluster's nodes (rank r plays
device r; a node's devices are consecutive ranks, every node the same count)
reduce uncompressed inside, and only their leaders' exchange is compressed.
Either way ``compression_state`` is a ``CompressionState`` on every rank (for
the hierarchical hook, the inter-node one), which the monitors read and the
checkpoint gathers; a restored checkpoint's states are loaded into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from het_strategy.compression import CompressionConfig, CompressionState, compression_hook
from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.errors import field_error
from het_strategy.strategy import checkpoint as ckpt

__all__ = ["CompressionRun", "build_compression", "ranks_per_node"]


@dataclass
class CompressionRun:
    hook: Callable[[Any, Any], Any]
    hook_state: Any
    compression_state: CompressionState


def ranks_per_node(cluster: ClusterSpec, world: int) -> int:
    """The ranks of each node of ``cluster`` (equal for every node, consecutive ranks), or ConfigError."""
    counts: dict[str, int] = {}  # node -> its ranks, in rank order
    for device in cluster.devices[:world]:
        if device.node in counts and device.node != next(reversed(counts)):
            raise field_error("compression.scope", "inter_node", f"go with a cluster whose nodes hold "
                              f"consecutive ranks; node `{device.node}`'s devices are not contiguous")
        counts[device.node] = counts.get(device.node, 0) + 1
    sizes = list(counts.values())
    if len(set(sizes)) != 1:
        raise field_error("compression.scope", "inter_node", f"go with nodes of equal size (cluster "
                          f"`{cluster.name}` has {sizes} ranks per node)", "use scope=all")
    return sizes[0]


def build_compression(model: Any, config: CompressionConfig, cluster: ClusterSpec | None, world: int, rank: int,
                      restored: dict[str, Any] | None) -> CompressionRun:
    """The hook, its state and the ``CompressionState`` of this rank (a collective for ``inter_node``: every rank
    creates the node groups)."""
    if config.scope == "inter_node":
        from het_strategy.compression.hierarchical import HierarchicalState, hierarchical_hook, node_groups

        if cluster is None:
            raise field_error("compression.scope", "inter_node", "go with a known cluster (its nodes)")
        state = HierarchicalState(model, config, node_groups(ranks_per_node(cluster, world)))
        run = CompressionRun(hierarchical_hook, state, state.inter)
    else:
        flat = CompressionState(model, config)
        run = CompressionRun(compression_hook, flat, flat)
    if restored is not None:
        ckpt.restore_compression(run.compression_state, restored["ranks"], world, rank)
    return run
