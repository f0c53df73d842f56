"""Exact integer min-max allocation, shared by the batch, DP and expert planners.

Problem: give ``total`` indivisible units (samples, experts) to ``n`` workers,
worker i at least ``minimum[i]`` and at most ``cap[i]``, minimising
``max_i cost_i(x_i)`` where every ``cost_i`` is non-decreasing.

Greedy is exact here: start every worker at its minimum, then repeatedly give
one unit to the worker whose cost *after* taking it is smallest.  (Exchange
argument: in any optimum, the unit greedy places k-th can be moved to greedy's
choice without raising the maximum, because greedy's choice has the smallest
post-increment cost among workers that can still take a unit.)  Ties go to the
lowest index, so the result is deterministic.
"""

from __future__ import annotations

import heapq
from typing import Callable, Sequence

__all__ = ["allocate_min_max"]


def allocate_min_max(costs: Sequence[Callable[[int], float]], total: int,
                     minimum: Sequence[int] | None = None,
                     cap: Sequence[int | None] | None = None) -> list[int] | None:
    """Counts per worker minimising the largest cost, or None when ``total`` can't be placed.

    Steps: 1. give each worker its minimum; 2. push each worker's next-unit cost
    on a heap; 3. pop the cheapest, give it the unit, push its next cost; repeat.
    O(total * log n) cost evaluations.
    """
    n = len(costs)
    counts = list(minimum) if minimum is not None else [0] * n
    caps = list(cap) if cap is not None else [None] * n
    remaining = total - sum(counts)
    if remaining < 0:
        return None
    heap = [(costs[i](counts[i] + 1), i) for i in range(n) if caps[i] is None or counts[i] < caps[i]]
    heapq.heapify(heap)
    while remaining > 0:
        if not heap:
            return None
        _, i = heapq.heappop(heap)
        counts[i] += 1
        remaining -= 1
        if caps[i] is None or counts[i] < caps[i]:
            heapq.heappush(heap, (costs[i](counts[i] + 1), i))
    return counts
