"""Mixed pipeline families: one pipeline shape that chains units of two device types, replicated.

The families regime (``hybrid._families``) builds each device type's own
homogeneous pipelines.  On clusters where a slow type must shrink its gradient
sync with tensor parallelism and a fast type finishes the model, the best plans
put both types in every pipeline: Sailor's 32:96 plan pairs V100 groups of tp 4
with single A100s; a search in Sailor's plan format found V100 tp 4 -> V100 tp 2
-> A100 tp 2 faster still.  Such a plan is one *template* — a short sequence of
(type, tp) units, the first type's units before the second's — replicated as
often as the devices allow; identical pipelines get one layer split and equal
shares, so every replica shares its stage boundaries (what runtimes without
asymmetric replicas need).

Templates: every ordered pair of types, every split of 2..``MAX_TEMPLATE_STAGES``
stages between them, tp non-increasing within a type's block and drawn from the
tp degrees of the type's own best homogeneous options and their neighbours
(half and double: a higher tp shrinks the sync); a template must use the
two types' devices in about their ratio in the cluster (within a factor
``RATIO_SLACK``), so its replicas use most of both.  The closest to
the ratio are assembled (``LAYER_BUDGET``: fixed work at any cluster size: this widens the search,
it is not exhaustive) and the best ``KEEP`` go into the families' combination
step with the homogeneous options.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

from het_strategy.core.cost_model import CostModel
from het_strategy.planning.structure import Slots, assemble_plan

__all__ = ["mixed_family_options", "MAX_TEMPLATE_STAGES"]

MAX_TEMPLATE_STAGES = 4
RATIO_SLACK = 1.5
KEEP = 2
LAYER_BUDGET = 640
"""Templates assembled x model layers: 24 templates of a 26-layer model, 6 of a 98-layer one."""


def _blocks(tps: Sequence[int], stages: int) -> list[tuple[int, ...]]:
    """tp sequences of ``stages`` units, non-increasing (a type's block)."""
    return [seq for seq in itertools.combinations_with_replacement(sorted(tps, reverse=True), stages)]


def _templates(tps_a: Sequence[int], tps_b: Sequence[int], max_stages: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    out = []
    for total in range(2, max_stages + 1):
        for k_a in range(1, total):
            for block_a in _blocks(tps_a, k_a):
                for block_b in _blocks(tps_b, total - k_a):
                    out.append((block_a, block_b))
    return out


def _replicate(pool_a: Any, pool_b: Any, block_a: Sequence[int], block_b: Sequence[int]) -> list[Slots]:
    """As many disjoint pipelines of the template as the two pools hold."""
    pipes: list[Slots] = []
    taken: set[str] = set()
    lists = {}
    for pool, block, side in ((pool_a, block_a, "a"), (pool_b, block_b, "b")):
        for tp in set(block):
            lists[(side, tp)] = list(pool.units(tp))
    cursor: dict[tuple[str, int], int] = {}
    while True:
        slots: list[tuple[str, ...]] = []
        for side, block in (("a", block_a), ("b", block_b)):
            for tp in block:
                units = lists[(side, tp)]
                i = cursor.get((side, tp), 0)
                while i < len(units) and any(d in taken for d in units[i]):
                    i += 1
                if i >= len(units):
                    return pipes
                cursor[(side, tp)] = i + 1
                taken.update(units[i])
                slots.append(units[i])
        pipes.append(tuple(slots))


def mixed_family_options(cm: CostModel, pools: Sequence[Any], preferred_tps: Sequence[Sequence[int]],
                         cutoff: float = math.inf) -> list[list[Slots]]:
    """The best ``KEEP`` mixed-template structures over ordered pairs of device types.

    ``pools`` are the families regime's per-type pools (``units(tp)``, ``count``,
    ``by_node``); ``preferred_tps[i]`` the tp degrees of pool i's best homogeneous
    options (a type's units in a template use those).  Candidates are ranked by
    how closely they use the two types in the cluster's ratio (then by fewer
    stages), and the first ``LAYER_BUDGET / layers`` are assembled: a fixed
    amount of work whatever the cluster size (a partition front costs about
    linearly in the layers).  ``cutoff``: a step time to beat.
    """
    max_stages = min(MAX_TEMPLATE_STAGES, cm.settings.max_stages, cm.workload.num_layers)
    if len(pools) < 2 or max_stages < 2:
        return []
    candidates = []
    for (i, pool_a), (j, pool_b) in itertools.permutations(enumerate(pools), 2):
        if not preferred_tps[i] or not preferred_tps[j]:
            continue
        ratio = pool_a.count / pool_b.count
        for block_a, block_b in _templates(preferred_tps[i], preferred_tps[j], max_stages):
            need = sum(block_a) / sum(block_b)
            misfit = abs(math.log(need / ratio))
            if misfit <= math.log(RATIO_SLACK):
                candidates.append((misfit, len(block_a) + len(block_b), i, j, block_a, block_b))
    candidates.sort()
    budget = max(4, LAYER_BUDGET // cm.workload.num_layers)
    scored: list[tuple[float, list[Slots]]] = []
    for _, _, i, j, block_a, block_b in candidates[:budget]:
        struct = _replicate(pools[i], pools[j], block_a, block_b)
        if not struct or cm.settings.global_batch_size < len(struct):
            continue
        bar = min(cutoff, scored[KEEP - 1][0] if len(scored) >= KEEP else math.inf)
        res = assemble_plan(cm, struct, "hybrid", cutoff=bar, post_rounds=3, exact_in_flight=False)
        if res is not None:
            scored.append((res.step_time_s, struct))
            scored.sort(key=lambda x: x[0])
            del scored[KEEP:]
    return [s for _, s in scored]
