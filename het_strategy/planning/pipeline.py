"""Layer partition of one pipeline: contiguous, non-uniform ranges by exact DP.

For an ordered list of stage slots (each a tensor-parallel group of devices),
a micro-batch size ``m`` and ``n`` micro-batches, choose boundaries
``0 = b0 < b1 < ... < bS = L`` minimising the 1F1B time

    T = fill + (n - 1) * bottleneck,
    fill = sum_s (t_s + c_s),  bottleneck = max_s (c_{s-1} + t_s + c_s)

(the cost model's ``pipeline_time_s``: blocking sends overlap nothing, so a stage
is busy for the sends at both its boundaries; c_{s-1} depends on the stage's
start, c_s on its stop, so a stage's cost is still a matrix over (start, stop))

subject to every stage fitting in its devices' memory (1F1B keeps
min(S - s, n) micro-batches of activations on stage s) and, optionally, every
stage's gradient sync + optimizer update staying under ``post_limit``.

``partition_front`` gives every useful split as a (bottleneck, fill) front (the
steps there), exact up to ``EXACT_LAYER_LIMIT`` layers; ``plan_pipeline_stages``
the best split for ``n``.  The stage matrices are cached per cost model
(``_SlotCache``), and equal matrices are the same object, so pipelines whose
matrices are equal (other d, other gradient routes, in-flight counts that do not
change what fits) share one front.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from het_strategy.core.cost_model import CostModel
from het_strategy.core.network import NO_SYNC, SyncRoute
from het_strategy.planning.bounds import min_bottleneck

__all__ = ["Partition", "PartitionFront", "partition_front", "plan_pipeline_stages", "stage_matrices",
           "send_key", "EXACT_LAYER_LIMIT"]

_EXACT_LAYER_LIMIT = 16
EXACT_LAYER_LIMIT = _EXACT_LAYER_LIMIT
"""Up to this many layers every distinct stage cost is tried as a bottleneck cap (fronts are exact)."""
_GRID_POINTS = 24


@dataclass(frozen=True)
class Partition:
    """A layer split of one pipeline and its per-micro-batch figures."""

    bounds: tuple[int, ...]
    """Boundaries ``(0, b1, ..., L)``."""
    fill_s: float
    """Sum over stages of compute + send for one micro-batch."""
    bottleneck_s: float
    """Largest per-stage compute or send time for one micro-batch."""
    post_s: float
    """Largest stage gradient sync + optimizer update."""

    def time_s(self, num_micro_batches: int) -> float:
        return self.fill_s + (num_micro_batches - 1) * self.bottleneck_s


@dataclass(frozen=True)
class PartitionFront:
    """Non-dominated (bottleneck, fill) partitions of one pipeline configuration."""

    partitions: tuple[Partition, ...]

    def best(self, num_micro_batches: int) -> Partition:
        return min(self.partitions, key=lambda p: (p.time_s(num_micro_batches), p.post_s))


class _SlotCache:
    """Per cost model: the stage matrices, cached by what each really depends on.

    * the memory mask by (tp, micro-batch, in flight, ZeRO state bytes, capacity),
      deduplicated by content: in-flight counts or d that do not change which
      ranges fit give the very same mask object;
    * (bottleneck, fill) by (device key, tp, micro-batch, mask, send key, incoming send key),
      where a send key is what a pipeline send is priced from (the two nodes' link
      figures, an explicit link between them, the concurrent sends at each end, the
      two groups' sizes);
    * post (sync + update) by (device key, tp, d, route, mask).

    Equal objects let ``partition_front`` share one front between pipelines
    whose matrices are the same (other d, other gradient routes, fewer micro-batches
    in flight where memory does not bind).
    """

    def __init__(self) -> None:
        self.masks: dict[tuple, np.ndarray] = {}
        self.by_content: dict[bytes, np.ndarray] = {}
        self.compute: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self.post: dict[tuple, np.ndarray] = {}
        self.sends: dict[tuple, np.ndarray] = {}
        self.fronts: dict[tuple, tuple] = {}
        self.valid: np.ndarray | None = None


_SLOT_CACHES: "weakref.WeakKeyDictionary[CostModel, _SlotCache]" = weakref.WeakKeyDictionary()


def send_key(cm: CostModel, src: str, dst: str, route) -> tuple:
    """What a pipeline send from ``src`` to ``dst`` is priced from: the nodes' link figures
    (``network.node_class``), an explicit link between them, the concurrent sends at each end."""
    a, b = cm.cluster.device(src).node, cm.cluster.device(dst).node
    flows = route.send_flows if hasattr(route, "send_flows") else (1, 1)
    if a == b:
        return ("intra", cm.network.node_class(a))
    return ("inter", cm.network.node_class(a), cm.network.node_class(b), cm.cluster.pair_link_gbs(a, b), flows)


def _stage_matrices(cm: CostModel, slots: Sequence[tuple[str, ...]], micro_batch: int, in_flight: Sequence[int],
                    dp: int, ring_bw: Sequence) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Per slot: (bottleneck cost, fill cost, post cost) matrices, inf where infeasible or i >= j."""
    cache = _SLOT_CACHES.get(cm)
    if cache is None:
        cache = _SLOT_CACHES[cm] = _SlotCache()
    if cache.valid is None:
        idx = np.arange(cm.workload.num_layers + 1)
        cache.valid = idx[:, None] < idx[None, :]
    state_bytes = cm.settings.state_bytes_per_param(dp)
    bott, fill, post = [], [], []
    in_key, incoming = None, None  # the previous slot's send into this one, by its stop (this slot's start)
    for s, devices in enumerate(slots):
        dev = cm.cluster.device(devices[0])
        dkey, tp = cm.device_key(dev), len(devices)
        capacity = cm.memory_budget_bytes(dev, tp)
        mkey = (tp, micro_batch, in_flight[s], state_bytes, capacity)
        mask = cache.masks.get(mkey)
        if mask is None:
            ok = cache.valid & (cm.memory_matrix(tp, micro_batch, in_flight[s], dp) <= capacity)
            mask = cache.masks[mkey] = cache.by_content.setdefault(ok.tobytes(), ok)
        nxt = slots[s + 1] if s + 1 < len(slots) else None
        # the send's price depends on both groups' sizes (partitioned sends: CostModel.stage_send_s)
        skey = None if nxt is None else (send_key(cm, devices[0], nxt[0], ring_bw[s]), tp, len(nxt))
        ckey = (dkey, tp, micro_batch, id(mask), skey, in_key)
        mats = cache.compute.get(ckey)
        if mats is None:
            mats = cache.compute[ckey] = _compute_matrices(cm, dev, tp, micro_batch, mask, devices, nxt,
                                                           ring_bw[s], skey, incoming, cache)
        in_key = skey
        incoming = None if nxt is None else _sends_by_stop(cm, micro_batch, devices, nxt, ring_bw[s], skey, cache)
        pkey = (dkey, tp, dp, ring_bw[s], id(mask))
        pm = cache.post.get(pkey)
        if pm is None:
            pm = cache.post[pkey] = np.where(mask, cm.post_matrix(dev, tp, dp, ring_bw[s]), np.inf)
        bott.append(mats[0])
        fill.append(mats[1])
        post.append(pm)
    return bott, fill, post


def stage_matrices(cm: CostModel, slots: Sequence[tuple[str, ...]], micro_batch: int, in_flight: Sequence[int],
                   dp: int, routes: Sequence) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Per slot: (bottleneck, fill, post) matrices of one micro-batch of ``micro_batch`` samples over every
    layer range, inf where it does not fit with ``in_flight[s]`` micro-batches in flight (cached objects:
    equal matrices are the same object)."""
    return _stage_matrices(cm, slots, micro_batch, in_flight, dp, routes)


def _sends_by_stop(cm: CostModel, micro_batch: int, src: tuple[str, ...], nxt: tuple[str, ...], route,
                   skey: tuple, cache: _SlotCache) -> np.ndarray:
    """A stage's send to the next (activation + gradient), by the stage's stop layer (0 at stop 0)."""
    hit = cache.sends.get((micro_batch, skey))
    if hit is None:
        stops = range(1, cm.workload.num_layers + 1)
        hit = cache.sends[(micro_batch, skey)] = np.array(
            [0.0] + [cm.stage_send_s(micro_batch, j - 1, src, nxt, route) for j in stops])
    return hit


def _compute_matrices(cm: CostModel, dev, tp: int, micro_batch: int, mask: np.ndarray, src: tuple[str, ...],
                      nxt: tuple[str, ...] | None, route, skey: tuple | None, incoming: np.ndarray | None,
                      cache: _SlotCache) -> tuple[np.ndarray, np.ndarray]:
    """(bottleneck, fill) of layers [i, j) on one slot: compute + the send out at j (+ the send in at i)."""
    # MoE experts without a placement: each replica runs its own routed tokens
    comp = cm.replicated_compute_prefix(dev, tp, micro_batch)
    c = comp[None, :] - comp[:, None]
    fill = c if nxt is None else c + _sends_by_stop(cm, micro_batch, src, nxt, route, skey, cache)[None, :]
    bott = fill if incoming is None else fill + incoming[:, None]
    return np.where(mask, bott, np.inf), np.where(mask, fill, np.inf)


def _min_fill(bott: list[np.ndarray], fill: list[np.ndarray], cap: float) -> tuple[float, tuple[int, ...]] | None:
    """Min-sum partition with every stage's bottleneck cost <= cap."""
    n = fill[0].shape[0]
    f = np.full(n, np.inf)
    f[0] = 0.0
    choice = []
    for b, c in zip(bott, fill):
        cost = np.where(b <= cap, c, np.inf)
        total = f[:, None] + cost
        arg = total.argmin(axis=0)
        f = total[arg, np.arange(n)]
        choice.append(arg)
    if not math.isfinite(f[-1]):
        return None
    bounds = [n - 1]
    for arg in reversed(choice):
        bounds.append(int(arg[bounds[-1]]))
    return float(f[-1]), tuple(reversed(bounds))


_CHUNK_CELLS = 1 << 22  # caps x (L+1)^2 cells per vectorised DP step (about 32 MiB of floats)


def _min_fill_many(bott: list[np.ndarray], fill: list[np.ndarray], caps: np.ndarray
                   ) -> list[tuple[float, tuple[int, ...]] | None]:
    """``_min_fill`` for many caps at once, with the same arithmetic per cap.

    One 3-D DP per chunk of caps, laid out (cap, stop j, start i) so the min over i runs along
    contiguous memory; a stage whose matrices repeat an earlier stage's reuses its masked costs.
    """
    n = fill[0].shape[0]
    out: list[tuple[float, tuple[int, ...]] | None] = []
    step = max(1, _CHUNK_CELLS // (n * n))
    for lo in range(0, len(caps), step):
        cap = np.asarray(caps[lo:lo + step], dtype=float)[:, None, None]
        K = cap.shape[0]
        f = np.full((K, n), np.inf)
        f[:, 0] = 0.0
        buf = np.empty((K, n, n))
        masked: dict[tuple[int, int], np.ndarray] = {}
        choice = []
        for b, c in zip(bott, fill):
            cost = masked.get((id(b), id(c)))
            if cost is None:
                cost = masked[(id(b), id(c))] = np.where(np.ascontiguousarray(b.T)[None] <= cap,
                                                         np.ascontiguousarray(c.T)[None], np.inf)
            np.add(cost, f[:, None, :], out=buf)
            arg = buf.argmin(axis=2)
            f = np.take_along_axis(buf, arg[:, :, None], axis=2)[:, :, 0]
            choice.append(arg)
        for k in range(K):
            if not math.isfinite(f[k, -1]):
                out.append(None)
                continue
            bounds = [n - 1]
            for arg in reversed(choice):
                bounds.append(int(arg[k, bounds[-1]]))
            out.append((float(f[k, -1]), tuple(reversed(bounds))))
    return out


_DENSE_LAYERS = 40
"""Up to this many layers the caps run as one 3-D DP (python overhead dominates small matrices); beyond,
one 2-D DP per cap is faster (the 3-D arrays no longer fit in cache)."""


def _describe(bounds: tuple[int, ...], bott: list[np.ndarray], fill: list[np.ndarray], post: list[np.ndarray]
              ) -> Partition:
    pairs = list(zip(bounds, bounds[1:]))
    return Partition(bounds=bounds,
                     fill_s=float(sum(fill[s][i, j] for s, (i, j) in enumerate(pairs))),
                     bottleneck_s=float(max(bott[s][i, j] for s, (i, j) in enumerate(pairs))),
                     post_s=float(max(post[s][i, j] for s, (i, j) in enumerate(pairs))))


def partition_front(cm: CostModel, slots: Sequence[tuple[str, ...]], micro_batch: int, num_micro_batches: int,
                    dp: int, ring_bw: Sequence, post_limit: float = math.inf) -> PartitionFront | None:
    """All useful layer splits of a pipeline (the problem: module docstring); None if nothing fits.

    1. Build S cost matrices ``cost[s][i][j]`` for layers [i, j) on slot s from the cost model's prefix sums
       (numpy, O(S L^2), ``_stage_matrices``); infeasible cells are inf.
    2. Min-bottleneck DP gives C* (the smallest achievable bottleneck).
    3. For bottleneck caps C >= C*, a min-sum DP gives minfill(C); the pairs (C, minfill(C)) form a front, and
       T(n) = min_C minfill(C) + (n - 1) C (``_front_splits``).  With <= ``EXACT_LAYER_LIMIT`` layers every
       distinct stage cost is tried as C (exact); beyond that a geometric grid of caps between C* and the
       bottleneck of the min-fill partition is used (the front is convex in practice; the grid is 24 points).
       Up to ``_DENSE_LAYERS`` layers all caps run as one vectorised DP (``_min_fill_many``: same arithmetic
       and tie-breaking per cap as the one-cap DP); beyond, one DP per cap (the 3-D arrays would not fit in
       cache).

    A front is computed once per distinct set of matrices (``_SlotCache``): pipelines that differ only in d,
    gradient routes, or in-flight counts that do not change what fits share it (``post_s`` is re-read from
    each one's own post matrices).
    """
    S = len(slots)
    L = cm.workload.num_layers
    if S > L:
        return None
    in_flight = [min(S - s, num_micro_batches) for s in range(S)]
    bott, fill, post = _stage_matrices(cm, slots, micro_batch, in_flight, dp, ring_bw)
    # the splits depend on the post matrices only through a finite post_limit: without one, pipelines that
    # differ in d or gradient routes alone share them (post_s is re-read from each one's own matrices)
    limited = math.isfinite(post_limit)
    key = (tuple(map(id, bott)), tuple(map(id, fill)), tuple(map(id, post)) if limited else None, post_limit)
    cache = _SLOT_CACHES[cm].fronts
    splits = cache.get(key)
    if splits is None:
        splits = cache[key] = _front_splits(bott, fill, post, post_limit, L)
    if not splits:
        return None
    return PartitionFront(tuple(Partition(bounds, f, c, float(max(post[s][i, j] for s, (i, j)
                                                                     in enumerate(zip(bounds, bounds[1:])))))
                                for bounds, f, c in splits))


def _front_splits(bott: list[np.ndarray], fill: list[np.ndarray], post: list[np.ndarray], post_limit: float,
                  L: int) -> tuple[tuple[tuple[int, ...], float, float], ...]:
    """(bounds, fill, bottleneck) of the front's splits, ascending bottleneck caps (``partition_front``, steps
    2-3)."""
    if math.isfinite(post_limit):
        bott = [np.where(p <= post_limit, b, np.inf) for b, p in zip(bott, post)]
    c_star = min_bottleneck(bott)
    if not math.isfinite(c_star):
        return ()
    loose = _min_fill(bott, fill, math.inf)
    assert loose is not None
    c_loose = _describe(loose[1], bott, fill, post).bottleneck_s
    values = np.unique(np.concatenate([b[np.isfinite(b)] for b in bott]))
    values = values[(values >= c_star) & (values <= c_loose)]
    if L > _EXACT_LAYER_LIMIT and len(values) > _GRID_POINTS:
        ok = math.isfinite(c_loose) and c_loose > c_star > 0
        grid = np.geomspace(c_star, c_loose, _GRID_POINTS) if ok else np.array([c_star])
        values = np.unique(values[np.minimum(np.searchsorted(values, grid), len(values) - 1)])
    front: list[tuple[tuple[int, ...], float, float]] = []
    best_fill = math.inf
    if L <= _DENSE_LAYERS:
        solved = _min_fill_many(bott, fill, values)
    else:
        solved = [_min_fill(bott, fill, float(cap)) for cap in values]
    for res in solved:  # ascending caps: fill can only fall
        if res is None or res[0] >= best_fill - 1e-15:
            continue
        best_fill = res[0]
        part = _describe(res[1], bott, fill, post)
        front.append((part.bounds, part.fill_s, part.bottleneck_s))
    return tuple(front)


def plan_pipeline_stages(cm: CostModel, slots: Sequence[tuple[str, ...]], micro_batch: int, num_micro_batches: int,
                         dp: int = 1, ring_bw: Sequence[SyncRoute] | None = None) -> Partition | None:
    """Best layer split of one ordered pipeline for ``num_micro_batches`` micro-batches (None: no fit)."""
    ring = list(ring_bw) if ring_bw is not None else [NO_SYNC] * len(slots)
    front = partition_front(cm, slots, micro_batch, num_micro_batches, dp, ring)
    return None if front is None else front.best(num_micro_batches)

