"""Exhaustive regime of the hybrid search (small clusters): every structure, best bound first.

The space (the one ``benchmarks/plan_optimality.py`` enumerates by brute force):

* a *unit* is (device class, tp) with tp in ``core.train_settings.TP_DEGREES``,
  tp <= ``settings.max_tp`` and <= the class's size (a class: interchangeable
  devices, same cost key and node);
* a *template* is a pipeline: an ordered sequence of 1..min(max_stages, L) units
  whose device use fits the class counts;
* a *structure* is a multiset of templates whose joint use fits (devices may idle);
  devices are given to units in class order (interchangeable, so nothing is lost).

``plan_exhaustive`` bounds every structure before assembling any, with bounds of
three rising strengths, each <= the next <= the assembled step (``bounds``), and
assembles a structure only when its sharpest bound is the least of all left (the
steps: there).  It ends when the smallest bound reaches the best step found, so
the result is the same as assembling every structure.

Budgets are work counts, never wall time, so the result is deterministic:
``MAX_TEMPLATES`` and ``MAX_STRUCTURES`` shrink the space to block templates
(``_space``), ``MAX_ASSEMBLIES`` caps the assemblies.  The outcome says whether it
is exact (full space, search ended by the bound); ``hybrid.plan_hybrid`` runs the
families regime as well when it is not, and keeps the better plan.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from het_strategy.core.cost_model import CostModel
from het_strategy.core.train_settings import TP_DEGREES
from het_strategy.planning.bound_cache import BoundCache
from het_strategy.planning.bounds import curve_structure_bound, structure_bound
from het_strategy.planning.structure import Slots, StructureResult, assemble_plan, structure_routes

__all__ = ["ExhaustiveOutcome", "plan_exhaustive", "MAX_TEMPLATES", "MAX_STRUCTURES", "MAX_ASSEMBLIES"]

MAX_TEMPLATES = 6000
MAX_STRUCTURES = 40000
MAX_ASSEMBLIES = 40
_BISECTIONS = 45
"""Halvings of the compute curves' bracket (``_Space._curve_pipe``): 2^-45 of it, far below any step's spread."""

Unit = tuple[int, int]  # (class index, tp)


@dataclass
class ExhaustiveOutcome:
    """Best structure found, whether that is proven best over the whole space, and the work done."""

    best: StructureResult | None
    exact: bool
    templates: int = 0
    structures: int = 0
    assembled: int = 0
    block_templates: bool = False


def _ordered_templates(units: list[Unit], counts: list[int], max_len: int, cap: int) -> list[tuple[Unit, ...]] | None:
    """Every sequence of units fitting the counts (None when more than ``cap``)."""
    out: list[tuple[Unit, ...]] = []
    left = list(counts)
    seq: list[Unit] = []

    def rec() -> bool:
        if seq:
            out.append(tuple(seq))
            if len(out) > cap:
                return False
        if len(seq) == max_len:
            return True
        for unit in units:
            cls, tp = unit
            if left[cls] >= tp:
                left[cls] -= tp
                seq.append(unit)
                ok = rec()
                seq.pop()
                left[cls] += tp
                if not ok:
                    return False
        return True

    return out if rec() else None


def _block_templates(units: list[Unit], counts: list[int], max_len: int) -> list[tuple[Unit, ...]]:
    """Sequences whose units of one class are contiguous, tp non-increasing within a class's block."""
    tps: dict[int, list[int]] = {}
    for cls, tp in units:
        tps.setdefault(cls, []).append(tp)
    blocks: dict[int, list[tuple[Unit, ...]]] = {}
    for cls, options in tps.items():
        options = sorted(options, reverse=True)
        found: list[tuple[Unit, ...]] = []

        def grow(block: list[Unit], room: int, start: int, cls: int = cls, options: list[int] = options,
                 found: list[tuple[Unit, ...]] = found) -> None:
            if block:
                found.append(tuple(block))
            if len(block) == max_len:
                return
            for k in range(start, len(options)):
                if options[k] <= room:
                    block.append((cls, options[k]))
                    grow(block, room - options[k], k)
                    block.pop()

        grow([], counts[cls], 0)
        blocks[cls] = found
    out: list[tuple[Unit, ...]] = []

    def chain(seq: tuple[Unit, ...], used: frozenset[int]) -> None:
        for cls in blocks:
            if cls in used:
                continue
            for block in blocks[cls]:
                if len(seq) + len(block) <= max_len:
                    out.append(seq + block)
                    chain(seq + block, used | {cls})

    chain((), frozenset())
    return out


def _structures(usage: list[tuple[int, ...]], counts: tuple[int, ...], max_pipelines: int, cap: int
                ) -> Iterator[tuple[int, ...]]:
    """Multisets of template indices (non-decreasing) whose joint use fits; at most ``cap`` of them."""
    fitting: dict[tuple[int, ...], list[int]] = {}
    use = np.array(usage, dtype=int).reshape(len(usage), len(counts))

    def fits(left: tuple[int, ...]) -> list[int]:
        hit = fitting.get(left)
        if hit is None:
            hit = fitting[left] = np.flatnonzero((use <= np.array(left)).all(axis=1)).tolist()
        return hit

    emitted = 0
    chosen: list[int] = []

    def rec(start: int, left: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        nonlocal emitted
        options = fits(left)
        for i in options[bisect.bisect_left(options, start):]:
            chosen.append(i)
            emitted += 1
            yield tuple(chosen)
            if emitted >= cap:
                return
            if len(chosen) < max_pipelines:
                yield from rec(i, tuple(l - u for l, u in zip(left, usage[i])))
                if emitted >= cap:
                    return
            chosen.pop()

    yield from rec(0, counts)


class _Space:
    """Templates with their device use and bound descriptions, and the bound of any structure over them."""

    def __init__(self, cm: CostModel, classes: Sequence, templates: list[tuple[Unit, ...]], bc: BoundCache) -> None:
        self.cm = cm
        self.bc = bc
        slot_of = {}
        for c, cls in enumerate(classes):
            for tp in TP_DEGREES:
                slot_of[(c, tp)] = bc.slot(cls.devices[:1] * tp)
        self.counts = tuple(len(c.devices) for c in classes)
        self.max_dp = max_dp = min(cm.settings.global_batch_size, sum(self.counts))
        alone = {t: bc.floor([slot_of[u] for u in t], max_dp) for t in templates}
        # best single-pipeline bound first: the order structures are enumerated in, and cut at a cap
        self.templates = sorted((t for t in templates if alone[t].feasible), key=lambda t: alone[t].tau)
        self.slots = [tuple(slot_of[u] for u in t) for t in self.templates]
        self.usage = []
        for t in self.templates:
            use = [0] * len(self.counts)
            for cls, tp in t:
                use[cls] += tp
            self.usage.append(tuple(use))
        self._figures: dict[int, np.ndarray] = {}
        self._curves: np.ndarray | None = None

    def _figures_at(self, dp: int, needed: np.ndarray) -> np.ndarray:
        """Per template at d = dp: (1 / tau, phi / tau, phi, post floor); rows of unneeded ones stay nan."""
        fig = self._figures.get(dp)
        if fig is None:
            fig = self._figures[dp] = np.full((len(self.slots), 4), np.nan)
        for i in needed[np.isnan(fig[needed, 0])]:
            b = self.bc.floor(self.slots[i], dp, self.max_dp)
            if not b.feasible:
                fig[i] = (0.0, np.inf, np.inf, np.inf)
            else:
                tau = max(b.tau, 1e-300)
                fig[i] = (1.0 / tau, b.phi / tau, b.phi, b.post)
        return fig

    def _curve_pieces(self) -> np.ndarray:
        """Per template, ``BoundCache.compute_curve``'s pieces (memory as with ``max_dp`` replicas) as rows
        (lo, hi, base, slope), padded with pieces that never apply: shape (templates, pieces, 4)."""
        if self._curves is None:
            curves = [self.bc.compute_curve(slots, self.max_dp) for slots in self.slots]
            width = max((len(c) for c in curves), default=1) or 1
            arr = np.tile(np.array([np.inf, -np.inf, np.inf, 1.0]), (len(curves), width, 1))
            for i, c in enumerate(curves):
                if c:
                    arr[i, :len(c)] = c
            self._curves = arr
        return self._curves

    def _curve_pipe(self, idx: np.ndarray, B: int) -> np.ndarray:
        """Per structure (rows of ``idx``: its templates), the least T at which its pipelines' compute curves let
        them take B samples together (``bounds.curve_structure_bound`` without posts), by bisection on all
        structures at once."""
        lo_b, hi_b, base, slope = np.moveaxis(self._curve_pieces()[idx], -1, 0)  # each (structures, dp, pieces)
        start = base + slope * lo_b  # the least T at which a piece applies

        def samples(T: np.ndarray) -> np.ndarray:
            t = T[:, None, None]
            with np.errstate(invalid="ignore", divide="ignore"):
                take = np.where(slope > 0, np.minimum(hi_b, (t - base) / slope), hi_b)
            return np.where(start <= t, take, 0.0).max(axis=2).sum(axis=1)

        dp = idx.shape[1]
        if self.cm.settings.equal_shares:
            share = B // dp
            inside = (lo_b <= share) & (share <= hi_b)
            return np.where(inside, base + slope * share, np.inf).min(axis=2).max(axis=1)
        low = start.min(axis=2).max(axis=1)  # every pipeline takes at least one sample
        covering = (lo_b <= B) & (B <= hi_b)  # one pipeline alone taking all B samples: an upper bracket
        alone = np.where(covering, base + slope * B, np.inf).min(axis=2).min(axis=1)
        ok = np.isfinite(low) & np.isfinite(alone)
        low, high = np.where(ok, low, 0.0), np.where(ok, np.maximum(low, alone), 0.0)
        for _ in range(_BISECTIONS):  # low: fewer than B samples fit (or every pipeline's first), high: B fit
            mid = (low + high) / 2
            fits = samples(mid) >= B * (1 - 1e-12)
            high, low = np.where(fits, mid, high), np.where(fits, low, mid)
        return np.where(ok, low, np.inf)

    def lb0(self, structs: Sequence[tuple[int, ...]]) -> list[float]:
        """The route-free structure bound (level 0), vectorised: the larger of ``bounds.counted_structure_bound``
        with floors and the compute curves' bound (``_curve_pipe``), plus the largest floor post.

        Floors: each stage's gradient sync on the cheapest route its ring could have (``BoundCache.floor``),
        memory judged with the most ZeRO sharding any structure here can have; figures per template (per
        pipeline prefix, in fact) and d, combined per structure in closed form, so tens of thousands of
        structures cost a fraction of a second.  The curves (``BoundCache.compute_curve``: level 2's pieces with
        each send alone on its link, without routes, one bisection over every structure at once) matter where a
        layer's time per sample falls with the micro-batch (``settings.compute_model=roofline``): there the
        closed form pairs one sample's fill with the largest micro-batch's rate and is loose, the curves are
        not."""
        out = np.full(len(structs), np.inf)
        by_dp: dict[int, list[int]] = {}
        for k, struct in enumerate(structs):
            by_dp.setdefault(len(struct), []).append(k)
        B = self.cm.settings.global_batch_size
        for dp, ks in by_dp.items():
            idx = np.array([structs[k] for k in ks], dtype=int).reshape(len(ks), dp)
            fig = self._figures_at(dp, np.unique(idx))[idx]  # (structures, dp, 4)
            rate, phi_rate, phi, post = fig[..., 0], fig[..., 1], fig[..., 2], fig[..., 3]
            with np.errstate(divide="ignore", invalid="ignore"):
                if self.cm.settings.equal_shares:
                    pipe = (phi + (B // dp - 1) / rate).max(axis=1)
                else:
                    pipe = np.maximum(phi.max(axis=1), (B - dp + phi_rate.sum(axis=1)) / rate.sum(axis=1))
            val = np.maximum(pipe, self._curve_pipe(idx, B)) + post.max(axis=1)
            val[~np.isfinite(val) | (rate <= 0).any(axis=1) | np.isinf(phi_rate).any(axis=1)] = np.inf
            out[ks] = val
        return out.tolist()


def _realise(struct: Sequence[tuple[Unit, ...]], classes: Sequence) -> list[Slots]:
    """Give each unit concrete device names, in class order."""
    pools = [list(c.devices) for c in classes]
    out = []
    for template in struct:
        slots = []
        for cls, tp in template:
            slots.append(tuple(pools[cls][:tp]))
            del pools[cls][:tp]
        out.append(tuple(slots))
    return out


def _space(cm: CostModel, classes: Sequence, units: list[Unit], bc: BoundCache
           ) -> tuple[_Space, list[tuple[int, ...]], bool, bool]:
    """(space, structures, whether the structures are all of the full space, whether templates are blocks).

    More than ``MAX_TEMPLATES`` ordered templates, or more than ``MAX_STRUCTURES`` structures over them: the
    space shrinks to *block* templates, where the units of one class are contiguous (tp non-increasing within
    the block) in every order of the blocks; interleaved orders such as A-B-A are given up.  Past
    ``MAX_TEMPLATES`` block templates (many classes of one or two devices) the shortest are kept; past
    ``MAX_STRUCTURES`` structures, those enumerated first (templates in increasing single-pipeline bound).
    Templates that fit nowhere even alone are dropped before structures are formed (``_Space``).
    """
    counts = [len(c.devices) for c in classes]
    max_len = min(cm.settings.max_stages, cm.workload.num_layers)
    max_pipes = cm.settings.global_batch_size
    ordered = _ordered_templates(units, counts, max_len, MAX_TEMPLATES)
    if ordered is not None:
        space = _Space(cm, classes, ordered, bc)
        structs = list(_structures(space.usage, space.counts, max_pipes, MAX_STRUCTURES + 1))
        if len(structs) <= MAX_STRUCTURES:
            return space, structs, True, False
    blocks = _block_templates(units, counts, max_len)
    if len(blocks) > MAX_TEMPLATES:  # many small classes: keep the shortest pipelines (stable: by length)
        blocks = sorted(blocks, key=len)[:MAX_TEMPLATES]
    space = _Space(cm, classes, blocks, bc)
    structs = list(_structures(space.usage, space.counts, max_pipes, MAX_STRUCTURES))
    return space, structs, False, True


def plan_exhaustive(cm: CostModel, classes: Sequence, units: list[Unit]) -> ExhaustiveOutcome:
    """Best structure over the space (module docstring), best bound first, within the work budgets.

    1. Every structure gets its level-0 bound, route-free (``_Space.lb0``); structures of an infinite bound
       are dropped.
    2. One heap holds (bound, level, structure).  The smallest entry is raised to the next level: level 1
       with the structure's gradient-ring and send routes (``structure_routes``); level 2 per micro-batch
       size, from the layer split's own matrices, sends included, with the memory of S - s micro-batches in
       flight past (S - 1) M samples (``BoundCache.refined``).
    3. An entry at level 2 is assembled (``structure.assemble_plan``, exact for the structure, with the best
       step as cutoff and the structure's post bound as ``post_floor``), at most ``MAX_ASSEMBLIES`` times.
    4. The search ends when the smallest entry reaches the best step: every level is a lower bound on the
       next, so nothing left can beat it.

    On real clusters the level-2 bound is within a few percent of the step, so a handful of structures are
    assembled (timings: docs/how-it-works/planners.md).
    """
    bc = BoundCache(cm)
    space, structs, complete, blocks = _space(cm, classes, units, bc)
    B, equal = cm.settings.global_batch_size, cm.settings.equal_shares
    heap = [(bound, 0, k) for k, bound in enumerate(space.lb0(structs)) if math.isfinite(bound)]
    heapq.heapify(heap)
    realised: dict[int, tuple[list[Slots], list]] = {}
    post_floor: dict[int, float] = {}
    best: StructureResult | None = None
    assembled = 0
    ended_by_bound = True
    while heap:
        bound, level, k = heapq.heappop(heap)
        if best is not None and bound >= best.step_time_s:
            break
        struct = structs[k]
        if level < 2:
            if k not in realised:
                slots = _realise([space.templates[i] for i in struct], classes)
                realised[k] = (slots, structure_routes(cm, slots))
            slots, routes = realised[k]
            if level == 0:
                nxt = structure_bound([bc.pipeline(space.slots[i], len(struct), r) for i, r in zip(struct, routes)],
                                      B, equal)
            else:
                curves = [bc.refined(names, len(struct), r) for names, r in zip(slots, routes)]
                nxt = curve_structure_bound(curves, B, equal)
                post_floor[k] = max(c.post for c in curves)
            if math.isfinite(nxt):
                heapq.heappush(heap, (max(nxt, bound), level + 1, k))
            continue
        if assembled >= MAX_ASSEMBLIES:
            ended_by_bound = False
            break
        assembled += 1
        slots = realised.pop(k)[0]
        res = assemble_plan(cm, slots, "hybrid", cutoff=best.step_time_s if best else math.inf,
                            post_floor=post_floor.pop(k))
        if res is not None and (best is None or res.step_time_s < best.step_time_s):
            best = res
    return ExhaustiveOutcome(best, complete and ended_by_bound, len(space.templates), len(structs), assembled,
                             blocks)
