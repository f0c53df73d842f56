"""A run's plan and decisions as plain data for loggers: a config mapping and table rows (pure, no torch).

- ``plan_config`` — the run config a logger keeps (``log_hyperparams``): the
  cluster's devices, the plan's shares and stages, the cost model's predicted
  step time and its speed-up over an even split of the same global batch;
- ``plan_rows`` — one table row per rank: device, type, node, emulated speed,
  share, layers held and the predicted seconds of its part of a step;
- ``decision_rows`` — any list of decisions (dataclasses such as the straggler
  callback's ``Decision``, or mappings such as the compression controller's
  per-layer rows) as columns and rows; fields a newer version adds become
  columns, lists and mappings become compact JSON text.

Every function works from the Plan, the ClusterSpec and (optionally) the
WorkloadSpec, so it runs without a process group and is tested without one.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from het_strategy.core.cost_model import CostModel
from het_strategy.core.train_settings import TrainSettings
from het_strategy.planning.dp_split import equal_split_plan

if TYPE_CHECKING:
    from het_strategy.core.cluster import ClusterSpec
    from het_strategy.core.plan_score import PlanScore
    from het_strategy.core.plan import Plan
    from het_strategy.core.workload import MeasuredProfile, WorkloadSpec

__all__ = ["plan_config", "plan_rows", "decision_rows", "predicted_figures", "PLAN_COLUMNS"]

PLAN_COLUMNS = ("rank", "device", "type", "node", "emulated_speed", "share", "pipeline", "stage", "layers",
                "predicted_s")


def predicted_figures(plan: "Plan", cluster: "ClusterSpec", workload: "WorkloadSpec | None",
                      profile: "MeasuredProfile | None" = None) -> tuple[dict[str, Any], "PlanScore | None"]:
    """The cost model's figures for ``plan`` (and an even split of its batch); the plan's own without a workload."""
    if workload is None:
        keep = ("step_time_s", "samples_per_s", "sync_time_s", "update_time_s", "source")
        return {k: plan.predicted[k] for k in keep if k in plan.predicted}, None
    settings = TrainSettings(global_batch_size=plan.global_batch_size, dtype=plan.dtype, micro_batch_sizes=(1,))
    cm = CostModel(cluster, workload, settings, profile)
    score = cm.score(plan)
    out: dict[str, Any] = {"step_time_s": score.step_time_s, "samples_per_s": score.samples_per_s,
                           "sync_time_s": score.sync_time_s, "update_time_s": score.update_time_s}
    if plan.is_pure_dp and plan.global_batch_size >= cluster.num_devices:
        equal = cm.score(equal_split_plan(cm)).step_time_s
        out["equal_split_step_s"] = equal
        out["speedup_vs_equal"] = equal / score.step_time_s if score.step_time_s > 0 else math.nan
    return out, score


def plan_config(plan: "Plan", cluster: "ClusterSpec", workload: "WorkloadSpec | None" = None,
                profile: "MeasuredProfile | None" = None, **extra: Any) -> dict[str, Any]:
    """The run config of a hetero run (nested plain data; ``extra`` entries are added as they are)."""
    predicted, _ = predicted_figures(plan, cluster, workload, profile)
    shares = plan.rank_shares() if plan.is_pure_dp else {}
    out: dict[str, Any] = {
        "cluster": cluster.name,
        "world_size": cluster.num_devices,
        "devices": [{"rank": r, "name": d.name, "type": d.type, "node": d.node, "emulated_speed": d.emulated_speed}
                    for r, d in enumerate(cluster.devices)],
        "plan": {
            "mode": plan.mode, "dtype": str(plan.dtype), "global_batch_size": plan.global_batch_size,
            "model": plan.model.get("name"),
            "shares": [int(shares.get(d.name, 0)) for d in cluster.devices] if shares else None,
            "pipelines": [{"samples": p.samples, "micro_batch_size": p.micro_batch_size,
                           "stages": [{"devices": list(s.devices), "layers": list(s.layers), "tp": s.tp}
                                      for s in p.stages]} for p in plan.pipelines],
        },
        "predicted": predicted,
    }
    out.update(extra)
    return out


def plan_rows(plan: "Plan", cluster: "ClusterSpec", workload: "WorkloadSpec | None" = None,
              profile: "MeasuredProfile | None" = None) -> list[list[Any]]:
    """One row per rank (``PLAN_COLUMNS``); an idle device has share 0 and no layers."""
    _, score = predicted_figures(plan, cluster, workload, profile)
    where: dict[str, tuple[int, int]] = {}
    for p, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            for d in stage.devices:
                where[d] = (p, s)
    rows = []
    for r, dev in enumerate(cluster.devices):
        if dev.name not in where:
            rows.append([r, dev.name, dev.type, dev.node, dev.emulated_speed, 0, None, None, "", None])
            continue
        p, s = where[dev.name]
        pipe, stage = plan.pipelines[p], plan.pipelines[p].stages[s]
        predicted = score.pipeline_times_s[p] if score is not None and len(pipe.stages) == 1 else None
        rows.append([r, dev.name, dev.type, dev.node, dev.emulated_speed, pipe.samples, p, s,
                     f"[{stage.layers[0]},{stage.layers[1]})", predicted])
    return rows


def decision_rows(decisions: Iterable[Any], first: Iterable[str] = ()) -> tuple[list[str], list[list[Any]]]:
    """Columns (``first`` ones first, then every other field in order of appearance) and one row per decision."""
    records = [_as_mapping(d) for d in decisions]
    columns = list(dict.fromkeys([*first, *(k for rec in records for k in rec)]))
    return columns, [[_cell(rec.get(c)) for c in columns] for rec in records]


def _as_mapping(decision: Any) -> Mapping[str, Any]:
    if dataclasses.is_dataclass(decision) and not isinstance(decision, type):
        return dataclasses.asdict(decision)
    if isinstance(decision, Mapping):
        return decision
    raise TypeError(f"a decision is a dataclass or a mapping, not {type(decision).__name__}")


def _cell(value: Any) -> Any:
    """A table cell: numbers and text as they are, lists and mappings as compact JSON."""
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, separators=(",", ":"), default=str)
    return value
