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
   whose last unit costs most; no worker's cost rises, so the result's
   maximum is T* (to that precision).

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
        groups.setdefault((id(costs[i]), mins[i], caps[i]), []).append(i)
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
    result = [0] * n
    for x, idx in counts(hi):
        for i in idx:
            result[i] = x
    excess = sum(result) - total
    heap = [(-at(costs[i], result[i]), i) for i in range(n) if result[i] > mins[i]]
    heapq.heapify(heap)
    while excess > 0:
        _, i = heapq.heappop(heap)
        result[i] -= 1
        excess -= 1
        if result[i] > mins[i]:
            heapq.heappush(heap, (-at(costs[i], result[i]), i))
    return result
