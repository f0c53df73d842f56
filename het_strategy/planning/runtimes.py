"""Plans a runtime can execute: ``planner.runtime`` and the price of the constraint.

``runtime="any"`` is the unconstrained search.  ``runtime="deepspeed"`` keeps
the plans ``hetero_deepspeed`` runs, ``runtime="hetero"`` the pure
data-parallel plans of the ``hetero`` strategy and ``runtime="hetero_fsdp"``
the fully sharded plans of mode ``fsdp``; what each runtime runs is the
rule table of ``het_strategy.core.runtime_rules`` (``runtime_problems``), the
same table the runtimes check a plan against, so the planner keeps exactly
the plans they accept.

When the unconstrained best cannot run, each planner is searched again at
``max_tp = 1`` and its best kept if runnable (only the ``dp`` planner where
the runtime takes one-stage replicas only: ``hetero``, and ``deepspeed`` at
ZeRO 2/3).  A hybrid search whose best is asymmetric where asymmetry cannot
run (ZeRO >= 1, not fp32) is then represented by the aligned searches (one
pipeline over every device, one-stage replicas), so an aligned multi-pipeline
plan may be missed there.

A runtime other than ``hetero_fsdp`` is compared with the best of the
modes without fsdp (it can run no fsdp plan). ``search_runtime`` returns the
best runnable plan and the unconstrained best, so the caller can say how much slower (by the cost model) the runnable
one is; for ``deepspeed`` the gap is 0 for fp32 ZeRO-0 plans without tensor
parallelism, asymmetric replicas included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.errors import ConfigError
from het_strategy.core.plan import Plan
from het_strategy.core.runtime_rules import Runtime, as_runtime, runtime_problems
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import MeasuredProfile, WorkloadSpec

__all__ = ["RuntimeChoice", "runnable", "search_runtime"]


def runnable(plan: Plan, runtime: Runtime | str) -> bool:
    """The planner's filter: ``runtime`` runs ``plan`` (its ``runtime_problems`` list is empty)."""
    return not runtime_problems(plan, runtime)


def _searches(mode: str, runtime: Runtime, settings: TrainSettings) -> list[tuple[str, TrainSettings]]:
    """The searches run again at tp = 1 for ``runtime``: (mode, settings) of the planners whose plans it may run.

    At ZeRO 2/3 the deepspeed runtime runs one-stage replicas whose micro-batch
    counts it can equalise (rule 5 of ``core.runtime_rules``): beside the plain dp
    search, one dp search per single micro-batch size and one with equal shares
    find such plans where the fastest dp plan mixes counts.
    """
    from het_strategy.planning.search import MODES

    limited = dataclasses.replace(settings, max_tp=1)
    modes = [m for m in MODES if m != "auto"] if mode == "auto" else [mode]
    if runtime is Runtime.hetero_fsdp:  # it runs fsdp plans only, which use no tensor parallelism
        return [("fsdp", settings)] if "fsdp" in modes else []
    modes = [m for m in modes if m != "fsdp"]  # only hetero_fsdp runs fsdp plans
    one_stage = runtime is Runtime.hetero or (runtime is Runtime.deepspeed and settings.zero_stage >= 2)
    if not one_stage:
        return [(m, limited) for m in modes]
    if "dp" not in modes:
        return []
    searches = [("dp", limited)]
    if runtime is Runtime.deepspeed:
        searches += [("dp", dataclasses.replace(limited, micro_batch_sizes=(m,))) for m in settings.micro_batch_sizes]
        searches.append(("dp", dataclasses.replace(limited, equal_shares=True)))
    return searches


@dataclass(frozen=True)
class RuntimeChoice:
    """The best plan ``runtime`` runs, beside the unconstrained best."""

    plan: Plan
    """The best plan ``runtime`` runs."""
    unconstrained: Plan
    """The best plan of the unconstrained search (``plan`` itself when the runtime runs it)."""
    runtime: Runtime
    """The runtime the plan is for."""

    @property
    def slowdown(self) -> float:
        """Predicted step time of ``plan`` over the unconstrained best's, minus 1 (0.0: nothing lost)."""
        return self.plan.predicted["step_time_s"] / self.unconstrained.predicted["step_time_s"] - 1.0

    def summary(self) -> str:
        if self.runtime is Runtime.any:
            return "runtime any: the unconstrained best plan"
        problems = runtime_problems(self.unconstrained, self.runtime)
        if not problems:
            return f"runtime {self.runtime}: the best plan is runnable (0.0% slower than the unconstrained best)"
        return (f"runtime {self.runtime}: the best runnable plan is {self.slowdown * 100:.1f}% slower by the cost "
                f"model than the unconstrained best, which it cannot run: {problems[0]}")


def search_runtime(cluster: ClusterSpec, workload: WorkloadSpec, settings: TrainSettings, mode: str = "auto",
                   profile: MeasuredProfile | None = None, runtime: Runtime | str = Runtime.any) -> RuntimeChoice:
    """Step 2 of ``planning.plan`` for ``PlanRequest(runtime=...)``: the mode search, keeping only plans
    ``runtime`` runs (``runtime_problems`` empty)."""
    from het_strategy.planning.search import PlanningError, search_plan as make_plan

    target = as_runtime(runtime)
    # only hetero_fsdp runs fsdp plans (and asks for mode fsdp): the other runtimes' best is compared with the
    # best of the modes they may run
    best = make_plan(cluster, workload, settings, mode=mode, profile=profile, with_fsdp=target is Runtime.hetero_fsdp)
    why = runtime_problems(best, target)
    if not why:
        return RuntimeChoice(best, best, target)
    found = []
    for m, limited in _searches(mode, target, settings):
        try:
            p = make_plan(cluster, workload, limited, mode=m, profile=profile, with_fsdp=False)
        except ConfigError:
            continue
        if runnable(p, target):
            found.append(p)
    if not found:
        raise PlanningError(f"no plan the {target} runtime can run was found (mode {mode}, ZeRO "
                            f"{settings.zero_stage}, {settings.dtype}); the unconstrained best cannot run because "
                            f"{why[0]}; try planner.runtime=any, settings.zero_stage=0 or settings.dtype=fp32")
    chosen = min(found, key=lambda p: p.predicted["step_time_s"])
    if chosen.predicted["step_time_s"] <= best.predicted["step_time_s"]:
        # the restricted searches found a runnable plan at least as fast as the unconstrained search's (which is
        # not exhaustive in every mode): that plan is the unconstrained best too, and nothing is lost
        return RuntimeChoice(chosen, chosen, target)
    return RuntimeChoice(chosen, best, target)
