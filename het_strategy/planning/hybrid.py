"""Hybrid search: which devices form which pipelines, in which stage order.

A *unit* is a tensor-parallel group: ``tp`` devices of one class (``DeviceClass``:
same cost key, same node).  A pipeline is an ordered sequence of units; a
structure is a set of disjoint pipelines (devices may stay idle).  Pipelines may
differ in length and device types, and the same layer range may run on different
device types in different pipelines (Sailor's mixed stages, HexiScale's
asymmetric pipelines).  ``structure.assemble_plan`` finishes every structure
(micro-batch sizes, exact layer splits, batch shares); it is exact for the
structure, and it is the expensive step, so the search spends its effort on
choosing which structures to assemble.

``plan_hybrid`` runs one of two regimes (the steps there): ``exhaustive`` on at
most ``EXHAUSTIVE_DEVICES`` devices, exact over its space within its work
budgets, and ``families`` (with ``mixed_families``) beyond, a heuristic over a
restricted space.  Both order candidates by a lower bound on the step time
(``bounds``) and stop when the next bound reaches the best step found.  Pruning
by a valid bound is exact: the result equals assembling every candidate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from het_strategy.core.cost_model import CostModel
from het_strategy.core.train_settings import TP_DEGREES
from het_strategy.planning.exhaustive import plan_exhaustive
from het_strategy.planning.families import plan_families
from het_strategy.planning.structure import Slots, StructureResult

__all__ = ["plan_hybrid", "device_classes", "DeviceClass", "EXHAUSTIVE_DEVICES"]

EXHAUSTIVE_DEVICES = 8


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
    return [t for t in TP_DEGREES if t <= cm.settings.max_tp and t <= count]


def plan_hybrid(cm: CostModel) -> StructureResult | None:
    """Best plan over the hybrid space, in one of two regimes.

    1. **Exhaustive** (<= ``EXHAUSTIVE_DEVICES`` devices, ``exhaustive.plan_exhaustive``): every structure up
       to the symmetry of interchangeable devices, best bound first.  Work budgets (counts, so results are
       deterministic) cap the templates, structures and assemblies; past them the space shrinks to block
       orders (a class's units contiguous) and the families regime runs too, the better plan kept.  Within
       the budgets the result is exact over the space (``benchmarks/plan_optimality.py`` checks it against
       brute force).
    2. **Families** (larger clusters, ``families.plan_families``): per device type, homogeneous pipelines of
       ``S`` units of ``tp`` devices; per type the best few (tp, S) options are kept, types that fit nowhere
       alone are paired with the roomiest type, ``mixed_families`` adds two-type pipelines, and the best
       combination of options is assembled.  Options and combinations are visited best bound first.

    Both bound a pipeline by its per-sample bottleneck and one sample's pass from small layer-split DPs and
    the smallest post term, and a structure by the exact minimum of its bounded pipelines over every batch
    split.  Assembly (``structure``, ``pipeline``) shares fronts and the splits' costs among every pipeline
    with the same matrices or signature, across rounds and structures.

    Tuning: ``settings.max_stages`` bounds pipeline length; ``settings.max_tp`` bounds tensor parallelism (the
    plain DDP runtime needs 1); ``settings.micro_batch_sizes`` is the micro-batch menu.
    """
    families = lambda: plan_families(cm, lambda count: _tp_options(cm, count))  # noqa: E731
    if cm.cluster.num_devices > EXHAUSTIVE_DEVICES:
        return families()
    classes = device_classes(cm)
    units = [(c, tp) for c, cls in enumerate(classes) for tp in _tp_options(cm, len(cls.devices))]
    out = plan_exhaustive(cm, classes, units)
    if out.exact:
        return out.best
    other = families()
    if out.best is None or (other is not None and other.step_time_s < out.best.step_time_s):
        return other
    return out.best


def devices_in(structure: Sequence[Slots]) -> list[str]:
    return [d for slots in structure for slot in slots for d in slot]
