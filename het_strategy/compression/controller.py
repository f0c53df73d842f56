"""Choosing a compression method per layer: L-GreCo's dynamic program.

Each eligible layer ``l`` has options ``m`` (method tokens) with a predicted time
``t[l][m]`` (the codec's wire bytes, ``codecs.wire_bytes``, over the measured
bandwidth, plus its measured codec time) and a
measured error ``e[l][m]`` (squared L2 distance between the gradient and what
the method delivers).  We pick one option per layer to

    minimise  sum_l t[l][m_l]   subject to   sum_l e[l][m_l] <= budget,

where the budget is the total error of a uniform default known to train well
(``q4`` everywhere) times ``error_budget``.  The knapsack runs over the error
axis, discretised into ``resolution`` bins; each error is rounded *up* to whole
bins, so the chosen set never exceeds the budget.

Because ``none`` has no error and no codec time, a link fast enough that
compressing does not pay makes ``none`` the optimum everywhere: compression
switches itself off.  This module is pure (no torch.distributed) so that the
same inputs give the same choice on every rank, and it can be checked against
brute force.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["LayerOption", "LinkModel", "solve_layer_methods", "fit_link", "predicted_exchange_s"]


@dataclass(frozen=True)
class LayerOption:
    """One way to send one layer's gradient."""

    token: str
    """Codec token (``core.codecs.Codec``)."""
    time_s: float
    """Predicted seconds: wire time plus codec time."""
    error: float
    """Squared L2 error it adds to the layer's averaged gradient."""


@dataclass(frozen=True)
class LinkModel:
    """``t(bytes) = latency_s + bytes / bytes_per_s`` for the bytes one rank sends in a collective."""

    latency_s: float
    bytes_per_s: float

    def transfer_s(self, num_bytes: float) -> float:
        """The bandwidth term only: a layer's share of a bucket's collective (latency is paid per collective)."""
        return num_bytes / self.bytes_per_s


def fit_link(sent_bytes: Sequence[float], seconds: Sequence[float]) -> LinkModel:
    """Fit latency and bandwidth to timed collectives of two or more sizes (least squares, clamped >= 0)."""
    x = np.asarray(sent_bytes, dtype=float)
    y = np.asarray(seconds, dtype=float)
    slope, intercept = np.polyfit(x, y, 1) if len(x) > 1 and np.ptp(x) > 0 else (y[-1] / x[-1], 0.0)
    if slope <= 0:  # noise swamped the size dependence: take the largest transfer's average rate
        slope = y[-1] / x[-1]
    return LinkModel(latency_s=max(0.0, float(intercept)), bytes_per_s=float(1.0 / slope))


def solve_layer_methods(options: Sequence[Sequence[LayerOption]], budget: float,
                        resolution: int = 2000) -> list[int]:
    """Index of the chosen option per layer: least total time with total error <= budget.

    1. Discretise: ``bins(e) = ceil(e / budget * resolution - 1e-9)`` (rounded
       up, so the real total error of a feasible choice is <= budget, up to
       ``layers x 1e-9`` of a bin that keeps float noise from adding a bin).
    2. ``best[b]`` = least time of the layers so far with error bins exactly
       ``<= b``; fold in one layer at a time, keeping each layer's argmin.
    3. Walk back from the best final bin.

    Layers must each have an option with zero error (``none``) or the budget
    may be infeasible; then the least-error option of every layer is returned.
    Ties go to the earlier option in a layer's list (list cheaper-to-decode first).
    """
    if not options:
        return []
    if budget <= 0 or not math.isfinite(budget):
        return [min(range(len(opts)), key=lambda i: (opts[i].error, opts[i].time_s)) for opts in options]
    inf = float("inf")
    best = np.full(resolution + 1, inf)
    best[0] = 0.0
    choices: list[np.ndarray] = []
    for opts in options:
        new = np.full(resolution + 1, inf)
        pick = np.full(resolution + 1, -1, dtype=np.int64)
        for i, opt in enumerate(opts):
            bins = math.ceil(opt.error / budget * resolution - 1e-9) if opt.error > 0 else 0
            if bins > resolution:
                continue
            shifted = np.full(resolution + 1, inf)
            shifted[bins:] = best[:resolution + 1 - bins] + opt.time_s
            better = shifted < new
            new[better] = shifted[better]
            pick[better] = i
        choices.append(pick)
        best = new
    if not np.isfinite(best).any():
        return [min(range(len(opts)), key=lambda i: (opts[i].error, opts[i].time_s)) for opts in options]
    b = int(np.argmin(best))  # least time; argmin takes the smallest error bin among equal times
    chosen: list[int] = []
    for layer in range(len(options) - 1, -1, -1):
        i = int(choices[layer][b])
        chosen.append(i)
        opt = options[layer][i]
        b -= math.ceil(opt.error / budget * resolution - 1e-9) if opt.error > 0 else 0
    return chosen[::-1]


def predicted_exchange_s(options: Sequence[Sequence[LayerOption]], chosen: Sequence[int], buckets: Sequence[int],
                         latency_s: float) -> float:
    """Predicted seconds of one step's gradient exchange under a choice, latency included.

    The per-layer times (bandwidth + codec) plus one link latency per
    collective: a bucket's allreduce, and two more (all-to-all and allgather,
    or PowerSGD's extra rounds) for each method group that compression makes
    within a bucket.  This is what decides whether the dynamic program's choice
    is worth making at all (``CompressionConfig.min_saving``).
    """
    layers = sum(options[layer][c].time_s for layer, c in enumerate(chosen))
    groups = {(buckets[layer], options[layer][c].token) for layer, c in enumerate(chosen)
              if options[layer][c].token != "none"}
    return layers + latency_s * (len(set(buckets)) + 2 * len(groups))
