"""Exact integer min-max allocation, shared by the batch, DP and expert planners.

Problem: give ``total`` indivisible units (samples, experts) to ``n`` workers,
worker i at least ``minimum[i]`` and at most ``cap[i]``, minimising
``max_i cost_i(x_i)`` where every ``cost_i`` is non-decreasing.

Steps:
1. Feasibility of a time T is monotone: worker i can take
   ``count_i(T) = max{x in [min_i, cap_i] : cost_i(x) <= T}`` units (binary
   search over x), and T is feasible when the counts reach ``total``.
2. Bisect T between the largest cost at the minimums and the cost of the
   largest useful counts, to a relative 1e-10: the optimum T* is within it.
3. Take ``count_i(T)`` everywhere and hand back the excess from the workers
   whose last unit costs most (lowest index first among equals); no worker's
   cost rises, so the result's maximum is T* (to that precision).

Workers passed the *same* cost callable with the same bounds are solved once
per group, so thousands of identical pipelines cost what a few do.
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Sequence

__all__ = ["allocate_min_max"]

_REL_TOL = 1e-10


def allocate_min_max(costs: Sequence[Callable[[int], float]], total: int,
                     minimum: Sequence[int] | None = None,
                     cap: Sequence[int | None] | None = None) -> list[int] | None:
    """Counts per worker minimising the largest cost, or None when ``total`` can't be placed."""
    n = len(costs)
    mins = list(minimum) if minimum is not None else [0] * n
    caps = [total if c is None else min(c, total) for c in (cap if cap is not None else [None] * n)]
    if sum(mins) > total or sum(caps) < total or any(c < m for c, m in zip(caps, mins)):
        return None
    groups: dict[tuple, list[int]] = {}
    for i in range(n):
        groups.setdefault((costs[i], mins[i], caps[i]), []).append(i)  # equal callables: one group
    reps = [(costs[idx[0]], mins[idx[0]], caps[idx[0]], idx) for idx in groups.values()]

    def at(cost: Callable[[int], float], x: int) -> float:
        return 0.0 if x == 0 else cost(x)

    lo = max(at(c, m) for c, m, _, _ in reps)
    if not math.isfinite(lo):
        return None

    def counts(T: float) -> list[tuple[int, list[int]]]:
        out = []
        for cost, m, cp, idx in reps:
            a, b = m, cp  # largest x in [a, b] with cost(x) <= T; cost(m) <= T holds since T >= lo
            while a < b:
                mid = (a + b + 1) // 2
                if cost(mid) <= T:
                    a = mid
                else:
                    b = mid - 1
            out.append((a, idx))
        return out

    def placed(cs: list[tuple[int, list[int]]]) -> int:
        return sum(x * len(idx) for x, idx in cs)

    if placed(counts(lo)) >= total:
        hi = lo
    else:
        hi = max(at(c, cp) for c, _, cp, _ in reps)
        if not math.isfinite(hi) or placed(counts(hi)) < total:
            # some counts are infinite-cost: search the finite values only
            finite = [at(c, x) for c, m, cp, _ in reps for x in range(m, cp + 1) if math.isfinite(at(c, x))]
            hi = max(finite)
            if placed(counts(hi)) < total:
                return None
        while hi - lo > _REL_TOL * max(hi, 1e-300):
            mid = (lo + hi) / 2
            if placed(counts(mid)) >= total:
                hi = mid
            else:
                lo = mid
    # hand back the excess, always from the workers whose last unit costs most; workers of one
    # group share a count, so they are handled as one segment (count, members) at a time
    segments = [[x, list(idx)] for x, idx in counts(hi)]
    excess = sum(x * len(idx) for x, idx in segments) - total
    cost_of = {id(seg): reps[k][0] for k, seg in enumerate(segments)}
    min_of = {id(seg): reps[k][1] for k, seg in enumerate(segments)}
    heap = [(-at(cost_of[id(seg)], seg[0]), k, seg) for k, seg in enumerate(segments) if seg[0] > min_of[id(seg)]]
    heapq.heapify(heap)
    serial = len(segments)
    while excess > 0:
        _, _, seg = heapq.heappop(heap)
        x, members = seg
        take = min(excess, len(members))
        excess -= take
        lowered, kept = members[:take], members[take:]
        if kept:
            heapq.heappush(heap, (-at(cost_of[id(seg)], x), serial, seg))
            seg[1] = kept
            serial += 1
        new = [x - 1, lowered]
        segments.append(new)
        cost_of[id(new)], min_of[id(new)] = cost_of[id(seg)], min_of[id(seg)]
        if x - 1 > min_of[id(new)]:
            heapq.heappush(heap, (-at(cost_of[id(new)], x - 1), serial, new))
            serial += 1
    result = [0] * n
    for x, members in segments:
        for i in members:
            result[i] = x
    return result
