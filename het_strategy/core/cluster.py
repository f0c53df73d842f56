"""Clusters: devices grouped into nodes, the links between them, and the YAML form that describes them.

A device's datasheet figures and list price come from the catalog (``catalog.py``)
and one device entry is parsed in ``device_spec.py`` (import their names from there).  A cluster YAML (schema: docs/guide/cluster-schema.md) is loaded into ``ClusterSpec``; every
field is checked on construction and a bad one raises ``ConfigError`` naming
the field, the value and the rule.  Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from het_strategy.core.catalog import DeviceType
from het_strategy.core.device_spec import DEVICE_KEYS, DeviceSpec, device_from_dict, resolve_device_type
from het_strategy.core.cluster_limits import bounded_figure as _figure, check_count, check_figure, check_name, \
    check_yaml_tree, devices_per_node as _devices_per_node
from het_strategy.core.plain_data import plain
from het_strategy.core.errors import ConfigError, check_keys, field_error, is_positive, require_int, require_number
from het_strategy.core.files import naming_file, read_yaml_file
from het_strategy.core.shipped import config_file

__all__ = [
    "NodeSpec",
    "LinkSpec",
    "Slowdown",
    "ClusterSpec",
    "CLUSTER_KEYS",
    "load_cluster",
    "cluster_from_dict",
]


@dataclass(frozen=True)
class NodeSpec:
    """A host: devices that share a fast local link."""

    name: str
    """Unique node name."""
    devices: tuple[DeviceSpec, ...]
    """Its devices, in rank order."""
    intra_bandwidth_gbs: float
    """Device-to-device bandwidth inside the node, GB/s."""
    inter_bandwidth_gbs: float | None = None
    """The node's network interface to other nodes, GB/s, shared by the flows that leave it at the same time
    (None: the cluster's ``inter_node_bandwidth_gbs``, filled in by ClusterSpec)."""
    inter_flow_bandwidth_gbs: float | None = None
    """What one flow alone reaches to another node, GB/s (None: the whole interface)."""

    def __post_init__(self) -> None:
        if not self.devices:
            raise field_error(f"node `{self.name}`.devices", [], "list at least one device")
        if not is_positive(self.intra_bandwidth_gbs):
            raise field_error(f"node `{self.name}`.intra_bandwidth_gbs", self.intra_bandwidth_gbs, "be > 0 (GB/s)")
        if self.inter_bandwidth_gbs is None:
            return  # ClusterSpec fills both figures in
        if not is_positive(self.inter_bandwidth_gbs):
            raise field_error(f"node `{self.name}`.inter_bandwidth_gbs", self.inter_bandwidth_gbs, "be > 0 (GB/s)")
        if self.inter_flow_bandwidth_gbs is None:
            object.__setattr__(self, "inter_flow_bandwidth_gbs", self.inter_bandwidth_gbs)
        elif not is_positive(self.inter_flow_bandwidth_gbs) or self.inter_flow_bandwidth_gbs > self.inter_bandwidth_gbs:
            raise field_error(f"node `{self.name}`.inter_flow_bandwidth_gbs", self.inter_flow_bandwidth_gbs,
                              f"be > 0 and <= the node's inter_bandwidth_gbs ({self.inter_bandwidth_gbs:g}) (GB/s)")


@dataclass(frozen=True)
class LinkSpec:
    """Bandwidth between two specific nodes, overriding the cluster's inter-node figure."""

    nodes: tuple[str, str]
    """The two node names."""
    bandwidth_gbs: float
    """Bandwidth between them, GB/s."""


@dataclass(frozen=True)
class Slowdown:
    """An emulated device running ``factor`` times slower from ``start_step`` until ``end_step`` (exclusive)."""

    device: str
    """Device name."""
    factor: float
    """Compute-time multiplier while active (3.0: three times slower; 0.5: twice as fast)."""
    start_step: int
    """First optimizer step it applies to."""
    end_step: int | None = None
    """First step it no longer applies to; None: until the end of the run."""

    def active(self, step: int) -> bool:
        return step >= self.start_step and (self.end_step is None or step < self.end_step)


@dataclass(frozen=True)
class ClusterSpec:
    """Devices grouped into nodes, with intra- and inter-node bandwidth."""

    name: str
    """Cluster name (file stem for shipped clusters)."""
    nodes: tuple[NodeSpec, ...]
    """Nodes in rank order; ranks are numbered through them."""
    inter_node_bandwidth_gbs: float
    """Default bandwidth between two devices on different nodes, GB/s."""
    links: tuple[LinkSpec, ...] = ()
    """Per-node-pair overrides of ``inter_node_bandwidth_gbs``."""
    latency_us: float = 10.0
    """Per-message latency added to every transfer, microseconds."""
    slowdowns: tuple[Slowdown, ...] = ()
    """Scheduled slowdowns of emulated devices (tests and benchmarks of straggler handling)."""
    emulation_noise: float = 0.0
    """Emulated compute time varies by a uniform factor in [1 - noise, 1 + noise] per step (0: none)."""

    def __post_init__(self) -> None:
        if not self.nodes:
            raise field_error("cluster.nodes", [], "list at least one node")
        if not is_positive(self.inter_node_bandwidth_gbs):
            raise field_error("cluster.inter_node_bandwidth_gbs", self.inter_node_bandwidth_gbs, "be > 0 (GB/s)")
        if any(n.inter_bandwidth_gbs is None for n in self.nodes):
            object.__setattr__(self, "nodes", tuple(
                n if n.inter_bandwidth_gbs is not None else dataclasses.replace(
                    n, inter_bandwidth_gbs=max(self.inter_node_bandwidth_gbs, n.inter_flow_bandwidth_gbs or 0.0))
                for n in self.nodes))
        if not (isinstance(self.latency_us, (int, float)) and self.latency_us >= 0):
            raise field_error("cluster.latency_us", self.latency_us, "be >= 0 (microseconds)")
        _require_unique([(f"cluster.nodes[{i}].name", n.name) for i, n in enumerate(self.nodes)])
        _require_unique([(f"cluster.nodes[{i}].devices[{j}].name", d.name)
                         for i, n in enumerate(self.nodes) for j, d in enumerate(n.devices)])
        node_names = {n.name for n in self.nodes}
        for i, link in enumerate(self.links):
            for nm in link.nodes:
                if nm not in node_names:
                    raise field_error(f"cluster.links[{i}].nodes", list(link.nodes), "name nodes of this cluster",
                                      f"known: {sorted(node_names)}")
            if not is_positive(link.bandwidth_gbs):
                raise field_error(f"cluster.links[{i}].bandwidth_gbs", link.bandwidth_gbs, "be > 0 (GB/s)")
        emulated = {d.name for d in self.devices if d.emulated_speed is not None}
        for i, sd in enumerate(self.slowdowns):
            where = f"cluster.slowdowns[{i}]"
            if sd.device not in emulated:
                raise field_error(f"{where}.device", sd.device, "name an emulated device of this cluster "
                                  "(one with emulated_speed)", f"emulated: {sorted(emulated) or 'none'}")
            if not is_positive(sd.factor):
                raise field_error(f"{where}.factor", sd.factor, "be > 0 (compute-time multiplier)")
            if not isinstance(sd.start_step, int) or sd.start_step < 0:
                raise field_error(f"{where}.start_step", sd.start_step, "be an integer >= 0")
            if sd.end_step is not None and (not isinstance(sd.end_step, int) or sd.end_step <= sd.start_step):
                raise field_error(f"{where}.end_step", sd.end_step, f"be an integer > start_step ({sd.start_step})")
        if not (isinstance(self.emulation_noise, (int, float)) and 0 <= self.emulation_noise < 1):
            raise field_error("cluster.emulation_noise", self.emulation_noise, "be in [0, 1) (a fraction of the step time)")
        object.__setattr__(self, "_by_name", {d.name: d for d in self.devices})
        object.__setattr__(self, "_nodes_by_name", {n.name: n for n in self.nodes})
        object.__setattr__(self, "_pair_bw", {frozenset(l.nodes): l.bandwidth_gbs for l in self.links})

    # -- lookups ---------------------------------------------------------------------------
    @functools.cached_property
    def devices(self) -> tuple[DeviceSpec, ...]:
        """All devices in rank order."""
        return tuple(d for n in self.nodes for d in n.devices)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @functools.cached_property
    def device_types(self) -> tuple[str, ...]:
        """Distinct device type names, in first-seen order."""
        return tuple(dict.fromkeys(d.type for d in self.devices))

    def device(self, name: str) -> DeviceSpec:
        try:
            return self._by_name[name]  # type: ignore[attr-defined]
        except KeyError:
            raise ConfigError(f"device `{name}` is not in cluster `{self.name}`", field="device", value=name) from None

    def node(self, name: str) -> NodeSpec:
        found = self._nodes_by_name.get(name)  # type: ignore[attr-defined]
        if found is not None:
            return found
        raise ConfigError(f"node `{name}` is not in cluster `{self.name}`", field="node", value=name)

    def node_bandwidth_gbs(self, node_a: str, node_b: str) -> float:
        """GB/s between two nodes (the node's own link when they are the same)."""
        if node_a == node_b:
            return self.node(node_a).intra_bandwidth_gbs
        a, b = self.node(node_a), self.node(node_b)
        lone = min(a.inter_flow_bandwidth_gbs, b.inter_flow_bandwidth_gbs)  # type: ignore[type-var]
        return min(lone, self._pair_bw.get(frozenset((node_a, node_b)), lone))  # type: ignore[attr-defined]

    def pair_link_gbs(self, node_a: str, node_b: str) -> float | None:
        """GB/s of an explicit ``links`` entry between two nodes, or None."""
        return self._pair_bw.get(frozenset((node_a, node_b)))  # type: ignore[attr-defined]

    def bandwidth(self, dev_a: str, dev_b: str) -> float:
        """Bytes/s between two devices: a lone flow's peak (``network.Network`` prices real transfers)."""
        a, b = self.device(dev_a), self.device(dev_b)
        return self.node_bandwidth_gbs(a.node, b.node) * 1e9

    def min_bandwidth(self, device_names: list[str] | tuple[str, ...]) -> float:
        """Bytes/s of the slowest link among a group of devices (inf for one device)."""
        nodes = list(dict.fromkeys(self.device(d).node for d in device_names))
        if len(device_names) <= 1:
            return math.inf
        if len(nodes) == 1:
            return self.node(nodes[0]).intra_bandwidth_gbs * 1e9
        return min(self.node_bandwidth_gbs(a, b) for i, a in enumerate(nodes) for b in nodes[i + 1:]) * 1e9

    def min_node_set_bandwidth_gbs(self, nodes_a: set[str], nodes_b: set[str]) -> float:
        """GB/s of the slowest link between any node of ``nodes_a`` and any of ``nodes_b``."""
        if self.links:
            return min(self.node_bandwidth_gbs(a, b) for a in nodes_a for b in nodes_b)
        best = min((self.node(n).intra_bandwidth_gbs for n in nodes_a & nodes_b), default=math.inf)
        if not (len(nodes_a) == 1 and nodes_a == nodes_b) and (nodes_a | nodes_b) != (nodes_a & nodes_b) or \
                len(nodes_a & nodes_b) > 1:
            best = min(best, self.inter_node_bandwidth_gbs)
        return best

    def slowdown_factor(self, device_name: str, step: int) -> float:
        """The product of the scheduled slowdown factors of ``device_name`` active at ``step``."""
        factor = 1.0
        for sd in self.slowdowns:
            if sd.device == device_name and sd.active(step):
                factor *= sd.factor
        return factor

    def without_emulation(self) -> "ClusterSpec":
        """The same cluster with every emulation setting dropped: speeds, scheduled slowdowns, noise."""
        return dataclasses.replace(
            self, slowdowns=(), emulation_noise=0.0,
            nodes=tuple(dataclasses.replace(n, devices=tuple(dataclasses.replace(d, emulated_speed=None)
                                                             for d in n.devices)) for n in self.nodes))

    def to_dict(self) -> dict[str, Any]:
        """The explicit YAML form (every device listed with resolved figures)."""
        extra: dict[str, Any] = {}
        if self.slowdowns:
            extra["slowdowns"] = [{k: v for k, v in sd.__dict__.items() if v is not None} for sd in self.slowdowns]
        if self.emulation_noise:
            extra["emulation_noise"] = self.emulation_noise
        return extra | {
            "name": self.name,
            "inter_node_bandwidth_gbs": self.inter_node_bandwidth_gbs,
            "latency_us": self.latency_us,
            "links": [{"nodes": list(l.nodes), "bandwidth_gbs": l.bandwidth_gbs} for l in self.links],
            "nodes": [
                {
                    "name": n.name,
                    "intra_bandwidth_gbs": n.intra_bandwidth_gbs,
                    "inter_bandwidth_gbs": n.inter_bandwidth_gbs,
                    "inter_flow_bandwidth_gbs": n.inter_flow_bandwidth_gbs,
                    "devices": [
                        {k: v for k, v in {
                            "name": d.name, "type": d.type, "tflops": dict(d.tflops), "memory_gb": d.memory_gb,
                            "memory_bandwidth_gbs": d.memory_bandwidth_gbs, "efficiency": d.efficiency,
                            "emulated_speed": d.emulated_speed, "price_per_hour": d.price_per_hour,
                            "codec_gbs": d.codec_gbs}.items()
                            if v is not None}
                        for d in n.devices
                    ],
                }
                for n in self.nodes
            ],
        }


# -- loading ----------------------------------------------------------------------------------

CLUSTER_KEYS = {"name", "nodes", "inter_node_bandwidth_gbs", "links", "latency_us", "description", "slowdowns",
                 "emulation_noise"}
"""The keys a cluster mapping (a cluster YAML file's top level) may hold."""
_SLOWDOWN_KEYS = {"device", "factor", "start_step", "end_step"}
_NODE_KEYS = {"name", "devices", "intra_bandwidth_gbs", "inter_bandwidth_gbs", "inter_flow_bandwidth_gbs", "count"}
_LINK_KEYS = {"nodes", "bandwidth_gbs"}


def load_cluster(source: str | Path | Mapping[str, Any] | ClusterSpec) -> ClusterSpec:
    """Load a cluster from a shipped name, a YAML path, a mapping, or pass a ClusterSpec through.

    A file is read with ``files.read_yaml_file`` (a directory, pipe, unreadable, empty or malformed file is one
    ConfigError naming ``cluster``), and an error in its content names the file.
    """
    if isinstance(source, ClusterSpec):
        return source
    if isinstance(source, Mapping):
        return cluster_from_dict(source)
    path, raw = read_yaml_file(config_file("cluster", source), "cluster", "cluster YAML file")
    with naming_file(path, "cluster file"):
        return cluster_from_dict({"name": path.stem, **raw})


def cluster_from_dict(raw: Mapping[str, Any]) -> ClusterSpec:
    """Build a ClusterSpec from the YAML schema of docs/guide/cluster-schema.md (an OmegaConf node works too)."""
    check_yaml_tree(raw, "the cluster")
    raw = plain(raw)
    check_keys(raw, CLUSTER_KEYS, "cluster")
    name = check_name(raw.get("name", "cluster"), "cluster.name")
    nodes_raw = raw.get("nodes")
    if not isinstance(nodes_raw, list) or not nodes_raw:
        raise field_error("cluster.nodes", nodes_raw, "be a non-empty list of nodes")
    inter = _figure(raw.get("inter_node_bandwidth_gbs", 12.5), "cluster.inter_node_bandwidth_gbs", "bandwidth_gbs")
    nodes: list[NodeSpec] = []
    node_fields: list[str] = []  # the YAML path of each built node's name (a `count` repeats one entry)
    for i, node_raw in enumerate(nodes_raw):
        where = f"cluster.nodes[{i}]"
        if not isinstance(node_raw, Mapping):
            raise field_error(where, node_raw, "be a mapping with `devices`")
        check_keys(node_raw, _NODE_KEYS, where)
        per_node = _devices_per_node(node_raw, where, sum(len(n.devices) for n in nodes))
        repeat = check_count(node_raw.get("count", 1), f"{where}.count", sum(len(n.devices) for n in nodes), per_node)
        base = check_name(node_raw.get("name", f"node{i}"), f"{where}.name")
        for r in range(repeat):
            node_name = base if repeat == 1 else f"{base}{r}"
            nodes.append(_node_from_dict(node_raw, node_name, where, inter))
            node_fields.append(f"{where}.name")
    _require_unique(list(zip(node_fields, (n.name for n in nodes))))
    _require_unique(_device_name_fields(nodes_raw, nodes))
    links = []
    for lwhere, link_raw in _entries(raw, "links", _LINK_KEYS, "`nodes` and `bandwidth_gbs`"):
        pair = link_raw.get("nodes")
        if not isinstance(pair, list) or len(pair) != 2:
            raise field_error(f"{lwhere}.nodes", pair, "be a list of two node names")
        links.append(LinkSpec((check_name(pair[0], f"{lwhere}.nodes[0]"), check_name(pair[1], f"{lwhere}.nodes[1]")),
                              _figure(link_raw.get("bandwidth_gbs"), f"{lwhere}.bandwidth_gbs", "bandwidth_gbs")))
    latency = check_figure(require_number(raw.get("latency_us", 10.0), "cluster.latency_us", allow_zero=True),
                           "cluster.latency_us", "latency_us")
    slowdowns = []
    for swhere, sd_raw in _entries(raw, "slowdowns", _SLOWDOWN_KEYS, "device, factor, start_step[, end_step]"):
        for key in ("device", "factor", "start_step"):
            if key not in sd_raw:
                raise field_error(f"{swhere}.{key}", None, "be given")
        end = sd_raw.get("end_step")
        slowdowns.append(Slowdown(str(sd_raw["device"]), require_number(sd_raw["factor"], f"{swhere}.factor"),
                                  require_int(sd_raw["start_step"], f"{swhere}.start_step", minimum=0),
                                  None if end is None else require_int(end, f"{swhere}.end_step", minimum=1)))
    noise = require_number(raw.get("emulation_noise", 0.0), "cluster.emulation_noise", allow_zero=True)
    return ClusterSpec(name=name, nodes=tuple(nodes), inter_node_bandwidth_gbs=inter, links=tuple(links),
                       latency_us=latency, slowdowns=tuple(slowdowns), emulation_noise=noise)


def _entries(raw: Mapping[str, Any], key: str, allowed: set[str], shape: str) -> Iterator[tuple[str, Mapping]]:
    """``(cluster.<key>[i], entry)`` of a list section whose entries are mappings of ``allowed`` keys."""
    for i, entry in enumerate(raw.get(key) or []):
        where = f"cluster.{key}[{i}]"
        if not isinstance(entry, Mapping):
            raise field_error(where, entry, f"be a mapping with {shape}")
        check_keys(entry, allowed, where)
        yield where, entry


def _node_from_dict(node_raw: Mapping[str, Any], node_name: str, where: str, inter_default: float) -> NodeSpec:
    devs_raw = node_raw.get("devices")
    if not isinstance(devs_raw, list) or not devs_raw:
        raise field_error(f"{where}.devices", devs_raw, "be a non-empty list of devices")
    devices: list[DeviceSpec] = []
    first_type: DeviceType | None = None
    for j, dev_raw in enumerate(devs_raw):
        dwhere = f"{where}.devices[{j}]"
        if isinstance(dev_raw, str):
            dev_raw = {"type": dev_raw}
        if not isinstance(dev_raw, Mapping):
            raise field_error(dwhere, dev_raw, "be a device type name or a mapping with `type`")
        check_keys(dev_raw, DEVICE_KEYS, dwhere)
        count = require_int(dev_raw.get("count", 1), f"{dwhere}.count", minimum=1)  # bounded: _devices_per_node
        catalog_type = resolve_device_type(dev_raw, dwhere)
        first_type = first_type or catalog_type
        for _ in range(count):
            idx = len(devices)
            name = check_name(dev_raw["name"], f"{dwhere}.name") if count == 1 and "name" in dev_raw \
                else f"{node_name}/{idx}"
            devices.append(device_from_dict(dev_raw, name, node_name, catalog_type, dwhere))
    if "intra_bandwidth_gbs" in node_raw:
        intra = _figure(node_raw["intra_bandwidth_gbs"], f"{where}.intra_bandwidth_gbs", "bandwidth_gbs")
    elif first_type is not None:
        intra = first_type.intra_node_bandwidth_gbs
    else:
        raise field_error(f"{where}.intra_bandwidth_gbs", None, "be given when the node's devices are not in the catalog")
    nic = _figure(node_raw.get("inter_bandwidth_gbs", inter_default), f"{where}.inter_bandwidth_gbs", "bandwidth_gbs")
    flow = node_raw.get("inter_flow_bandwidth_gbs")
    if flow is not None:
        flow = _figure(flow, f"{where}.inter_flow_bandwidth_gbs", "bandwidth_gbs")
        if flow > nic:
            raise field_error(f"{where}.inter_flow_bandwidth_gbs", flow,
                              f"be <= the node's inter_bandwidth_gbs ({nic:g}): one flow cannot exceed the interface")
    return NodeSpec(name=node_name, devices=tuple(devices), intra_bandwidth_gbs=intra, inter_bandwidth_gbs=nic,
                    inter_flow_bandwidth_gbs=flow)


def _device_name_fields(nodes_raw: list[Any], nodes: list[NodeSpec]) -> list[tuple[str, str]]:
    """``(YAML path, name)`` of every built device: an explicit ``name`` is named by its entry's path, a
    generated one (``node/idx``) by its node's."""
    out: list[tuple[str, str]] = []
    built = iter(nodes)
    for i, node_raw in enumerate(nodes_raw):
        for _ in range(node_raw.get("count", 1)):
            node = next(built)
            entries = [(j, dev) for j, dev in enumerate(node_raw["devices"])
                       for _ in range(dev.get("count", 1) if isinstance(dev, Mapping) else 1)]
            out.extend((f"cluster.nodes[{i}].devices[{j}].name", d.name) for (j, _), d in zip(entries, node.devices))
    return out


def _require_unique(named: list[tuple[str, str]]) -> None:
    """Refuse a name used twice: ``named`` holds ``(field, name)`` pairs; the error names both fields."""
    seen: dict[str, str] = {}
    for field_name, n in named:
        if n in seen:
            raise field_error(field_name, n, f"be unique (`{seen[n]}` has the same name)")
        seen[n] = field_name
