"""The gradient sync of a plan whose replicas differ, priced as the runtime runs it: holder sets, in order.

Where replicas differ in stage boundaries or tensor-parallel degree, no stage has one gradient ring: each part of
each gradient is reduced over the ranks holding it (``core.replica_layout.ReplicaLayout``, the layout the runtime's
``ds_runtime.holder_reduction`` reduces by).  What that costs, step by step as the runtime runs it:

1. **The sets and their bytes** (``holder_reductions``).  Layer ``l``'s split parameters are cut into
   ``units(l)`` units (the largest tp holding ``l``); unit ``k``'s holders are one rank per replica, so a set
   gathers every layer whose unit ``k`` the same ranks hold, ``1 / units(l)`` of each.  Where ``units(l) > 1``,
   ``l``'s replicated parameters (``LayerCost.tp_replicated_params``: norms, row-parallel biases, the embedding
   table) are one more set, every rank holding ``l``, whole.  A tied matrix (tied embeddings) is one more set:
   every rank holding the first or the last layer, the matrix whole.
2. **The order.**  Every rank runs its sets one after another in the one shared order (``holder_sets``); a set
   starts when each of its members has finished the sets before it, so sets without a common rank run at the same
   time and a rank that holds two units (tp 2 beside tp 4) runs its two sets in turn.
3. **The links** (``schedule``).  A set is one ring allreduce (``network.ring_allreduce_time_s``: ``2(n-1)``
   steps of ``1/n`` of its bytes, each paying the latency), the ring over its members' nodes.  While it runs,
   each node's interface is shared by every running set that leaves that node (``network.SyncRoute.flows``), so
   the rates change as sets start and finish: the schedule is a fluid simulation, each set moving its remaining
   bytes at its slowest edge's current share (``Network.ring_bandwidth``).

All sets start after the slowest pipeline (the model's rule: sync is not overlapped with backward).  On tp-1
replicas that share boundaries this gives what ``CostModel.stage_sync_s`` gives per stage (the sets are the stages'
rings, all at once); ``CostModel.score`` uses it where replicas differ (``syncs_by_holder_sets``).  No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from het_strategy.core.network import Network, SyncRoute, ring_steps
from het_strategy.core.plan import Plan
from het_strategy.core.replica_layout import ReplicaLayout
from het_strategy.core.workload import WorkloadSpec

__all__ = ["HolderReduction", "HolderSchedule", "holder_reductions", "schedule", "plan_layout"]


@dataclass(frozen=True)
class HolderReduction:
    """One holder set's flat allreduce."""

    members: tuple[str, ...]
    """Devices holding the part, in rank order."""
    num_bytes: float
    """Bytes each member contributes (the set's flat buffer)."""
    layers: tuple[int, ...]
    """Layers with parts in the set (for the plan table; the tied set lists the first and last)."""


@dataclass(frozen=True)
class HolderSchedule:
    """When each set ran and when each device finished its sync, seconds after the slowest pipeline."""

    reductions: tuple[HolderReduction, ...]
    start_s: tuple[float, ...]
    end_s: tuple[float, ...]
    device_s: dict[str, float]
    """Per device holding a gradient part: the end of its last set."""

    @property
    def sync_s(self) -> float:
        return max(self.device_s.values(), default=0.0)


def plan_layout(plan: Plan, tied: bool) -> tuple[ReplicaLayout, list[str]]:
    """The plan's layout with ranks numbered in plan order (pipeline, stage, tp rank), the order the runtime
    numbers a plan it runs replica by replica (``ds_config.rank_layout``), and the device of each rank."""
    devices: list[str] = []
    groups = []
    for pipe in plan.pipelines:
        stages = []
        for stage in pipe.stages:
            stages.append(tuple(range(len(devices), len(devices) + stage.tp)))
            devices.extend(stage.devices)
        groups.append(tuple(stages))
    parts = tuple(tuple(pipe.boundaries()) for pipe in plan.pipelines)
    layout = ReplicaLayout(stage_groups=tuple(groups), parts=parts, is_aligned=len(set(parts)) == 1,
                           per_replica=True, tied=((0, "tied"),) if tied else ())
    return layout, devices


def holder_reductions(plan: Plan, workload: WorkloadSpec, element_bytes: float) -> list[HolderReduction]:
    """The plan's holder sets in the runtime's order, each with the bytes its members reduce (module, step 1)."""
    tied = workload.layers[-1].tied_params
    layout, device_of = plan_layout(plan, tied > 0)
    by_set: dict[tuple[int, ...], list[float]] = {}
    layers_of: dict[tuple[int, ...], list[int]] = {}
    last = workload.num_layers - 1
    for layer, spec in enumerate(workload.layers):
        dense = spec.params - (tied if layer == last and len(workload.layers) > 1 else 0)
        whole = spec.tp_replicated_params
        if layer == 0 and tied:  # the matrix itself goes in the tied set
            dense, whole = dense - tied, max(0, whole - tied)
        units = layout.units(layer)
        if units > 1 and whole:
            hs = layout.layer_holders(layer)
            by_set.setdefault(hs, []).append(float(whole))
            layers_of.setdefault(hs, []).append(layer)
            dense -= whole
        for unit in range(units):
            hs = layout.unit_holders(layer, unit)
            by_set.setdefault(hs, []).append(dense / units)
            layers_of.setdefault(hs, []).append(layer)
    if tied:
        hs = layout.tied_holders
        by_set.setdefault(hs, []).append(float(tied))
        layers_of.setdefault(hs, []).extend((0, last))
    out = []
    for hs in sorted(by_set):
        if len(hs) > 1:
            out.append(HolderReduction(members=tuple(device_of[r] for r in hs),
                                       num_bytes=sum(by_set[hs]) * element_bytes,
                                       layers=tuple(sorted(set(layers_of[hs])))))
    return out


def schedule(reductions: Sequence[HolderReduction], network: Network) -> HolderSchedule:
    """Run the sets in their shared order over the network (module, steps 2 and 3)."""
    node_of = {d.name: d.node for d in network.cluster.devices}
    n_sets = len(reductions)
    nodes = [tuple(sorted({node_of[d] for d in r.members})) for r in reductions]
    queues: dict[str, list[int]] = {}
    for k, r in enumerate(reductions):
        for d in r.members:
            queues.setdefault(d, []).append(k)
    heads = {d: 0 for d in queues}
    waiting = [len(set(r.members)) for r in reductions]  # members whose queue has not reached the set yet
    for d, q in queues.items():
        waiting[q[0]] -= 1
    start = [math.nan] * n_sets
    end = [math.nan] * n_sets
    latency_left: dict[int, float] = {}
    bytes_left: dict[int, float] = {}
    t = 0.0

    def begin(k: int) -> None:
        n = len(reductions[k].members)
        start[k] = t
        latency_left[k] = ring_steps(n) * network.latency_s
        bytes_left[k] = ring_steps(n) * reductions[k].num_bytes / n  # over the slowest edge

    for k in range(n_sets):
        if waiting[k] == 0:
            begin(k)
    while latency_left or bytes_left:
        moving = [k for k in bytes_left if k not in latency_left]
        flows: dict[str, int] = {}
        for k in moving:
            if len(nodes[k]) > 1:
                for node in nodes[k]:
                    flows[node] = flows.get(node, 0) + 1
        rates = {k: _rate(network, reductions[k], nodes[k], flows) for k in moving}
        step = min([latency_left[k] for k in latency_left] + [bytes_left[k] / rates[k] for k in moving])
        t += step
        done = []
        for k in list(latency_left):
            latency_left[k] -= step
            if latency_left[k] <= 1e-15:
                del latency_left[k]
        for k in moving:
            bytes_left[k] -= rates[k] * step
            if bytes_left[k] <= 1e-9 * max(1.0, reductions[k].num_bytes):
                done.append(k)
        for k in done:
            del bytes_left[k]
            end[k] = t
            for d in set(reductions[k].members):
                heads[d] += 1
                q = queues[d]
                if heads[d] < len(q):
                    nxt = q[heads[d]]
                    waiting[nxt] -= 1
                    if waiting[nxt] == 0:
                        begin(nxt)
    device_s = {d: max(end[k] for k in q) for d, q in queues.items()}
    return HolderSchedule(reductions=tuple(reductions), start_s=tuple(start), end_s=tuple(end), device_s=device_s)


def _rate(network: Network, reduction: HolderReduction, nodes: tuple[str, ...], flows: dict[str, int]) -> float:
    """Bytes/s a running set moves over its slowest edge, with the node interfaces shared as ``flows`` counts."""
    n = len(reduction.members)
    message = network.ring_message_bytes(reduction.num_bytes, n)
    if len(nodes) == 1:
        return float(network.intra_bandwidth(nodes[0], n, message))
    route = SyncRoute(members=n, nodes=nodes, flows=tuple(flows[node] for node in nodes))
    return float(network.ring_bandwidth(route, message))
