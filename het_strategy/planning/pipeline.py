"""Layer partition of one pipeline: contiguous, non-uniform ranges by exact DP.

For an ordered list of stage slots (each a tensor-parallel group of devices),
a micro-batch size ``m`` and ``n`` micro-batches, choose boundaries
``0 = b0 < b1 < ... < bS = L`` minimising the 1F1B time

    T = fill + (n - 1) * bottleneck,
    fill = sum_s (t_s + c_s),  bottleneck = max_s max(t_s, c_s)

subject to every stage fitting in its devices' memory (1F1B keeps
min(S - s, n) micro-batches of activations on stage s) and, optionally, every
stage's gradient sync + optimizer update staying under ``post_limit``.

Steps:
1. Build S cost matrices ``cost[s][i][j]`` for layers [i, j) on slot s from the
   cost model's prefix sums (numpy, O(S L^2)); infeasible cells are inf.
2. Min-bottleneck DP gives C* (the smallest achievable bottleneck).
3. For bottleneck caps C >= C*, a min-sum DP gives minfill(C); the pairs
   (C, minfill(C)) form a front, and T(n) = min_C minfill(C) + (n - 1) C.
   With <= 16 layers every distinct stage cost is tried as C (exact); beyond
   that a geometric grid of caps between C* and the bottleneck of the min-fill
   partition is used (the front is convex in practice; the grid is 24 points).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from het_strategy.core.cost_model import CostModel

__all__ = ["Partition", "PartitionFront", "partition_front", "plan_pipeline_stages"]

_EXACT_LAYER_LIMIT = 16
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


_SLOT_CACHES: "weakref.WeakKeyDictionary[CostModel, dict]" = weakref.WeakKeyDictionary()


def _stage_matrices(cm: CostModel, slots: Sequence[tuple[str, ...]], micro_batch: int, in_flight: Sequence[int],
                    dp: int, ring_bw: Sequence[float]) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Per slot: (bottleneck cost, fill cost, post cost) matrices, inf where infeasible or i >= j."""
    cache = _SLOT_CACHES.setdefault(cm, {})
    bott, fill, post = [], [], []
    for s, devices in enumerate(slots):
        dev = cm.cluster.device(devices[0])
        link = cm.cluster.bandwidth(devices[0], slots[s + 1][0]) if s + 1 < len(slots) else None
        key = (cm.device_key(dev), len(devices), micro_batch, in_flight[s], dp, ring_bw[s], link)
        mats = cache.get(key)
        if mats is None:
            nxt = slots[s + 1][0] if s + 1 < len(slots) else None
            mats = cache[key] = _slot_matrices(cm, dev, len(devices), micro_batch, in_flight[s], dp, ring_bw[s],
                                               devices[0], nxt)
        bott.append(mats[0])
        fill.append(mats[1])
        post.append(mats[2])
    return bott, fill, post


def _slot_matrices(cm: CostModel, dev, tp: int, micro_batch: int, in_flight: int, dp: int, ring_bw: float,
                   src: str, nxt: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    L = cm.workload.num_layers
    idx = np.arange(L + 1)
    valid = idx[:, None] < idx[None, :]
    # MoE experts without a placement: each replica runs its own routed tokens
    comp = cm.replicated_compute_prefix(dev, tp, micro_batch)
    c = comp[None, :] - comp[:, None]
    if nxt is not None:
        send_by_stop = np.array([0.0] + [cm.send_s(micro_batch, j - 1, src, nxt) for j in range(1, L + 1)])
        send = np.broadcast_to(send_by_stop[None, :], c.shape)
    else:
        send = np.zeros_like(c)
    mem = cm.memory_matrix(tp, micro_batch, in_flight, dp)
    ok = valid & (mem <= cm.memory_capacity_bytes(dev))
    sync = np.where(valid, cm.post_matrix(dev, tp, dp, ring_bw), np.inf)
    return np.where(ok, np.maximum(c, send), np.inf), np.where(ok, c + send, np.inf), np.where(ok, sync, np.inf)


def _min_bottleneck(bott: list[np.ndarray]) -> float:
    g = np.full(bott[0].shape[0], np.inf)
    g[0] = 0.0
    for b in bott:
        g = np.maximum(g[:, None], b).min(axis=0)
    return float(g[-1])


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


def _describe(bounds: tuple[int, ...], bott: list[np.ndarray], fill: list[np.ndarray], post: list[np.ndarray]
              ) -> Partition:
    pairs = list(zip(bounds, bounds[1:]))
    return Partition(bounds=bounds,
                     fill_s=float(sum(fill[s][i, j] for s, (i, j) in enumerate(pairs))),
                     bottleneck_s=float(max(bott[s][i, j] for s, (i, j) in enumerate(pairs))),
                     post_s=float(max(post[s][i, j] for s, (i, j) in enumerate(pairs))))


def partition_front(cm: CostModel, slots: Sequence[tuple[str, ...]], micro_batch: int, num_micro_batches: int,
                    dp: int, ring_bw: Sequence[float], post_limit: float = math.inf) -> PartitionFront | None:
    """All useful layer splits of a pipeline (see module docstring); None if nothing fits."""
    S = len(slots)
    L = cm.workload.num_layers
    if S > L:
        return None
    in_flight = [min(S - s, num_micro_batches) for s in range(S)]
    bott, fill, post = _stage_matrices(cm, slots, micro_batch, in_flight, dp, ring_bw)
    if math.isfinite(post_limit):
        bott = [np.where(p <= post_limit, b, np.inf) for b, p in zip(bott, post)]
    c_star = _min_bottleneck(bott)
    if not math.isfinite(c_star):
        return None
    loose = _min_fill(bott, fill, math.inf)
    assert loose is not None
    c_loose = _describe(loose[1], bott, fill, post).bottleneck_s
    values = np.unique(np.concatenate([b[np.isfinite(b)] for b in bott]))
    values = values[(values >= c_star) & (values <= c_loose)]
    if L > _EXACT_LAYER_LIMIT and len(values) > _GRID_POINTS:
        ok = math.isfinite(c_loose) and c_loose > c_star > 0
        grid = np.geomspace(c_star, c_loose, _GRID_POINTS) if ok else np.array([c_star])
        values = np.unique(values[np.minimum(np.searchsorted(values, grid), len(values) - 1)])
    front: list[Partition] = []
    best_fill = math.inf
    for cap in values:  # ascending caps: fill can only fall
        res = _min_fill(bott, fill, float(cap))
        if res is None or res[0] >= best_fill - 1e-15:
            continue
        best_fill = res[0]
        front.append(_describe(res[1], bott, fill, post))
    return PartitionFront(tuple(front))


def plan_pipeline_stages(cm: CostModel, slots: Sequence[tuple[str, ...]], micro_batch: int, num_micro_batches: int,
                         dp: int = 1, ring_bw: Sequence[float] | None = None) -> Partition | None:
    """Best layer split of one ordered pipeline for ``num_micro_batches`` micro-batches (None: no fit)."""
    ring = list(ring_bw) if ring_bw is not None else [math.inf] * len(slots)
    front = partition_front(cm, slots, micro_batch, num_micro_batches, dp, ring)
    return None if front is None else front.best(num_micro_batches)

