"""How a flat parameter of ``numel`` elements is cut into one contiguous piece per rank.

One rule, used by the planner (which prices the pieces) and by the ``hetero_fsdp`` runtime (which cuts
them), so both agree on every element's owner:

    size_r = floor(numel * f_r), then the ``numel - sum_r size_r`` elements left over go one each to the
    ranks with the largest fractional parts ``numel * f_r - size_r`` (ties: the lower rank first).

The sizes sum to ``numel`` exactly; a rank with fraction 0 gets 0 elements. Pieces are laid out in rank
order: rank r's piece starts at ``sum(sizes[:r])`` (``shard_offsets``). No torch.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from het_strategy.core.errors import field_error

__all__ = ["shard_sizes", "shard_sizes_of_each", "shard_offsets"]

_SUM_TOLERANCE = 1e-9


def shard_sizes(numel: int, fractions: Sequence[float]) -> list[int]:
    """Per-rank element counts of a flat parameter of ``numel`` elements cut by ``fractions`` (the rule above).

    ``fractions`` holds one non-negative finite number per rank, summing to 1 within 1e-9; ``numel`` is a
    non-negative int. Raises ConfigError (field ``shards``) otherwise.
    """
    return shard_sizes_of_each([numel], fractions)[0]


def shard_sizes_of_each(numels: Sequence[int], fractions: Sequence[float]) -> list[list[int]]:
    """``shard_sizes`` of each of ``numels`` by the same ``fractions`` (checked once)."""
    fr = _checked_fractions(fractions)
    return [_cut(_checked_numel(numel), fr) for numel in numels]


def _checked_numel(numel: int) -> int:
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise field_error("shards.numel", numel, "be a non-negative int (a flat parameter's element count)")
    return numel


def _checked_fractions(fractions: Sequence[float]) -> list[float]:
    fr = [float(f) for f in fractions]
    if not fr:
        raise field_error("shards", list(fractions), "hold one fraction per rank (at least one)")
    for r, f in enumerate(fr):
        if not math.isfinite(f) or f < 0.0:
            raise field_error(f"shards[{r}]", fractions[r], "be a finite fraction >= 0")
    total = math.fsum(fr)
    if abs(total - 1.0) > _SUM_TOLERANCE:
        raise field_error("shards", list(fractions), f"sum to 1 (within {_SUM_TOLERANCE:g}); it sums to {total!r}")
    return fr


def _cut(numel: int, fr: list[float]) -> list[int]:
    """The rule of the module on checked input (vectorised: a planner cuts every unit over thousands of ranks)."""
    f = np.asarray(fr, dtype=np.float64)
    exact = numel * f
    sizes = np.minimum(numel, np.floor(exact)).astype(np.int64)
    left = numel - int(sizes.sum())
    ranks = np.arange(len(fr))
    if left < 0:  # fractions summing to 1 + 1e-9 on a huge numel: take the excess back from the largest pieces
        for r in np.lexsort((ranks, -sizes)):
            if left == 0:
                break
            take = min(int(sizes[r]), -left)
            sizes[r] -= take
            left += take
    if left > 0:  # one element each, largest fractional part first; more than one round only by rounding error
        order = np.lexsort((ranks, -(exact - sizes)))
        order = order[f[order] > 0.0]
        rounds, rest = divmod(left, len(order))
        sizes[order] += rounds
        sizes[order[:rest]] += 1
    return [int(x) for x in sizes]


def shard_offsets(sizes: Sequence[int]) -> list[int]:
    """Start of each rank's piece in the flat parameter: ``offsets[r] = sum(sizes[:r])``."""
    out, at = [], 0
    for s in sizes:
        out.append(at)
        at += int(s)
    return out
