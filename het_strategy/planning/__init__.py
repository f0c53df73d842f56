"""The planners: one entry, ``plan(cluster, workload, settings, request) -> PlanResult``.

``request.PlanRequest`` says what is asked (modes, runtime, objective, budget,
throughput floor, joint compression, measured profile); ``planner.plan``
composes the searches in one documented order:

- ``search.search_plan``: the mode search (``dp``: uneven data parallelism,
  ``dp_split``; ``pipeline``: one pipeline through every device; ``hybrid``:
  pipelines x stages x tensor parallelism, ``hybrid``; ``auto``: the best);
- ``runtimes.search_runtime``: only plans a runtime runs;
- ``joint.search_joint``: placement x inter-node compression;
- ``objective.search_objective``: money objective, budget and floor over sub-clusters;
- ``low_communication.plan_low_communication``: groups exchanging every H steps (``hetero_diloco``).

MoE workloads get an expert placement (``experts``).  ``PlanResult`` holds the
chosen plan with its figures and what a report shows beside it.
"""

from __future__ import annotations

from het_strategy.planning.allocation import allocate_min_max
from het_strategy.planning.dp_split import equal_split_plan, plan_data_parallel
from het_strategy.planning.experts import place_experts
from het_strategy.planning.hybrid import plan_hybrid
from het_strategy.planning.low_communication import OuterSyncBudget, plan_low_communication
from het_strategy.planning.pipeline import plan_pipeline_stages
from het_strategy.planning.planner import PlanResult, plan, rescore
from het_strategy.planning.request import CompressionPlanning, Objective, PlanMode, PlanRequest, ProfileSource
from het_strategy.planning.search import MODES, PlanningError, plan_pipeline, search_plan

__all__ = ["MODES", "PlanMode", "Objective", "CompressionPlanning", "ProfileSource", "PlanRequest", "PlanResult",
           "PlanningError", "plan", "rescore", "search_plan", "plan_pipeline", "plan_data_parallel",
           "plan_hybrid", "plan_pipeline_stages", "allocate_min_max", "equal_split_plan", "place_experts",
           "OuterSyncBudget", "plan_low_communication"]
