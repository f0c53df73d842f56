"""Families regime of the hybrid search (large clusters): homogeneous pipeline families, combined.

Per device type (cost key), homogeneous pipelines of ``S`` units of ``tp``
devices each, units filled node by node; per type the best ``OPTIONS_PER_TYPE``
(tp, S) options alone are kept.  Types that fit nowhere alone are paired with
the type of most memory (``_add_mixed_options``); ``mixed_families`` adds
pipelines that chain two types.  Then every combination of the kept options
(a type may also stay idle) is assembled and the best kept.

Both steps visit candidates by a lower bound (``bounds``; memory as this regime assembles, S - s micro-batches
in flight on stage s), so most are never assembled, and the result is the one
assembling all of them gives (up to ties).

* Options of a type: the (tp, S) candidates are taken in increasing full bound
  (routes included), found lazily: a candidate's routes are computed when it is
  reached in route-free order (``BoundCache.floor``) and it is handed out once
  its full bound is <= every unvisited route-free bound (``_best_first``).  They
  are assembled with the ``OPTIONS_PER_TYPE``-th best step so far as cutoff,
  until the next bound reaches it: no option left could be kept.
* Combinations: the same order; each is assembled with the best step as cutoff
  until the next bound reaches the best step.

The assembly runs 3 post rounds with a fixed in-flight memory
(``exact_in_flight=False``): this regime is a heuristic over a restricted
space.  (``mixed_families`` assembles its own candidates, with its own budget.)
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from het_strategy.core.cost_model import CostModel
from het_strategy.planning.bound_cache import BoundCache
from het_strategy.planning.bounds import PipelineBound, counted_structure_bound
from het_strategy.planning.mixed_families import mixed_family_options
from het_strategy.planning.structure import Slots, StructureResult, assemble_plan, structure_routes

__all__ = ["plan_families", "TypePool", "type_pools", "OPTIONS_PER_TYPE", "POST_ROUNDS"]

OPTIONS_PER_TYPE = 2
POST_ROUNDS = 3


@dataclass(frozen=True)
class TypePool:
    """One device type's devices, grouped by node."""

    key: tuple
    by_node: tuple[tuple[str, ...], ...]

    @property
    def count(self) -> int:
        return sum(len(n) for n in self.by_node)

    def units(self, tp: int) -> list[tuple[str, ...]]:
        """tp-groups inside nodes, node by node (leftover devices of a node stay idle)."""
        out = []
        for devs in self.by_node:
            out.extend(tuple(devs[i:i + tp]) for i in range(0, len(devs) - tp + 1, tp))
        return out


def type_pools(cm: CostModel) -> list[TypePool]:
    """One pool per device key; within it, the nodes holding most of its devices first (cluster order on a tie),
    so a pipeline cut from the pool's units keeps its stages within a node where one node can hold them."""
    by_key: dict[tuple, dict[str, list[str]]] = {}
    for d in cm.cluster.devices:
        by_key.setdefault(cm.device_key(d), {}).setdefault(d.node, []).append(d.name)
    return [TypePool(k, tuple(tuple(v) for v in sorted(nodes.values(), key=len, reverse=True)))
            for k, nodes in by_key.items()]


def _homogeneous(pool: TypePool, tp: int, stages: int) -> list[Slots]:
    units = pool.units(tp)
    return [tuple(units[i:i + stages]) for i in range(0, len(units) - stages + 1, stages)]


def _stage_counts(cm: CostModel, num_units: int) -> list[int]:
    top = min(num_units, cm.settings.max_stages, cm.workload.num_layers)
    cands = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, top}
    return sorted(s for s in cands if 1 <= s <= top)


class _Bounds:
    """Bounds of structures given as lists of pipelines, by distinct pipeline shape."""

    def __init__(self, cm: CostModel) -> None:
        self.cm = cm
        self.bc = BoundCache(cm, fixed_in_flight=True)  # how this regime assembles
        self._reps: dict[tuple, tuple] = {}
        self._post_floor: dict[int, tuple[object, float]] = {}  # id -> (structure, post bound), from ``full``

    def shapes(self, struct: Sequence[Slots]) -> Counter:
        """How many pipelines of each route-free bound shape (nodes of equal figures are alike)."""
        out: Counter = Counter()
        for slots in struct:
            desc = tuple(self.bc.slot(slot) for slot in slots)
            shape = self.bc.floor_shape(desc)
            self._reps.setdefault(shape, desc)
            out[shape] += 1
        return out

    def floor(self, shapes: Counter) -> float:
        dp = sum(shapes.values())
        pairs = [(self.bc.floor(self._reps[shape], dp), count) for shape, count in shapes.items()]
        return counted_structure_bound(pairs, self.cm.settings.global_batch_size, self.cm.settings.equal_shares)

    def full(self, struct: Sequence[Slots]) -> float:
        dp = len(struct)
        routes = structure_routes(self.cm, struct)
        found: dict[tuple, list] = {}
        for slots, r in zip(struct, routes):
            shape = tuple(self.bc.slot(slot) for slot in slots)
            # identity of the route parts: the routes of one structure share them (cheap to key on)
            rkey = tuple((x.members, id(x.nodes), id(x.flows), x.send_flows) if hasattr(x, "nodes") else x
                         for x in r)
            entry = found.setdefault((tuple(sl[:2] for sl in shape), rkey), [shape, r, 0])
            entry[2] += 1
        pairs: list[tuple[PipelineBound, int]] = [(self.bc.pipeline(shape, dp, r), n) for shape, r, n in found.values()]
        self._post_floor[id(struct)] = (struct, max((b.post for b, _ in pairs if b.feasible), default=0.0))
        return counted_structure_bound(pairs, self.cm.settings.global_batch_size, self.cm.settings.equal_shares)

    def post_floor(self, struct: Sequence[Slots]) -> float:
        """A lower bound on the post term of ``struct`` (0 unless ``full`` bounded this very structure)."""
        hit = self._post_floor.get(id(struct))
        return hit[1] if hit is not None and hit[0] is struct else 0.0


def _assemble(cm: CostModel, struct: Sequence[Slots], cutoff: float = math.inf,
              bounds: _Bounds | None = None) -> StructureResult | None:
    floor = bounds.post_floor(struct) if bounds is not None else 0.0
    return assemble_plan(cm, struct, "hybrid", cutoff=cutoff, post_rounds=POST_ROUNDS, exact_in_flight=False,
                         post_floor=floor)


def _best_first(cm: CostModel, bounds: _Bounds, cands: list[tuple[float, int, list[Slots]]]
                ) -> Iterator[tuple[float, list[Slots]]]:
    """Candidates (route-free bound, tie-break, structure) in increasing full bound, lazily.

    A candidate's full bound (routes included) is computed when it is reached in
    route-free order; it is handed out once it is <= every unvisited one's
    route-free bound, which makes the order exact without computing every route.
    """
    cands = sorted(cands, key=lambda x: x[:2])
    ready: list[tuple[float, int, list[Slots]]] = []
    pos = 0
    while True:
        nxt = cands[pos][0] if pos < len(cands) else math.inf
        if ready and ready[0][0] <= nxt:
            bound, _, struct = heapq.heappop(ready)
            yield bound, struct
            continue
        if not math.isfinite(nxt):
            return
        _, k, struct = cands[pos]
        pos += 1
        full = bounds.full(struct)
        if math.isfinite(full):
            heapq.heappush(ready, (full, k, struct))


def _best_options(cm: CostModel, bounds: _Bounds, cands: list[list[Slots]], keep: int) -> list[list[Slots]]:
    """The ``keep`` candidates of least assembled step (ascending), visited best bound first."""
    B = cm.settings.global_batch_size
    ranked = [(bounds.floor(bounds.shapes(s)), k, s) for k, s in enumerate(cands) if s and len(s) <= B]
    scored: list[tuple[float, int, list[Slots]]] = []
    for k, (lb, struct) in enumerate(_best_first(cm, bounds, ranked)):
        bar = scored[keep - 1][0] if len(scored) >= keep else math.inf
        if lb >= bar:
            break
        res = _assemble(cm, struct, bar, bounds)
        if res is not None:
            scored.append((res.step_time_s, k, struct))
            scored.sort(key=lambda x: x[:2])
            del scored[keep:]
    return [s for _, _, s in scored]


def _add_mixed_options(cm: CostModel, bounds: _Bounds, pools: list[TypePool], options: list[list[list[Slots]]]
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
                    if len(options[i]) >= OPTIONS_PER_TYPE or cm.settings.global_batch_size < len(struct):
                        continue
                    # a structure no memory bound lets fit is skipped without assembling it
                    if math.isfinite(bounds.floor(bounds.shapes(struct))) and _assemble(cm, struct):
                        options[i].append(struct)
    return options


def _combine(cm: CostModel, bounds: _Bounds, options: list[list[list[Slots]]]) -> StructureResult | None:
    """Best assembled combination of one option (or none) per list, best bound first."""
    combos = []
    shapes = {id(opt): bounds.shapes(opt) for opts in options for opt in opts}
    devices = {id(opt): {d for slots in opt for slot in slots for d in slot} for opts in options for opt in opts}
    for k, combo in enumerate(itertools.product(*[opts + [[]] for opts in options])):
        parts = [part for part in combo if part]
        if not parts or sum(len(devices[id(p)]) for p in parts) != len(set().union(*(devices[id(p)] for p in parts))):
            continue  # a mixed option shares the roomy type's devices
        merged: Counter = Counter()
        for part in parts:
            merged.update(shapes[id(part)])
        combos.append((bounds.floor(merged), k, [p for part in parts for p in part]))
    best: StructureResult | None = None
    for bound, struct in _best_first(cm, bounds, combos):
        if best is not None and bound >= best.step_time_s:
            break
        res = _assemble(cm, struct, best.step_time_s if best else math.inf, bounds)
        if res is not None and (best is None or res.step_time_s < best.step_time_s):
            best = res
    return best


def plan_families(cm: CostModel, tp_options: Callable[[int], list[int]]) -> StructureResult | None:
    """Best plan of the families regime (module docstring); ``tp_options(n)``: tp degrees for n devices a node."""
    bounds = _Bounds(cm)
    pools = type_pools(cm)
    options: list[list[list[Slots]]] = []
    for pool in pools:
        cands = [_homogeneous(pool, tp, stages)
                 for tp in tp_options(max(len(n) for n in pool.by_node))
                 for stages in _stage_counts(cm, len(pool.units(tp)))]
        options.append(_best_options(cm, bounds, cands, OPTIONS_PER_TYPE))
    options = _add_mixed_options(cm, bounds, pools, options)
    preferred = []
    for pool, opts in zip(pools, options):
        allowed = tp_options(max(len(n) for n in pool.by_node))
        best = {len(struct[0][0]) for struct in opts}
        preferred.append(sorted({t for t in allowed if any(t in (b // 2, b, 2 * b) for b in best)}))
    options.append(mixed_family_options(cm, pools, preferred))
    return _combine(cm, bounds, options)
