"""What a cluster file may ask for: device and node counts, plausible figures, a finite YAML tree.

A typo can ask for absurd things: ``count: 100000000`` (a hundred million
device specs, built and planned for hours), ``tflops: 1e308`` (every time becomes 0 and
every ratio inf/nan), a YAML alias that contains itself (a structure with no
end).  The loader refuses each with one clear error instead:

* ``MAX_DEVICES`` devices in a cluster at most (every ``count`` is checked
  before anything is built, so no count can make loading slow);
* every figure within ``FIGURE_RANGES`` (far beyond any real device, far from
  float overflow);
* ``check_yaml_tree``: no alias loop, nesting at most ``MAX_YAML_DEPTH`` deep.

Pure Python: no torch.
"""

from __future__ import annotations

from typing import Any, Mapping

from het_strategy.core.errors import ConfigError, field_error, require_int, require_number

__all__ = ["MAX_DEVICES", "MAX_YAML_DEPTH", "FIGURE_RANGES", "check_count", "devices_per_node", "check_figure",
           "bounded_figure", "check_name", "check_yaml_tree"]

MAX_DEVICES = 1_048_576
"""Most devices (and so nodes) one cluster may describe: 2**20, beyond the largest training clusters (about
100k GPUs).  Planning time grows about in proportion to the device count (``benchmarks/plan_scaling.py``'s
cluster: 131,072 devices in about 30 s, 1,000,000 in about 5 minutes on one core), so a typo such as
``count: 100000000`` is refused here rather than planned for hours."""
MAX_YAML_DEPTH = 64
"""Deepest nesting of lists and mappings a cluster file may have."""

FIGURE_RANGES: dict[str, tuple[float, float, str]] = {
    "tflops": (1e-9, 1e5, "TFLOPS"),
    "memory_gb": (1e-3, 1e5, "GiB"),
    "memory_bandwidth_gbs": (1e-3, 1e6, "GB/s"),
    "bandwidth_gbs": (1e-6, 1e6, "GB/s"),
    "latency_us": (0.0, 1e7, "microseconds"),
    "emulated_speed": (1e-6, 1e6, "x relative speed"),
}
"""Accepted range of each kind of figure, ``(lowest, highest, unit)``."""


def check_count(value: Any, field: str, devices_so_far: int, per_unit: int = 1) -> int:
    """A ``count`` (>= 1) that keeps the cluster within ``MAX_DEVICES`` devices, ``per_unit`` devices each."""
    count = require_int(value, field, minimum=1)
    total = devices_so_far + count * per_unit
    if total > MAX_DEVICES:
        raise field_error(field, count, f"keep the cluster within {MAX_DEVICES} devices (het_strategy's limit); "
                          f"it would make {total}", "describe a smaller cluster, or plan a representative part")
    return count


def devices_per_node(node_raw: Mapping[str, Any], where: str, devices_so_far: int) -> int:
    """Devices one copy of a node (its YAML mapping) holds, every device ``count`` bounded before anything is built."""
    total = 0
    devs = node_raw.get("devices")
    for j, dev_raw in enumerate(devs if isinstance(devs, list) else []):
        if isinstance(dev_raw, Mapping) and "count" in dev_raw:
            total += check_count(dev_raw["count"], f"{where}.devices[{j}].count", devices_so_far + total)
        else:
            total += 1
    return max(total, 1)


def bounded_figure(value: Any, field: str, kind: str) -> float:
    """A finite number > 0 within its plausible range (``FIGURE_RANGES[kind]``)."""
    return check_figure(require_number(value, field), field, kind)


def check_figure(value: float, field: str, kind: str) -> float:
    """``value`` (already a finite number) within ``FIGURE_RANGES[kind]``."""
    lo, hi, unit = FIGURE_RANGES[kind]
    if not lo <= value <= hi:
        raise field_error(field, value, f"lie in [{lo:g}, {hi:g}] {unit} (het_strategy's plausible range: "
                          "beyond it times overflow or vanish)")
    return value


def check_name(value: Any, field: str) -> str:
    """A name: a non-empty string (a list or number is a typo in the YAML)."""
    if not isinstance(value, str) or not value.strip():
        raise field_error(field, value, "be a non-empty string (a name)")
    return value


def check_yaml_tree(raw: Any, source: str, field: str = "cluster") -> None:
    """Refuse an alias that contains itself (``nodes: &n [{devices: *n}]``) and absurd nesting; the error
    names ``source`` (the file, in words) and carries ``field``."""
    on_path: dict[int, str] = {}
    done: set[int] = set()  # shared (aliased) parts already walked: walked once, so no alias bomb is slow

    def walk(node: Any, where: str, depth: int) -> None:
        if not isinstance(node, (Mapping, list)) or id(node) in done:
            return
        if id(node) in on_path:
            raise ConfigError(f"{source} has a YAML alias loop: `{where}` is `{on_path[id(node)] or '(the top level)'}` "
                              "again, which contains it (an anchor &name used inside itself through *name); write the nested "
                              "part out instead", field=field, value=source)
        if depth > MAX_YAML_DEPTH:
            raise ConfigError(f"{source} nests lists and mappings more than {MAX_YAML_DEPTH} levels deep "
                              f"(at `{where}`)", field=field, value=source)
        on_path[id(node)] = where
        items = node.items() if isinstance(node, Mapping) else enumerate(node)
        for key, child in items:
            walk(child, (f"{where}.{key}" if where else str(key)) if isinstance(node, Mapping)
                 else f"{where}[{key}]", depth + 1)
        del on_path[id(node)]
        done.add(id(node))

    walk(raw, field, 0)  # paths start at the field the tree was given for: `cluster.nodes[0].devices`
