"""Several emulated nodes on one machine: a network namespace per node, joined by shaped links.

``netshape.py`` shapes one namespace's loopback, which every rank inside shares
like a hub.  A cluster of nodes needs the opposite: ranks of one node talk
fast, ranks of different nodes cross a slow link.  ``emulated_nodes`` builds
that (its docstring has the steps): a namespace per node, joined through a
switch namespace's bridge by veth links whose egress is shaped per node pair
with ``htb``.  It yields ``EmulatedNodes``: ``command(node, argv)`` runs argv
inside a node, ``rank_env(node)`` is what a gloo rank there needs, node i's
address is ``NodeAddress``'s.

Invariants:

- a link is full duplex: each direction of a pair is shaped where it leaves
  its sender, so node 0 -> node 1 and node 1 -> node 0 each get the rate;
- traffic between two ranks of one node goes over the node's loopback, never
  shaped, never counted on ``uplink``; traffic between nodes leaves through
  ``uplink``, and ``uplink_tx_bytes(node)`` counts it (headers included);
- on every exit path (normal, exception, Ctrl-C) what still runs inside is
  ended and every namespace deleted; nothing half-made is left.

Needs root and iproute2's ``ip`` and ``tc`` with ``htb``, ``u32`` and the
``bridge`` and ``veth`` link types (``netem`` is not needed: links have rates,
not delays).
"""

from __future__ import annotations

import ipaddress
import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

from het_strategy.core.errors import field_error
from het_strategy.emulation.netns import NetnsUnavailable, create_namespace, delete_namespace, \
    end_started_processes, failure_reason, iproute_tool, run_iproute
from het_strategy.emulation.netshape import LinkShape, _sigint_deferred

__all__ = ["UPLINK", "MAX_NODES", "NodeAddress", "EmulatedNodes", "emulated_nodes"]

_log = logging.getLogger(__name__)

UPLINK = "uplink"
"""The node side of a node's veth pair: where inter-node traffic leaves and is shaped."""
MAX_NODES = 32
"""Nodes one machine emulates at most (each is a namespace and a veth pair)."""
_SUBNET = ipaddress.ip_network("10.77.0.0/24")
_BRIDGE = "br0"


@dataclass(frozen=True)
class NodeAddress:
    """One emulated node: its namespace and its address on the inter-node network."""

    index: int
    namespace: str
    address: str


class EmulatedNodes:
    """Live nodes made by ``emulated_nodes``; valid only inside that ``with``."""

    def __init__(self, nodes: list[NodeAddress], switch: str, inter_node: LinkShape | None,
                 pairs: Mapping[tuple[int, int], LinkShape]) -> None:
        self.nodes = nodes
        self.switch = switch
        self.inter_node = inter_node
        self.pairs = dict(pairs)
        self.started: list = []
        """Processes ``popen`` started (ended at teardown if still running)."""

    @property
    def master_addr(self) -> str:
        """Node 0's address: ``MASTER_ADDR`` for every rank."""
        return self.nodes[0].address

    def rate(self, a: int, b: int) -> LinkShape | None:
        """The shaping from node a to node b (None: unshaped)."""
        return self.pairs.get((min(a, b), max(a, b)), self.inter_node)

    def command(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside node ``node``'s namespace."""
        return [iproute_tool("ip"), "netns", "exec", self.nodes[node].namespace, *argv]

    def rank_env(self, node: int) -> dict[str, str]:
        """Environment a gloo rank on ``node`` needs: its address is the node's, ``MASTER_ADDR`` node 0's."""
        return {"GLOO_SOCKET_IFNAME": UPLINK, "MASTER_ADDR": self.master_addr}

    def uplink_tx_bytes(self, node: int) -> int:
        """Bytes node ``node`` has sent to other nodes (its ``uplink``'s transmit counter, headers included)."""
        proc = run_iproute([iproute_tool("ip"), "-n", self.nodes[node].namespace, "-s", "-j", "link", "show",
                            UPLINK])
        if proc.returncode != 0:
            raise NetnsUnavailable(f"could not read {UPLINK} counters of node {node}: {failure_reason(proc)}")
        return int(json.loads(proc.stdout)[0]["stats64"]["tx"]["bytes"])


def _check(num_nodes: int, inter_node: LinkShape | None,
           pairs: Mapping[tuple[int, int], LinkShape] | None) -> dict[tuple[int, int], LinkShape]:
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or not 2 <= num_nodes <= MAX_NODES:
        raise field_error("num_nodes", num_nodes, f"be an integer from 2 to {MAX_NODES}")
    if inter_node is not None and not isinstance(inter_node, LinkShape):
        raise field_error("inter_node", inter_node, "be a LinkShape or None (unshaped)")
    checked: dict[tuple[int, int], LinkShape] = {}
    for key, shape in (pairs or {}).items():
        if (not isinstance(key, tuple) or len(key) != 2 or not all(isinstance(i, int) for i in key)
                or key[0] == key[1] or not all(0 <= i < num_nodes for i in key)):
            raise field_error(f"pairs[{key!r}]", shape, f"be keyed by two different node indices in "
                              f"[0, {num_nodes})")
        if not isinstance(shape, LinkShape):
            raise field_error(f"pairs[{key!r}]", shape, "be a LinkShape")
        if shape.delay_ms > 0 or (inter_node is not None and inter_node.delay_ms > 0):
            raise field_error(f"pairs[{key!r}].delay_ms", shape.delay_ms, "be 0 (links are rate-shaped only)")
        checked[(min(key), max(key))] = shape
    if inter_node is not None and inter_node.delay_ms > 0:
        raise field_error("inter_node.delay_ms", inter_node.delay_ms, "be 0 (links are rate-shaped only: this "
                          "kernel has no netem)")
    return checked


def _run(argv: list[str], what: str) -> None:
    proc = run_iproute(argv)
    if proc.returncode != 0:
        raise NetnsUnavailable(f"could not {what}: {failure_reason(proc)}")


_FRAME_BYTES = 1514
"""One Ethernet frame on ``uplink`` (MTU 1500 + header): the shaper sees packets no larger, as on a wire, and
its bucket holds one timer tick of the rate (at least two frames), so a message after an idle spell is not let
through at once."""


def _htb_class(ns_tc: list[str], classid: str, shape: LinkShape) -> None:
    rate = f"{shape.rate_bit_per_s}bit"
    burst = str(max(2 * _FRAME_BYTES, shape.rate_bit_per_s // 8 // 250))
    quantum = str(max(_FRAME_BYTES, min(200_000, shape.rate_bit_per_s // 8 // 10)))
    _run([*ns_tc, "class", "add", "dev", UPLINK, "parent", "1:", "classid", classid, "htb", "rate", rate, "ceil",
          rate, "burst", burst, "cburst", burst, "quantum", quantum], f"add htb class {classid} ({shape.rate_mbit:g} Mbit/s)")


def _shape_uplink(net: EmulatedNodes, node: int) -> None:
    """htb on ``uplink``: the inter-node rate by default, a class per peer whose pair has its own rate."""
    ns = net.nodes[node].namespace
    ns_tc = [iproute_tool("ip"), "netns", "exec", ns, iproute_tool("tc")]
    peers = [(j, net.rate(node, j)) for j in range(len(net.nodes)) if j != node]
    if all(shape is None for _, shape in peers):
        return
    _run([*ns_tc, "qdisc", "add", "dev", UPLINK, "root", "handle", "1:", "htb", "default", "1"],
         f"attach htb to {UPLINK} of node {node}")
    if net.inter_node is not None:
        _htb_class(ns_tc, "1:1", net.inter_node)
    for j, shape in peers:
        if shape is None or (min(node, j), max(node, j)) not in net.pairs:
            continue
        _htb_class(ns_tc, f"1:{10 + j}", shape)
        _run([*ns_tc, "filter", "add", "dev", UPLINK, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match",
              "ip", "dst", f"{net.nodes[j].address}/32", "flowid", f"1:{10 + j}"],
             f"route node {node} -> node {j} traffic to its class")


def _wire(net: EmulatedNodes) -> None:
    ip = iproute_tool("ip")
    switch = net.switch
    _run([ip, "-n", switch, "link", "add", _BRIDGE, "type", "bridge"], "create the switch's bridge")
    _run([ip, "-n", switch, "link", "set", _BRIDGE, "up"], "bring the bridge up")
    prefix = _SUBNET.prefixlen
    for node in net.nodes:
        port = f"n{node.index}"
        _run([ip, "-n", node.namespace, "link", "add", UPLINK, "type", "veth", "peer", "name", port, "netns",
              switch], f"create node {node.index}'s veth pair")
        _run([ip, "-n", switch, "link", "set", port, "master", _BRIDGE], f"attach node {node.index} to the bridge")
        _run([ip, "-n", switch, "link", "set", port, "up"], f"bring port {port} up")
        _run([ip, "-n", node.namespace, "addr", "add", f"{node.address}/{prefix}", "dev", UPLINK],
             f"address node {node.index}")
        _run([ip, "-n", node.namespace, "link", "set", "dev", UPLINK, "gso_max_size", str(_FRAME_BYTES),
              "gso_max_segs", "1"], f"send node {node.index}'s uplink traffic as single frames")
        for dev in ("lo", UPLINK):
            _run([ip, "-n", node.namespace, "link", "set", dev, "up"], f"bring {dev} up in node {node.index}")
    for node in net.nodes:
        _shape_uplink(net, node.index)


@contextmanager
def emulated_nodes(num_nodes: int, inter_node: LinkShape | None,
                   pairs: Mapping[tuple[int, int], LinkShape] | None = None) -> Iterator[EmulatedNodes]:
    """``num_nodes`` namespaces joined through a switch, each node's egress shaped to ``inter_node`` (or, for a
    pair in ``pairs``, that pair's rate); everything is deleted when the block exits, however it exits.

    1. a namespace per node (``het-<pid>-<n>``, as ``netns.create_namespace``
       names them) and one more, the switch, holding a Linux bridge;
    2. a veth pair per node: ``uplink`` inside the node, its peer enslaved to the
       switch's bridge; node i gets the address ``10.77.0.(i+1)/24`` on
       ``uplink`` (``NodeAddress``);
    3. the node's egress on ``uplink`` shaped with an ``htb`` qdisc: a default
       class at the inter-node rate, plus one class per peer node whose pair has
       a rate of its own (a ``u32`` filter on the destination address).  Each
       direction of a pair is shaped where it leaves its sender, so a link is
       full duplex: node 0 -> node 1 and node 1 -> node 0 each get the rate.
       ``uplink`` hands the shaper single frames (no segmentation offload) and
       each class's bucket holds one timer tick of its rate, so every message
       takes its line time, also the first after an idle spell;
    4. yields ``EmulatedNodes``: ``command(node, argv)`` runs argv inside a node,
       ``rank_env(node)`` is what a gloo rank there needs (``GLOO_SOCKET_IFNAME``
       = ``uplink``, so every rank advertises its node's address);
    5. on every exit path (normal, exception, Ctrl-C) ends what still runs inside
       and deletes every namespace; when any step of 1-3 fails, what was made is
       deleted before ``NetnsUnavailable`` is raised.
    """
    checked = _check(num_nodes, inter_node, pairs)
    made: list[str] = []
    net: EmulatedNodes | None = None
    try:
        switch = create_namespace(None)
        made.append(switch)
        nodes = []
        for i in range(num_nodes):
            ns = create_namespace(None)
            made.append(ns)
            nodes.append(NodeAddress(i, ns, str(_SUBNET.network_address + i + 1)))
        net = EmulatedNodes(nodes, switch, inter_node, checked)
        _wire(net)
        _log.debug("node network: %d nodes (%s), inter-node %s%s", num_nodes, ", ".join(n.namespace for n in nodes),
                  f"{inter_node.rate_mbit:g} Mbit/s each way" if inter_node else "unshaped",
                  "".join(f"; {a}<->{b} {s.rate_mbit:g} Mbit/s" for (a, b), s in checked.items()))
        yield net
    finally:
        with _sigint_deferred():
            if net is not None:
                end_started_processes(net.started)
            for ns in reversed(made):
                delete_namespace(ns)
