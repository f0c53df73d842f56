"""What moving bytes costs: pipeline sends, gradient allreduces and tensor-parallel allreduces.

The cost model asks this module, and only this module, how long a transfer takes, so the link model is in
one place; the ring allreduce's rule (``ring_steps``, ``ring_allreduce_bytes``, ``ring_allreduce_time_s``) is
written here once and read by the codecs, the comm hooks' byte counts, the link probe and Sailor's simulator.

Links: inside a node, devices talk over the node's ``intra_bandwidth_gbs``.  Across nodes, each node has an
interface of ``inter_bandwidth_gbs`` that every flow leaving it *at the same time* shares, and one flow alone
reaches at most ``inter_flow_bandwidth_gbs``.  A flow between nodes a and b, one of ``f_a`` (``f_b``)
concurrent flows of its node, gets

    min(flow_cap_a, flow_cap_b, nic_a / f_a, nic_b / f_b, link_ab / max(f_a, f_b))

(``link_ab``: an explicit ``links`` entry for the pair).  Every message pays the cluster's ``latency_us``
once; a subclass may make the bandwidth a function of the message size (Sailor's measured fits:
``reference.sailor_profiles.SailorNetwork``).

Gradients are reduced in one ring per group, its members ordered node by node as NCCL builds it, so a
ring runs at its slowest edge: ``t = 2(n-1) x (alpha + S / n / b_slowest)``, where ``b_slowest`` is the
node's link inside one node, else the smallest inter-node flow share among the ring's nodes
(``SyncRoute.flows`` counts the rings crossing each interface).  A Megatron activation allreduce among
the ``tp`` devices of a group is the same ring over the node's link at ``TP_LINK_EFFICIENCY`` of its peak.
The docs' cost-model page ("Communication") gives the measurements behind these figures.

Planning core: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from het_strategy.core.cluster import ClusterSpec

__all__ = ["NodeTuple", "SyncRoute", "Network", "NO_SYNC", "TP_LINK_EFFICIENCY", "BLOCK_TP_ALLREDUCES", "routes",
           "ring_steps", "ring_allreduce_bytes", "ring_allreduce_time_s"]

TP_LINK_EFFICIENCY = 0.36
"""Fraction of the node link's peak that a blocking Megatron activation allreduce reaches.

Measured, not assumed: over the 74 (gpu, tp, micro-batch) points of Sailor's OPT-350
profiles with a tp-1 reference (A100, V100, GH200, RTX-2080/3090, Titan-RTX), the
allreduce bandwidth a block's tp > 1 time implies — ``(t_tp - t_1 / tp) / 4`` per
allreduce — over the intra-node fit's peak has median 0.36 (spread 0.1-1.3; PCIe
and NVLink nodes alike).  ``reference.sailor_profiles.measured_tp_link_efficiency``
recomputes it from the data, and a test keeps the two together.
"""


BLOCK_TP_ALLREDUCES = 2
"""A transformer block's output all-reduces per pass (forward or backward) in a Megatron tp group: one after the
attention's row-parallel projection, one after the MLP's (``Network.tp_allreduce_s`` each)."""


def ring_steps(members: int) -> int:
    """Steps of a ring allreduce among ``members`` ranks: ``members - 1`` of reduce-scatter and as many of
    all-gather, each moving ``1 / members`` of the buffer over every ring edge at once."""
    return 2 * (members - 1)


def ring_allreduce_bytes(num_bytes: int, world: int) -> int:
    """Bytes one rank sends in a ring allreduce of ``num_bytes`` over ``world`` ranks (``ring_steps`` chunks of
    ``1 / world`` of the tensor: ``2 (W-1)/W`` of it)."""
    return ring_steps(world) * int(num_bytes) // world


def ring_allreduce_time_s(num_bytes: Any, members: int, bandwidth: Any, latency_s: float) -> Any:
    """Seconds of a ring allreduce of ``num_bytes`` (a number or an array) among ``members`` at the slowest edge's
    ``bandwidth`` (bytes/s): ``ring_steps`` messages of ``num_bytes / members``, each paying ``latency_s``."""
    return ring_steps(members) * (latency_s + num_bytes / members / bandwidth)


class NodeTuple(tuple):
    """A tuple that computes its hash once.  The routes of one structure share one ``NodeTuple`` of a ring's
    nodes (``routes``), and the planner hashes routes in its cache keys: a ring over thousands of nodes is
    then hashed once, not on every lookup.  Equal to (and hashed as) the plain tuple of the same items."""

    def __hash__(self) -> int:
        cached = self.__dict__.get("hash")
        if cached is None:
            cached = self.__dict__["hash"] = tuple.__hash__(self)
        return cached


@dataclass(frozen=True)
class SyncRoute:
    """Where one gradient ring runs: its size, its nodes and the rings sharing each node's interface."""

    members: int
    """Ring size: the data-parallel replicas reducing together (1: nothing to reduce)."""
    nodes: tuple[str, ...] = ()
    """Nodes the ring spans, sorted; one node: an intra-node ring."""
    flows: tuple[int, ...] = ()
    """Per node of ``nodes``: rings crossing that node's interface at the same time (this one included)."""
    send_flows: tuple[int, int] = (1, 1)
    """The stage's pipeline send to the next stage: sends leaving the sender's node and entering the
    receiver's node at the same time (every pipeline's boundaries and every tp rank: each rank of a
    tensor-parallel group sends the whole activation, as DeepSpeed's pipeline engine does)."""

    @property
    def inter_node(self) -> bool:
        return len(self.nodes) > 1


_EDGES_KEPT = 1024
"""Routes whose ring edges ``Network`` keeps: a structure's routes share a few node tuples, so this covers every
structure the planner keeps routes of (``structure._ROUTES_KEPT``), without holding every tuple of a search."""

NO_SYNC = SyncRoute(members=1)
"""The route of a stage with no other replica."""


class Network:
    """Prices transfers over a cluster's links (alpha-beta, shared node interfaces)."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster
        self.latency_s = cluster.latency_us * 1e-6
        self._edges: dict[tuple[int, int], tuple[tuple[str, ...], tuple[int, ...], list]] = {}

    def describe(self) -> str:
        """One line for the plan table."""
        return f"alpha-beta links (latency {self.cluster.latency_us:g} us), shared node interfaces"

    # -- link bandwidths (bytes/s) --------------------------------------------------------------
    def intra_bandwidth(self, node: str, group_size: int, message_bytes: Any) -> Any:
        """Bytes/s between devices of ``node`` in a group of ``group_size`` (scalar or array of sizes)."""
        return self.cluster.node(node).intra_bandwidth_gbs * 1e9

    def inter_flow_bandwidth(self, node: str, peer: str, flows: int, peer_flows: int, message_bytes: Any) -> Any:
        """Bytes/s of one flow from ``node`` to ``peer`` with ``flows`` (``peer_flows``) concurrent flows there."""
        a, b = self.cluster.node(node), self.cluster.node(peer)
        gbs = min(a.inter_flow_bandwidth_gbs, b.inter_flow_bandwidth_gbs,
                  a.inter_bandwidth_gbs / flows, b.inter_bandwidth_gbs / peer_flows)
        link = self.cluster.pair_link_gbs(node, peer)
        if link is not None:
            gbs = min(gbs, link / max(flows, peer_flows))
        return gbs * 1e9

    # -- transfers ------------------------------------------------------------------------------
    def send_s(self, num_bytes: float, src_device: str, dst_device: str, flows: tuple[int, int] = (1, 1)) -> float:
        """One point-to-point message between two devices (a pipeline send); across nodes it shares the
        sender's and the receiver's interfaces with ``flows`` concurrent sends."""
        a, b = self.cluster.device(src_device).node, self.cluster.device(dst_device).node
        if a == b:
            bw = self.intra_bandwidth(a, 2, num_bytes)
        else:
            bw = self.inter_flow_bandwidth(a, b, flows[0], flows[1], num_bytes)
        return self.latency_s + num_bytes / bw

    def ring_allreduce_s(self, num_bytes: Any, route: SyncRoute) -> Any:
        """Seconds of a ring allreduce of ``num_bytes`` (a number or an array) along ``route``."""
        n = route.members
        if n <= 1 or not route.nodes:
            return np.zeros_like(num_bytes, dtype=float) if isinstance(num_bytes, np.ndarray) else 0.0
        bw = self.ring_bandwidth(route, self.ring_message_bytes(num_bytes, n))
        out = ring_allreduce_time_s(np.asarray(num_bytes, dtype=float), n, bw, self.latency_s)
        if isinstance(num_bytes, np.ndarray):
            return np.where(num_bytes > 0, out, 0.0)
        return float(out) if num_bytes > 0 else 0.0

    def ring_message_bytes(self, num_bytes: Any, members: int) -> Any:
        """The message size a ring's bandwidth is evaluated at (this alpha-beta model's does not depend on it;
        a measured fit's does)."""
        return num_bytes

    def ring_bandwidth(self, route: SyncRoute, num_bytes: Any) -> Any:
        """Bytes/s of the slowest edge of the ring (the buffer size may set it, for measured fits).

        Nodes with equal figures and equal flow counts price alike, so one pair per
        two such classes is evaluated (a ring over hundreds of nodes stays cheap);
        explicit ``links`` between the ring's nodes are checked one by one.
        """
        if not route.inter_node:
            return self.intra_bandwidth(route.nodes[0], route.members, num_bytes)
        worst: Any = math.inf
        for node, f, peer, pf in self._ring_edges(route):
            worst = np.minimum(worst, self.inter_flow_bandwidth(node, peer, f, pf, num_bytes))
        if self.cluster.links:
            flows = dict(zip(route.nodes, route.flows))
            for link in self.cluster.links:
                a, b = link.nodes
                if a in flows and b in flows:
                    worst = np.minimum(worst, self.inter_flow_bandwidth(a, b, flows[a], flows[b], num_bytes))
        return worst

    def _ring_edges(self, route: SyncRoute) -> list[tuple[str, int, str, int]]:
        """``(node, flows, peer, peer_flows)``: one ring edge per pair of node classes of ``route`` (a class with
        one node pairs only with the others).  Kept per ``(nodes, flows)`` tuple pair, by identity: the routes of
        one structure share those tuples (``routes``), so a plan of thousands of replicas classes its nodes once."""
        key = (id(route.nodes), id(route.flows))
        hit = self._edges.get(key)
        if hit is not None and hit[0] is route.nodes and hit[1] is route.flows:
            return hit[2]
        classes: dict[tuple, list[str]] = {}
        for node, f in zip(route.nodes, route.flows):
            classes.setdefault((self.node_class(node), f), []).append(node)
        reps = [(nodes[0], f, nodes) for (_, f), nodes in classes.items()]
        edges = [(node, f, peer if i != j else same[1], pf)
                 for i, (node, f, same) in enumerate(reps) for j, (peer, pf, _) in enumerate(reps)
                 if i != j or len(same) >= 2]
        if len(self._edges) >= _EDGES_KEPT:  # the oldest routes' tuples are let go (the planner moved on)
            del self._edges[next(iter(self._edges))]
        self._edges[key] = (route.nodes, route.flows, edges)  # the tuples are held, so their ids stay theirs
        return edges

    def node_class(self, node: str) -> tuple:
        """Nodes with equal classes have equal link figures."""
        n = self.cluster.node(node)
        return (n.devices[0].type, n.intra_bandwidth_gbs, n.inter_bandwidth_gbs, n.inter_flow_bandwidth_gbs)

    def tp_allreduce_s(self, num_bytes: float, node: str, tp: int) -> float:
        """One Megatron activation allreduce among the ``tp`` devices of a tensor-parallel group in ``node``."""
        if tp <= 1 or num_bytes <= 0:
            return 0.0
        bw = self.intra_bandwidth(node, tp, num_bytes) * TP_LINK_EFFICIENCY
        return ring_allreduce_time_s(num_bytes, tp, bw, self.latency_s)


def routes(cluster: ClusterSpec, structure: Sequence[Sequence[tuple[str, ...]]]) -> list[list[SyncRoute]]:
    """Per pipeline (a sequence of stage device groups), per stage: its gradient ring's route and its send's sharing.

    A ring is identified by (pipeline length, stage index, tp rank): pipelines
    of one length hold the same layers at the same stage (the planner gives
    identical pipelines one split).  A stage of a pipeline of another length
    reduces with every stage whose relative position overlaps its own, so
    those rings' nodes join.  A node's interface is shared by every ring
    with a member there that leaves the node.  The route depends on the
    plan's structure only, not on the layer split (which keeps the
    planner's search exact).
    """
    node_of = {d.name: d.node for d in cluster.devices}
    sends_out: dict[str, int] = {}
    sends_in: dict[str, int] = {}
    for slots in structure:
        for a, b in zip(slots, slots[1:]):
            for src, dst in zip(a, _cycle(b, len(a))):
                if node_of[src] != node_of[dst]:
                    sends_out[node_of[src]] = sends_out.get(node_of[src], 0) + 1
                    sends_in[node_of[dst]] = sends_in.get(node_of[dst], 0) + 1

    def send_flows(slots: Sequence[tuple[str, ...]], s: int) -> tuple[int, int]:
        if s + 1 >= len(slots):
            return (1, 1)
        return (sends_out.get(node_of[slots[s][0]], 1), sends_in.get(node_of[slots[s + 1][0]], 1))

    if len(structure) <= 1:
        return [[SyncRoute(1, send_flows=send_flows(slots, s)) for s in range(len(slots))]
                for slots in structure]
    members: dict[tuple[int, int, int], set[str]] = {}
    for slots in structure:
        for s, slot in enumerate(slots):
            for r, d in enumerate(slot):
                members.setdefault((len(slots), s, r), set()).add(node_of[d])
    lengths = sorted({len(slots) for slots in structure})
    ring_nodes: dict[tuple[int, int, int], frozenset[str]] = {}
    for key, nodes in members.items():
        S, s, r = key
        joined = set(nodes)
        if len(lengths) > 1:
            for (S2, s2, r2), other in members.items():
                if S2 != S and s2 * S < (s + 1) * S2 and s * S2 < (s2 + 1) * S:  # relative ranges overlap
                    joined |= other
        ring_nodes[key] = frozenset(joined)
    flows: dict[str, int] = {}
    for key, nodes in ring_nodes.items():
        if len(nodes) > 1:
            for n in members[key]:
                flows[n] = flows.get(n, 0) + 1
    dp = len(structure)
    memo: dict[tuple[int, int, int], tuple[tuple[str, ...], tuple[int, ...]]] = {}
    out = []
    for slots in structure:
        stage_routes = []
        for s, slot in enumerate(slots):
            key = (len(slots), s, len(slot))
            hit = memo.get(key)
            if hit is None:
                nodes = frozenset().union(*(ring_nodes[(len(slots), s, r)] for r in range(len(slot))))
                ordered = NodeTuple(sorted(nodes))
                hit = memo[key] = (ordered, NodeTuple(max(1, flows.get(n, 1)) for n in ordered)
                                   if len(ordered) > 1 else ())
            stage_routes.append(SyncRoute(dp, hit[0], hit[1], send_flows(slots, s)))
        out.append(stage_routes)
    return out


def _cycle(devices: Sequence[str], n: int) -> list[str]:
    return [devices[i % len(devices)] for i in range(n)]
