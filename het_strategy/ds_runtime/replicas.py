"""Which global ranks hold which layers, replica by replica, and with whom each gradient is reduced.

A Plan's pipelines ("replicas") may differ in length, boundaries and
tensor-parallel degree (an asymmetric plan: one fast device holding every
layer beside a two-stage pipeline of slow ones; or one A100 at tp 1 beside
two V100s at tp 2).  Stage ``s`` of replica ``p`` runs on a tensor-parallel
group of ranks, ``stage_groups[p][s]`` (one rank when tp = 1).
``replica_layout(plan)`` gives the ``ReplicaLayout``.

The layout itself, its holder sets and their order are ``core.replica_layout.ReplicaLayout`` (the cost model
prices the same sets); this module numbers the plan's ranks into it.

Pure Python (no torch): the runtime and the tests read the same layout.
"""

from __future__ import annotations

from het_strategy.core.plan import Plan
from het_strategy.core.replica_layout import ReplicaLayout
from het_strategy.core.runtime_rules import runs_per_replica, shares_boundaries
from het_strategy.ds_runtime.ds_config import rank_layout

__all__ = ["replica_layout"]


def replica_layout(plan: Plan, param_dtype: str | None = None) -> ReplicaLayout:
    """The plan's replicas on the global ranks of ``rank_layout`` (plan order unless on DeepSpeed's grid);
    ``param_dtype``: the model's parameters' dtype (``core.runtime_rules.runs_per_replica``)."""
    groups: list[list[list[int]]] = [[[-1] * st.tp for st in p.stages] for p in plan.pipelines]
    for ra in rank_layout(plan):
        groups[ra.pipeline][ra.stage][ra.tp_rank] = ra.rank
    return ReplicaLayout(stage_groups=tuple(tuple(tuple(g) for g in p) for p in groups),
                         parts=tuple(tuple(p.boundaries()) for p in plan.pipelines),
                         is_aligned=shares_boundaries(plan), per_replica=runs_per_replica(plan, param_dtype))
