"""Lower bounds on the step time of a structure, for pruning the hybrid search.

A structure is a set of pipelines (ordered stage slots, each a tensor-parallel
group).  ``structure.assemble_plan`` finds its best plan exactly, at the cost of
many layer-split DPs; a bound here needs a few small DPs per pipeline shape
(``bound_cache.BoundCache`` computes and caches them, with ``min_bottleneck``
and ``min_sum``) and a closed form or a short bisection per structure.

- ``PipelineBound``: per pipeline, ``tau`` (the per-sample bottleneck), ``phi``
  (one sample through the pipeline) and ``post`` (the least gradient sync +
  update), with ``g_p(b) >= (b - 1) tau + phi`` on b >= 1 samples (why: there);
- ``CurveBound``: sharper, per micro-batch size from the layer split's own
  matrices (``BoundCache.refined``);
- ``structure_bound``, ``counted_structure_bound``, ``curve_structure_bound``:
  per structure, the least time at which its pipelines' bounds let them take the
  global batch together, plus the largest ``post``.

The invariant every search relies on: no bound exceeds what ``assemble_plan``
can reach for the structure (only splits that fit memory count, every figure is
a minimum over splits, shares are relaxed to reals).  The searches visit
structures in order of the bound and stop at the first whose bound reaches the
best step found, so pruning by it loses nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["PipelineBound", "CurveBound", "INFEASIBLE", "structure_bound", "counted_structure_bound",
           "curve_structure_bound", "min_bottleneck", "min_sum"]


@dataclass(frozen=True)
class PipelineBound:
    """Lower-bound figures of one pipeline shape (its slots, the structure's d pipelines and gradient routes);
    inf when nothing fits.

    * ``tau`` (per-sample bottleneck): for a layer split, per stage the smallest compute seconds per sample
      over micro-batch sizes 1..M (M the largest on the menu) plus the sends at its two boundaries, each the
      smallest per sample over 1..M with the link to itself; tau = min over splits of the largest such stage
      figure;
    * ``phi`` (one sample through the pipeline): min over splits of the sum of the stage figures with the
      outgoing send only (a fill pays each send once);
    * ``post``: min over splits of the largest stage gradient sync + update, on the stages' routes, or on the
      cheapest route a ring could have (a *floor*, when the routes are not computed yet: ``BoundCache.floor``).

    Only splits that fit memory count: with one micro-batch in flight at the smallest micro-batch (the least
    any plan holds), or, where the assembly fixes it (the families regime), S - s micro-batches on stage s.

    Why ``g_p(b) >= (b - 1) tau + phi`` for b >= 1 samples: the cost model's 1F1B time of n micro-batches of
    size m (the last of size l) is ``fill(m) + (n - 2) bottleneck(m) + bottleneck(l)`` (n >= 2) or
    ``fill(b)`` (n = 1).  Every micro-batch of k samples costs a stage at least k times its per-sample figures
    (a send shared with other flows only takes longer), so ``fill(m) >= m sum_s f_s`` (f_s: compute + send
    out) and the rest is ``>= (b - m) max_s g_s`` (g_s = f_s + the send in, which is part of f_{s-1}); with
    m >= 1 and ``sum_s f_s >= max_s g_s`` this is ``>= (b - 1) max_s g_s + sum_s f_s``, and minimising each
    term over splits separately gives the bound.  For n = 1, ``fill(b) >= b phi >= (b - 1) tau + phi``.

    ``beyond``: past that many samples (``(S - 1) M``) every plan has >= S micro-batches, so stage s holds
    S - s of them; ``tau_full`` / ``phi_full`` are the figures with that memory (inf: no split fits so many
    samples).  ``beyond = inf`` when not known.
    """

    tau: float
    phi: float
    post: float
    beyond: float = math.inf
    tau_full: float = math.inf
    phi_full: float = math.inf

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.tau)

    def time_s(self, samples: int) -> float:
        """Lower bound on the pipeline's 1F1B time on ``samples`` >= 1 samples."""
        t = (samples - 1) * self.tau + self.phi
        if samples > self.beyond:
            t = max(t, (samples - 1) * self.tau_full + self.phi_full)
        return t

    def most_samples(self, time_s: float) -> float:
        """The largest real share whose bound is <= ``time_s`` (0 when not even one sample)."""
        if time_s < self.phi:
            return 0.0
        loose = math.inf if self.tau <= 0 else 1 + (time_s - self.phi) / self.tau
        if loose <= self.beyond:
            return loose
        full = -math.inf if time_s < self.phi_full else (
            math.inf if self.tau_full <= 0 else 1 + (time_s - self.phi_full) / self.tau_full)
        return max(self.beyond, min(loose, full))


INFEASIBLE = PipelineBound(math.inf, math.inf, math.inf)


@dataclass(frozen=True)
class CurveBound:
    """A sharper pipeline bound: ``g_p(b) >= min`` over pieces ``(lo, hi, base, slope)`` with
    ``lo <= b <= hi`` of ``base + slope * b`` (``BoundCache.refined``).

    Per micro-batch size m it uses the very (compute + send) matrices the layer split uses, at size m:
    ``T >= m phi_m + (b - 2m) tau_m + m tau`` for n >= 2 (the last micro-batch of l <= m samples costs
    >= l tau), ``fill(b) >= b phi`` for one micro-batch; the bound is the least of these over m.
    """

    pieces: tuple[tuple[float, float, float, float], ...]
    post: float

    @property
    def feasible(self) -> bool:
        return bool(self.pieces)

    def time_s(self, samples: float) -> float:
        return min((base + slope * samples for lo, hi, base, slope in self.pieces if lo <= samples <= hi),
                   default=math.inf)

    def most_samples(self, time_s: float) -> float:
        best = 0.0
        for lo, hi, base, slope in self.pieces:
            if base + slope * lo > time_s:
                continue
            best = max(best, hi if slope <= 0 else min(hi, (time_s - base) / slope))
        return best


def curve_structure_bound(curves: Sequence[CurveBound], total: int, equal_shares: bool = False) -> float:
    """Lower bound on a structure's step from ``CurveBound``s: the least T at which every pipeline can
    take a sample and together they can take ``total`` (bisection; shares relaxed to reals)."""
    dp = len(curves)
    if dp == 0 or total < dp or any(not c.feasible for c in curves):
        return math.inf
    post = max(c.post for c in curves)
    if equal_shares:
        return max(c.time_s(total // dp) for c in curves) + post
    lo = max(min(base + slope * lo_b for lo_b, _, base, slope in c.pieces) for c in curves)
    if sum(c.most_samples(lo) for c in curves) >= total:
        return lo + post
    hi = max(lo, 1e-300) * 2
    while sum(c.most_samples(hi) for c in curves) < total:
        hi *= 2
        if not math.isfinite(hi):
            return math.inf
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(c.most_samples(mid) for c in curves) >= total:
            hi = mid
        else:
            lo = mid
    return lo + post


def structure_bound(bounds: Sequence[PipelineBound], total: int, equal_shares: bool = False) -> float:
    """Lower bound on the step time of a structure with these pipelines and ``total`` samples.

    ``equal_shares``: every pipeline gets at least ``total // d`` samples (``settings.equal_shares``).
    """
    return counted_structure_bound([(b, 1) for b in bounds], total, equal_shares)


def counted_structure_bound(pairs: Sequence[tuple[PipelineBound, int]], total: int,
                            equal_shares: bool = False) -> float:
    """``structure_bound`` with pipelines given as (bound figures, how many such pipelines).

    Every pipeline gets b_p >= 1 samples summing to B, so the pipeline part is at least the least T at which
    the pipelines' bounds let them take B samples together (shares relaxed to reals): in closed form,
    ``sum_p (1 + (T - phi_p) / tau_p) = B`` (and T >= every phi_p), else (a pipeline past its ``beyond``) by
    bisection on T.  The post part, max over pipelines, is at least max_p post_p.  The bound is their sum.
    With ``equal_shares`` each pipeline gets at least ``B // d`` samples instead.
    """
    dp = sum(n for _, n in pairs)
    if dp == 0 or total < dp or any(not b.feasible for b, _ in pairs):
        return math.inf
    post = max(b.post for b, _ in pairs)
    if equal_shares:
        return max(b.time_s(total // dp) for b, _ in pairs) + post
    phi_max = max(b.phi for b, _ in pairs)
    if any(b.tau <= 0 for b, _ in pairs):
        return phi_max + post
    rate = sum(n / b.tau for b, n in pairs)
    level = max(phi_max, (total - dp + sum(n * b.phi / b.tau for b, n in pairs)) / rate)
    if sum(n * b.most_samples(level) for b, n in pairs) >= total * (1 - 1e-12):
        return level + post
    # some pipeline cannot take its linear share with few micro-batches in flight: bisect the level
    lo, hi = level, level * 2
    while sum(n * b.most_samples(hi) for b, n in pairs) < total:
        hi *= 2
        if not math.isfinite(hi):
            return math.inf
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(n * b.most_samples(mid) for b, n in pairs) >= total:
            hi = mid
        else:
            lo = mid
    return lo + post


def min_bottleneck(mats: Sequence[np.ndarray]) -> float:
    """Min over contiguous splits (one range per matrix, in order) of the largest range cost."""
    g = np.full(mats[0].shape[0], np.inf)
    g[0] = 0.0
    for m in mats:
        g = np.maximum(g[:, None], m).min(axis=0)
    return float(g[-1])


def min_sum(mats: Sequence[np.ndarray]) -> float:
    """Min over contiguous splits (one range per matrix, in order) of the summed range costs."""
    f = np.full(mats[0].shape[0], np.inf)
    f[0] = 0.0
    for m in mats:
        f = (f[:, None] + m).min(axis=0)
    return float(f[-1])
