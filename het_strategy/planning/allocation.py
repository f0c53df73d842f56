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


# (cost, minimum, cap, worker indices): workers that share a cost callable and bounds
_Group = tuple[Callable[[int], float], int, int, list[int]]


def allocate_min_max(costs: Sequence[Callable[[int], float]], total: int,
                     minimum: Sequence[int] | None = None,
                     cap: Sequence[int | None] | None = None) -> list[int] | None:
    """Counts per worker minimising the largest cost, or None when ``total`` can't be placed."""
    n = len(costs)
    mins = list(minimum) if minimum is not None else [0] * n
    caps = [total if c is None else min(c, total) for c in (cap if cap is not None else [None] * n)]
    if sum(mins) > total or sum(caps) < total or any(c < m for c, m in zip(caps, mins)):
        return None
    reps = _groups(costs, mins, caps)
    t = _least_feasible_time(reps, total)
    if t is None:
        return None
    return _hand_back_excess(reps, _counts(reps, t), total, n)


def _groups(costs: Sequence[Callable[[int], float]], mins: list[int], caps: list[int]) -> list[_Group]:
    """One group per (cost callable, minimum, cap), in order of first appearance: each is solved once."""
    groups: dict[tuple, list[int]] = {}
    for i in range(len(costs)):
        groups.setdefault((costs[i], mins[i], caps[i]), []).append(i)  # equal callables: one group
    return [(costs[idx[0]], mins[idx[0]], caps[idx[0]], idx) for idx in groups.values()]


def _at(cost: Callable[[int], float], x: int) -> float:
    """A worker's cost of ``x`` units; nothing costs nothing."""
    return 0.0 if x == 0 else cost(x)


def _counts(reps: list[_Group], T: float) -> list[tuple[int, list[int]]]:
    """Step 1: per group, the most units a worker takes within time ``T`` (``T`` at least every minimum's cost)."""
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


def _placed(cs: list[tuple[int, list[int]]]) -> int:
    """The units the per-group counts place in all."""
    return sum(x * len(idx) for x, idx in cs)


def _least_feasible_time(reps: list[_Group], total: int) -> float | None:
    """Step 2: the least time at which the counts reach ``total``, to ``_REL_TOL``, or None when none does."""
    lo = max(_at(c, m) for c, m, _, _ in reps)
    if not math.isfinite(lo):
        return None
    if _placed(_counts(reps, lo)) >= total:
        return lo
    hi = max(_at(c, cp) for c, _, cp, _ in reps)
    if not math.isfinite(hi) or _placed(_counts(reps, hi)) < total:
        # some counts are infinite-cost: search the finite values only
        finite = [_at(c, x) for c, m, cp, _ in reps for x in range(m, cp + 1) if math.isfinite(_at(c, x))]
        hi = max(finite)
        if _placed(_counts(reps, hi)) < total:
            return None
    while hi - lo > _REL_TOL * max(hi, 1e-300):
        mid = (lo + hi) / 2
        if _placed(_counts(reps, mid)) >= total:
            hi = mid
        else:
            lo = mid
    return hi


def _hand_back_excess(reps: list[_Group], counts: list[tuple[int, list[int]]], total: int, n: int) -> list[int]:
    """Step 3: lower the counts until they sum to ``total``, one unit at a time from the workers whose last unit
    costs most (lowest index first among equals), and spread them back per worker."""
    # workers of one group share a count, so they are handled as one segment (count, members) at a time
    segments = [[x, list(idx)] for x, idx in counts]
    excess = sum(x * len(idx) for x, idx in segments) - total
    cost_of = {id(seg): reps[k][0] for k, seg in enumerate(segments)}
    min_of = {id(seg): reps[k][1] for k, seg in enumerate(segments)}
    heap = [(-_at(cost_of[id(seg)], seg[0]), k, seg) for k, seg in enumerate(segments) if seg[0] > min_of[id(seg)]]
    heapq.heapify(heap)
    serial = len(segments)
    while excess > 0:
        _, _, seg = heapq.heappop(heap)
        x, members = seg
        take = min(excess, len(members))
        excess -= take
        lowered, kept = members[:take], members[take:]
        if kept:
            heapq.heappush(heap, (-_at(cost_of[id(seg)], x), serial, seg))
            seg[1] = kept
            serial += 1
        new = [x - 1, lowered]
        segments.append(new)
        cost_of[id(new)], min_of[id(new)] = cost_of[id(seg)], min_of[id(seg)]
        if x - 1 > min_of[id(new)]:
            heapq.heappush(heap, (-_at(cost_of[id(new)], x - 1), serial, new))
            serial += 1
    result = [0] * n
    for x, members in segments:
        for i in members:
            result[i] = x
    return result
