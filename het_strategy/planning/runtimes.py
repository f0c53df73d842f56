"""Plans a runtime can execute: ``planner.runtime=deepspeed`` and the price of the constraint.

``runtime="any"`` is the unconstrained search.  ``runtime="deepspeed"`` keeps
what ``hetero_deepspeed`` (``ds_runtime``) runs exactly:

- tp = 1 everywhere (it has no tensor parallelism): the search runs with
  ``max_tp = 1``;
- pipelines at ZeRO 0 or 1 (DeepSpeed's pipeline engine refuses ZeRO 2/3);
  at ZeRO 2/3 only one-stage replicas;
- asymmetric replicas (different boundaries) at ZeRO 0 and fp32 only (each
  layer's gradients are reduced by the runtime itself, outside ZeRO and
  DeepSpeed's mixed-precision optimizers); otherwise replicas share their
  boundaries.

When the unconstrained best cannot run, each planner is searched again at
``max_tp = 1`` and its best kept if runnable; a hybrid search whose best is
asymmetric where asymmetry cannot run (ZeRO >= 1, not fp32) is then
represented by the aligned searches (one pipeline over every device, one-stage
replicas), so an aligned multi-pipeline plan may be missed there.

``plan_for_runtime`` returns the best runnable plan and the unconstrained
best, so the caller can say how much slower (by the cost model) the runnable
one is; with asymmetric replicas running, the gap is 0 for fp32 ZeRO-0 plans
without tensor parallelism.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.plan import Plan
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import MeasuredProfile, WorkloadSpec

__all__ = ["RUNTIMES", "RuntimeChoice", "runnable_problem", "plan_for_runtime"]

RUNTIMES = ("any", "deepspeed")


def _aligned(plan: Plan) -> bool:
    return len({tuple(p.boundaries()) for p in plan.pipelines}) == 1


def runnable_problem(plan: Plan, runtime: str) -> str | None:
    """Why ``runtime`` cannot run ``plan`` (``None``: it can)."""
    if runtime == "any":
        return None
    if any(s.tp != 1 for p in plan.pipelines for s in p.stages):
        return "it uses tensor parallelism (tp > 1), which the deepspeed runtime does not implement"
    pipelined = any(len(p.stages) > 1 for p in plan.pipelines)
    if pipelined and plan.zero_stage >= 2:
        return f"it pipelines at ZeRO {plan.zero_stage} (DeepSpeed's pipeline engine takes ZeRO 0 or 1)"
    if not _aligned(plan):
        if plan.zero_stage != 0:
            return f"its replicas differ in boundaries at ZeRO {plan.zero_stage} (asymmetric plans run at ZeRO 0)"
        if plan.dtype != "fp32":
            return f"its replicas differ in boundaries in {plan.dtype} (asymmetric plans run in fp32)"
    return None


@dataclass(frozen=True)
class RuntimeChoice:
    """The best plan ``runtime`` runs, beside the unconstrained best."""

    plan: Plan
    unconstrained: Plan
    runtime: str

    @property
    def slowdown(self) -> float:
        """Predicted step time of ``plan`` over the unconstrained best's, minus 1 (0.0: nothing lost)."""
        return self.plan.predicted["step_time_s"] / self.unconstrained.predicted["step_time_s"] - 1.0

    def summary(self) -> str:
        if self.runtime == "any":
            return "runtime any: the unconstrained best plan"
        why = runnable_problem(self.unconstrained, self.runtime)
        if why is None:
            return f"runtime {self.runtime}: the best plan is runnable (0.0% slower than the unconstrained best)"
        return (f"runtime {self.runtime}: the best runnable plan is {self.slowdown * 100:.1f}% slower by the cost "
                f"model than the unconstrained best, which it cannot run: {why}")


def plan_for_runtime(cluster: ClusterSpec, workload: WorkloadSpec, settings: TrainSettings, mode: str = "auto",
                     profile: MeasuredProfile | None = None, runtime: str = "any") -> RuntimeChoice:
    """Search as ``planning.plan`` does, restricted to what ``runtime`` runs (see the module docstring)."""
    from het_strategy.planning import MODES, PlanningError, plan as make_plan

    if runtime not in RUNTIMES:
        raise field_error("planner.runtime", runtime, f"be one of {', '.join(RUNTIMES)}")
    best = make_plan(cluster, workload, settings, mode=mode, profile=profile)
    if runtime == "any" or runnable_problem(best, runtime) is None:
        return RuntimeChoice(best, best, runtime)
    limited = dataclasses.replace(settings, max_tp=1)
    modes = [m for m in MODES if m != "auto"] if mode == "auto" else [mode]
    if settings.zero_stage >= 2:
        modes = [m for m in modes if m == "dp"]  # only one-stage replicas at ZeRO 2/3
    found = []
    for m in modes:
        try:
            p = make_plan(cluster, workload, limited, mode=m, profile=profile)
        except ConfigError:
            continue
        if runnable_problem(p, runtime) is None:
            found.append(p)
    if not found:
        raise PlanningError(f"no plan the {runtime} runtime can run was found (mode {mode}, ZeRO "
                            f"{settings.zero_stage}, {settings.dtype}); the unconstrained best cannot run because "
                            f"{runnable_problem(best, runtime)}; try planner.runtime=any, train.zero_stage=0 or "
                            "train.dtype=fp32")
    chosen = min(found, key=lambda p: p.predicted["step_time_s"])
    return RuntimeChoice(chosen, best, runtime)
