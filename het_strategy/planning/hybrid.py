"""Hybrid search: which devices form which pipelines, in which stage order.

A *unit* is a tensor-parallel group: ``tp`` devices of one class (same cost
key, same node).  A pipeline is an ordered sequence of units; a structure is a
set of disjoint pipelines (devices may stay idle).  Pipelines may differ in
length and device types, and the same layer range may run on different device
types in different pipelines (Sailor's mixed stages, HexiScale's asymmetric
pipelines).  ``structure.assemble_plan`` finishes every structure (micro-batch
sizes, exact layer splits, batch shares).

Two search regimes:

1. **Exhaustive** (small clusters): every structure up to the symmetry of
   interchangeable devices, in order of decreasing compute, with a bound
   ``step >= B / sum(unit rates)`` pruning structures that cannot beat the best.
   Used when the number of pipeline templates stays under ``_EXHAUSTIVE_TEMPLATES``.
2. **Families** (large clusters): per device type, homogeneous pipelines of
   ``S`` units (each of ``tp`` devices, filled node by node); per type the
   best few (tp, S) options alone are kept, then every combination across
   types (a type may also stay idle) is assembled and the best kept.  Types
   whose units cannot hold the model in any pipeline of their own are paired
   with the type of most memory (a mixed pipeline, in both stage orders).

Tuning: ``train.max_stages`` bounds pipeline length; ``train.max_tp`` bounds
tensor parallelism (the plain DDP runtime needs 1); ``train.micro_batch_sizes``
is the micro-batch menu.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

from het_strategy.core.cost_model import CostModel
from het_strategy.planning.structure import Slots, StructureResult, assemble_plan

__all__ = ["plan_hybrid", "device_classes", "DeviceClass"]

_EXHAUSTIVE_TEMPLATES = 400
_EXHAUSTIVE_STRUCTURES = 20000
_FAMILY_OPTIONS_PER_TYPE = 2
_FAMILY_POST_ROUNDS = 3


@dataclass(frozen=True)
class DeviceClass:
    """Interchangeable devices: same cost key, same node."""

    key: tuple
    node: str
    devices: tuple[str, ...]


def device_classes(cm: CostModel) -> list[DeviceClass]:
    groups: dict[tuple, list[str]] = {}
    for d in cm.cluster.devices:
        groups.setdefault((cm.device_key(d), d.node), []).append(d.name)
    return [DeviceClass(k, n, tuple(v)) for (k, n), v in groups.items()]


def _tp_options(cm: CostModel, count: int) -> list[int]:
    return [t for t in (1, 2, 4, 8) if t <= cm.settings.max_tp and t <= count]


def _unit_rate(cm: CostModel, device_name: str, tp: int) -> float:
    """Samples/s a unit would reach computing the whole model alone (memory ignored): an upper bound."""
    m = max(cm.settings.micro_batch_sizes)
    t = float(cm.replicated_compute_prefix(cm.cluster.device(device_name), tp, m)[-1])
    return m / t if t > 0 else math.inf


# -- exhaustive ---------------------------------------------------------------------------------

def _templates(unit_types: list[tuple[int, int]], counts: list[int], max_len: int) -> list[tuple[int, ...]]:
    """All sequences of unit-type indices whose device use fits the class counts."""
    out: list[tuple[int, ...]] = []

    def rec(seq: list[int], left: list[int]) -> None:
        if seq:
            out.append(tuple(seq))
            if len(out) > _EXHAUSTIVE_TEMPLATES:
                return
        if len(seq) == max_len:
            return
        for u, (cls, tp) in enumerate(unit_types):
            if left[cls] >= tp:
                left[cls] -= tp
                seq.append(u)
                rec(seq, left)
                seq.pop()
                left[cls] += tp

    rec([], list(counts))
    return out


def _structures(templates: list[tuple[int, ...]], unit_types: list[tuple[int, int]], counts: list[int]
                ) -> Iterator[list[tuple[int, ...]]]:
    """Multisets of templates (non-decreasing index) whose joint device use fits."""
    usage = []
    for t in templates:
        use = [0] * len(counts)
        for u in t:
            cls, tp = unit_types[u]
            use[cls] += tp
        usage.append(use)

    def rec(start: int, chosen: list[int], left: list[int]) -> Iterator[list[tuple[int, ...]]]:
        if chosen:
            yield [templates[i] for i in chosen]
        for i in range(start, len(templates)):
            use = usage[i]
            if all(u <= l for u, l in zip(use, left)):
                chosen.append(i)
                yield from rec(i, chosen, [l - u for l, u in zip(left, use)])
                chosen.pop()

    yield from rec(0, [], list(counts))


def _exhaustive(cm: CostModel, classes: list[DeviceClass]) -> StructureResult | None | bool:
    """Best over all structures; False when the space is too large for this regime."""
    unit_types = [(c, tp) for c, cls in enumerate(classes) for tp in _tp_options(cm, len(cls.devices))]
    counts = [len(c.devices) for c in classes]
    max_len = min(cm.settings.max_stages, cm.workload.num_layers)
    templates = _templates(unit_types, counts, max_len)
    if len(templates) > _EXHAUSTIVE_TEMPLATES:
        return False
    rates = [_unit_rate(cm, classes[c].devices[0], tp) for c, tp in unit_types]
    best: StructureResult | None = None
    seen = 0
    for struct in _structures(templates, unit_types, counts):
        seen += 1
        if seen > _EXHAUSTIVE_STRUCTURES:
            return False if best is None else best
        bound = cm.settings.global_batch_size / sum(rates[u] for t in struct for u in t)
        if best is not None and bound >= best.step_time_s:
            continue
        res = assemble_plan(cm, _realise(struct, unit_types, classes), "hybrid",
                            cutoff=best.step_time_s if best else math.inf)
        if res is not None and (best is None or res.step_time_s < best.step_time_s):
            best = res
    return best


def _realise(struct: list[tuple[int, ...]], unit_types: list[tuple[int, int]], classes: list[DeviceClass]
             ) -> list[Slots]:
    """Give each unit concrete device names, in class order."""
    pools = [list(c.devices) for c in classes]
    out = []
    for template in struct:
        slots = []
        for u in template:
            cls, tp = unit_types[u]
            slots.append(tuple(pools[cls][:tp]))
            del pools[cls][:tp]
        out.append(tuple(slots))
    return out


# -- families -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _TypePool:
    key: tuple
    by_node: tuple[tuple[str, ...], ...]  # this type's devices, grouped by node

    @property
    def count(self) -> int:
        return sum(len(n) for n in self.by_node)

    def units(self, tp: int) -> list[tuple[str, ...]]:
        """tp-groups inside nodes, node by node (leftover devices of a node stay idle)."""
        out = []
        for devs in self.by_node:
            out.extend(tuple(devs[i:i + tp]) for i in range(0, len(devs) - tp + 1, tp))
        return out


def _type_pools(cm: CostModel) -> list[_TypePool]:
    by_key: dict[tuple, dict[str, list[str]]] = {}
    for d in cm.cluster.devices:
        by_key.setdefault(cm.device_key(d), {}).setdefault(d.node, []).append(d.name)
    return [_TypePool(k, tuple(tuple(v) for v in nodes.values())) for k, nodes in by_key.items()]


def _homogeneous(pool: _TypePool, tp: int, stages: int) -> list[Slots]:
    units = pool.units(tp)
    return [tuple(units[i:i + stages]) for i in range(0, len(units) - stages + 1, stages)]


def _stage_counts(cm: CostModel, num_units: int) -> list[int]:
    top = min(num_units, cm.settings.max_stages, cm.workload.num_layers)
    cands = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, top}
    return sorted(s for s in cands if 1 <= s <= top)


def _families(cm: CostModel) -> StructureResult | None:
    pools = _type_pools(cm)
    options: list[list[list[Slots]]] = []
    for pool in pools:
        scored: list[tuple[float, list[Slots]]] = []
        for tp in _tp_options(cm, max(len(n) for n in pool.by_node)):
            n_units = len(pool.units(tp))
            for stages in _stage_counts(cm, n_units):
                struct = _homogeneous(pool, tp, stages)
                if not struct or cm.settings.global_batch_size < len(struct):
                    continue
                res = assemble_plan(cm, struct, "hybrid", post_rounds=_FAMILY_POST_ROUNDS, exact_in_flight=False)
                if res is not None:
                    scored.append((res.step_time_s, struct))
        scored.sort(key=lambda x: x[0])
        options.append([s for _, s in scored[:_FAMILY_OPTIONS_PER_TYPE]])
    options = _add_mixed_options(cm, pools, options)
    best: StructureResult | None = None
    for combo in itertools.product(*[opts + [[]] for opts in options]):
        struct = [p for part in combo for p in part]
        used = devices_in(struct)
        if not struct or len(set(used)) != len(used):  # a mixed option shares the roomy type's devices
            continue
        res = assemble_plan(cm, struct, "hybrid", cutoff=best.step_time_s if best else math.inf,
                            post_rounds=_FAMILY_POST_ROUNDS, exact_in_flight=False)
        if res is not None and (best is None or res.step_time_s < best.step_time_s):
            best = res
    return best


def _add_mixed_options(cm: CostModel, pools: list[_TypePool], options: list[list[list[Slots]]]
                       ) -> list[list[list[Slots]]]:
    """Types that fit nowhere alone get pipelines that pair their units with the roomiest type's."""
    stranded = [i for i, opts in enumerate(options) if not opts]
    if not stranded:
        return options
    roomy = max(range(len(pools)), key=lambda i: cm.cluster.device(pools[i].by_node[0][0]).memory_gb)
    for i in stranded:
        if i == roomy:
            continue
        mine, theirs = pools[i].units(1), pools[roomy].units(1)
        for k_mine in _stage_counts(cm, len(mine)):
            for k_theirs in (1, 2, 4):
                n_pipes = min(len(mine) // k_mine, len(theirs) // k_theirs)
                if n_pipes == 0 or k_mine + k_theirs > cm.settings.max_stages:
                    continue
                for mine_first in (True, False):
                    struct = []
                    for p in range(n_pipes):
                        a = mine[p * k_mine:(p + 1) * k_mine]
                        b = theirs[p * k_theirs:(p + 1) * k_theirs]
                        struct.append(tuple(a + b) if mine_first else tuple(b + a))
                    if cm.settings.global_batch_size >= len(struct) and assemble_plan(
                            cm, struct, "hybrid", post_rounds=_FAMILY_POST_ROUNDS, exact_in_flight=False):
                        options[i].append(struct)
        # a mixed pipeline uses the roomy type's devices too: such options replace the roomy type's own
        options[i] = options[i][:_FAMILY_OPTIONS_PER_TYPE]
    return options


def plan_hybrid(cm: CostModel) -> StructureResult | None:
    """Best plan over the hybrid space (see module docstring for the two regimes)."""
    classes = device_classes(cm)
    if cm.cluster.num_devices <= 8:
        res = _exhaustive(cm, classes)
        if res is not False:
            return res  # type: ignore[return-value]
    return _families(cm)


def devices_in(structure: Sequence[Slots]) -> list[str]:
    return [d for slots in structure for slot in slots for d in slot]
