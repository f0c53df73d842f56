"""From fixed pipelines (ordered device groups) to a Plan.

Given the pipelines' stage slots, choose each pipeline's micro-batch size,
layer split and share of the global batch so that the step time

    max_p T_p(b_p) + max over devices of (gradient sync + optimizer update)

is smallest.  Every planner mode ends here; they differ only in which
structures they try.

- ``assemble_plan``: the best plan for one structure (the steps there), exact
  for the structure given exact layer-split fronts (``pipeline.partition_front``),
  with an optional ``cutoff`` and ``post_floor`` so a search can stop early;
- ``plan_from_pipelines``: the ``Plan`` of chosen pipelines on the cost model's cluster;
- ``structure_routes``: ``cm.ring_bandwidths`` of the last few structures (the
  searches bound a structure with its routes just before assembling it).

Fronts and a pipeline's best time per share are cached per cost model by the
pipeline's cost signature, so thousands of identical pipelines, and rounds and
structures that share a pipeline shape, cost one front.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Sequence

from het_strategy.core.cost_model import CostModel, bottleneck_s, fill_s
from het_strategy.core.dtypes import Dtype
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.planning.allocation import allocate_min_max
from het_strategy.planning.pipeline import EXACT_LAYER_LIMIT, Partition, partition_front, send_key

__all__ = ["StructureResult", "assemble_plan", "plan_from_pipelines", "structure_routes"]

Slots = tuple[tuple[str, ...], ...]
_MAX_POST_ROUNDS = 12


@dataclass
class StructureResult:
    """The best plan found for one structure and its estimated step time."""

    plan: Plan
    step_time_s: float


class _PipelineOracle:
    """g_p(b) for one pipeline shape: best time on b samples and the split that gives it."""

    def __init__(self, cm: CostModel, slots: Slots, signature: tuple, dp: int, ring_bw: Sequence[float],
                 post_limit: float, fronts: dict, exact_in_flight: bool = True) -> None:
        self.cm = cm
        self.slots = slots
        self.dp = dp
        self.ring_bw = tuple(ring_bw)
        self.post_limit = post_limit
        self._fronts = fronts
        self._exact_in_flight = exact_in_flight
        self._signature = signature
        self._best: dict[int, tuple[float, int, Partition] | None] = {}
        self._costs: dict[tuple, tuple[float, float]] = {}
        self._local_fronts: dict[tuple[int, int], object] = {}

    def _front(self, micro_batch: int, n: int):
        # 1F1B keeps min(S - s, n) micro-batches on stage s: fewer than S micro-batches need less memory.
        # The fast regime always assumes the full S (a plan it finds fits all the more).
        n_class = min(n, len(self.slots)) if self._exact_in_flight else len(self.slots)
        local = (micro_batch, n_class)
        if local not in self._local_fronts:  # small key first: hashing the signature is not free
            key = (self._signature, self.dp, micro_batch, n_class, self.post_limit)
            if key not in self._fronts:
                self._fronts[key] = self._limited(key) or partition_front(
                    self.cm, self.slots, micro_batch, n_class, self.dp, self.ring_bw, self.post_limit)
            self._local_fronts[local] = self._fronts[key]
        return self._local_fronts[local]

    def _limited(self, key: tuple):
        """The unlimited front again, when a post limit removes none of its splits and the front is exact
        (every cap tried, ``pipeline.EXACT_LAYER_LIMIT``): removing dominated splits changes no front."""
        if not math.isfinite(self.post_limit) or self.cm.workload.num_layers > EXACT_LAYER_LIMIT:
            return None
        free = self._fronts.get(key[:-1] + (math.inf,))
        if free is not None and all(p.post_s <= self.post_limit for p in free.partitions):
            return free
        return None

    def _figures(self, bounds: tuple[int, ...], micro_batch: int) -> tuple[float, float]:
        """(fill, bottleneck) of a split at one micro-batch size, as ``pipeline_time_s`` sums them.

        From the cost model's own per-stage costs (``pipeline_cost``); cached here and per cost model
        by the pipeline's signature (the costs depend on nothing else), so rounds and structures share them.
        """
        key = (bounds, micro_batch)
        hit = self._costs.get(key)
        if hit is None:
            gkey = ("figures", self._signature, bounds, micro_batch)
            hit = self._fronts.get(gkey)
            if hit is None:
                pipe = _pipeline(self.slots, bounds, micro_batch, micro_batch)
                costs = self.cm.pipeline_cost(pipe, self.dp, routes=list(self.ring_bw))[1]
                hit = self._fronts[gkey] = (fill_s(costs), bottleneck_s(costs))
            self._costs[key] = hit
        return hit

    def best(self, samples: int) -> tuple[float, int, Partition] | None:
        """(time, micro-batch size, partition) minimising the pipeline's time on ``samples``.

        The time is the cost model's 1F1B formula (``pipeline_time_s``: fill of the first
        micro-batch, then the bottleneck per further one, the last costed at its real size),
        evaluated from cached (fill, bottleneck) pairs in the same arithmetic.
        """
        if samples in self._best:
            return self._best[samples]
        found: tuple[float, int, Partition] | None = None
        sizes = self.cm.settings.micro_batch_sizes
        # sizes above the share add nothing, except the smallest of them: one micro-batch of the whole share
        first_above = min((m for m in sizes if m >= samples), default=None)
        for m in sizes:
            if m > samples and m != first_above:
                continue
            n = math.ceil(samples / m)
            front = self._front(m, n)
            if front is None:
                continue
            last = samples - (n - 1) * m
            for part in front.partitions:
                if n == 1:
                    t = self._figures(part.bounds, last)[0]
                else:
                    fill, bott = self._figures(part.bounds, m)
                    bott_last = bott if last == m else self._figures(part.bounds, last)[1]
                    t = fill + (n - 2) * bott + bott_last
                if found is None or t < found[0] - 1e-15:
                    found = (t, m, part)
        self._best[samples] = found
        return found

    def time_s(self, samples: int) -> float:
        res = self.best(samples)
        return math.inf if res is None else res[0]


def _signature(cm: CostModel, slots: Slots, ring_bw: Sequence[float]) -> tuple:
    """What a pipeline's costs depend on: its stages' device keys and tp, what its sends are priced from
    (the nodes' link figures, ``pipeline.send_key``), and its routes."""
    keys = tuple((cm.device_key(cm.cluster.device(s[0])), len(s)) for s in slots)
    links = tuple(send_key(cm, a[0], b[0], None) for a, b in zip(slots, slots[1:]))
    return keys, links, tuple(ring_bw)


def _pipeline(slots: Slots, bounds: Sequence[int], micro_batch: int, samples: int) -> Pipeline:
    return Pipeline(stages=tuple(Stage(tuple(devs), (bounds[s], bounds[s + 1])) for s, devs in enumerate(slots)),
                    micro_batch_size=micro_batch, samples=samples)


def plan_from_pipelines(cm: CostModel, pipelines: Sequence[Pipeline], mode: str) -> Plan:
    """A Plan for the cost model's cluster, workload and settings."""
    return Plan(cluster=cm.cluster.name, cluster_devices=tuple(d.name for d in cm.cluster.devices),
                model=cm.workload.fingerprint(), global_batch_size=cm.settings.global_batch_size,
                pipelines=tuple(pipelines), zero_stage=cm.settings.zero_stage, dtype=cm.settings.dtype,
                device_dtypes=device_dtypes(cm), mode=mode)


def device_dtypes(cm: CostModel) -> dict[str, Dtype]:
    """Under ``settings.dtype=per_device``: each device's name -> the dtype it computes in (what a plan records
    as ``device_dtypes``); empty for any other dtype."""
    if cm.settings.dtype != Dtype.per_device:
        return {}
    return {d.name: cm.settings.compute_dtype(d) for d in cm.cluster.devices}


_FRONT_CACHES: "weakref.WeakKeyDictionary[CostModel, dict]" = weakref.WeakKeyDictionary()
_ROUTE_CACHES: "weakref.WeakKeyDictionary[CostModel, dict]" = weakref.WeakKeyDictionary()
_ROUTES_KEPT = 64


def structure_routes(cm: CostModel, structure: Sequence[Slots]) -> list:
    """``cm.ring_bandwidths`` of a structure, remembered for the last few structures (the search bounds a
    structure with its routes just before assembling it, and routes of big structures are not free)."""
    cache = _ROUTE_CACHES.setdefault(cm, {})
    key = tuple(structure)
    hit = cache.get(key)
    if hit is None:
        if len(cache) >= _ROUTES_KEPT:
            del cache[next(iter(cache))]
        hit = cache[key] = cm.ring_bandwidths(list(structure))
    return hit


def assemble_plan(cm: CostModel, structure: Sequence[Slots], mode: str, cutoff: float = math.inf,
                  post_rounds: int = _MAX_POST_ROUNDS, exact_in_flight: bool = True,
                  post_floor: float = 0.0) -> StructureResult | None:
    """Best plan for pipelines with these stage slots; None if nothing fits or it can't beat ``cutoff``.

    1. For each pipeline and micro-batch size, the exact layer-split front (``pipeline.partition_front``) —
       cached by the pipeline's cost signature, so thousands of identical pipelines cost one front.
    2. ``g_p(b)`` = the best 1F1B time of pipeline p on b samples over its micro-batch sizes and splits
       (non-decreasing in b), evaluated with the cost model's own pipeline formula (last micro-batch at its
       real size), from the splits' (fill, bottleneck) per micro-batch size, cached per cost model by
       signature: rounds and structures that share a pipeline shape share them.
    3. Batch shares: exact min-max allocation (``allocation.allocate_min_max``), each pipeline at least one
       sample; with ``settings.equal_shares`` every pipeline gets B / dp (runtimes that cannot run uneven
       batches).
    4. Sync/update coupling: the post-step term depends on each stage's layers.  Starting from no limit, the
       stages' post time is capped ever lower (``post_limit`` = current max - epsilon) and steps 1-3 re-run,
       at most ``post_rounds`` times; the pipeline part can only grow as the cap falls, so the loop stops as
       soon as it alone (plus ``post_floor``) exceeds the best step found.  This makes the result exact for
       the structure, given exact fronts.  A front the cap leaves whole (every split of it under the cap,
       exact fronts only) is reused rather than recomputed.

    ``post_floor``: a lower bound on the post term of any plan of this structure (``bounds``); a round
    whose pipeline part plus it cannot beat the best step ends the search early (exact: later rounds
    only raise the pipeline part).
    """
    B = cm.settings.global_batch_size
    dp = len(structure)
    if dp == 0 or B < dp:
        return None
    fronts = _FRONT_CACHES.setdefault(cm, {})
    ring = structure_routes(cm, structure)
    best: StructureResult | None = None
    post_limit = math.inf
    for _ in range(post_rounds):
        oracles = _oracles(cm, structure, dp, ring, post_limit, fronts, exact_in_flight)
        if cm.settings.equal_shares:  # a runtime that gives every replica the same batch
            shares = [B // dp + (1 if p < B % dp else 0) for p in range(dp)]
        else:
            shares = allocate_min_max([o.time_s for o in oracles], B, minimum=[1] * dp)
        if shares is None:
            break
        picks = [o.best(b) for o, b in zip(oracles, shares)]
        if any(p is None for p in picks):
            break
        pipe_time = max(p[0] for p in picks)  # type: ignore[index]
        if pipe_time + post_floor >= min(cutoff, best.step_time_s if best else math.inf):
            break
        pipelines = [_pipeline(slots, part.bounds, m, b)
                     for slots, b, (_, m, part) in zip(structure, shares, picks)]  # type: ignore[misc]
        post = max(part.post_s for _, _, part in picks)  # type: ignore[misc]
        plan = plan_from_pipelines(cm, pipelines, mode)
        step = pipe_time + post
        if cm.syncs_by_holder_sets(plan):  # replicas that differ sync by holder sets: not separable by stage
            step = pipe_time + max(sum(t) for t in cm.post_times_s(plan).values())
        if best is None or step < best.step_time_s:
            best = StructureResult(plan, step)
        if post <= 0 or pipe_time + post_floor >= best.step_time_s:
            break
        post_limit = post * (1 - 1e-9)
    return best


def _oracles(cm: CostModel, structure: Sequence[Slots], dp: int, ring: list[list[float]], post_limit: float,
             fronts: dict, exact_in_flight: bool) -> list[_PipelineOracle]:
    # identical pipelines share one oracle object, so g_p(b) is computed once per shape
    shared: dict[tuple, _PipelineOracle] = {}
    out = []
    for slots, bw in zip(structure, ring):
        memo = ("signature", slots, tuple(bw))  # the per-cost-model cache also holds signatures
        signature = fronts.get(memo)
        if signature is None:
            signature = fronts[memo] = _signature(cm, slots, bw)
        oracle = shared.get(signature)
        if oracle is None:
            oracle = shared[signature] = _PipelineOracle(cm, slots, signature, dp, bw, post_limit, fronts,
                                                         exact_in_flight)
        out.append(oracle)
    return out
