"""``plan(cluster, workload, settings, request) -> PlanResult``: the one planning entry point.

The request (``request.PlanRequest``) chooses which searches run; ``plan`` composes them in one order:

1. **Profile.** A ``profile`` argument (a model profiled on this machine, or the Sailor profile
   ``request.profile=sailor`` names, loaded by the caller: ``reference.sailor_profiles.request_profile``)
   prices the layers it measured; the planning core reads no reference data itself.
   ``mode=low_communication`` replaces steps 2-4: ``low_communication.plan_low_communication`` plans the
   groups, shares, H and codec (figures: ``core.outer_sync_cost``), and the joint search the synchronous
   plan it is compared with (``PlanResult.joint``; ``summary`` is the recommendation line).
2. **One cluster** is planned by ``_plan_cluster``, in this order of precedence: ``compression=joint``:
   placement x inter-node compression (``joint.search_joint``) over data-parallel plans (``mode=auto``
   reads as ``dp`` here); ``runtime`` other than ``any``: the best plan that runtime runs, beside the
   unconstrained best (``runtimes.search_runtime``); otherwise the mode search (``search.search_plan``).
3. **Sub-clusters**, when the request has a money objective, a budget or a throughput floor:
   ``objective.search_objective`` plans sub-clusters, each by step 2, and returns the winner on the whole
   cluster's device list.
4. **Figures.** The chosen plan is scored by the cost model on the request's settings; a new ``Plan``
   carries the search's figures with the used devices' money figures (``core.pricing``) in ``predicted``.
   Nothing is changed afterwards: ``PlanResult`` holds what a report prints beside the plan (the
   unconstrained best and the runtime's slowdown, the compression-blind plan and the devices compression
   brought back, the objective search, the idle devices).

``rescore`` gives a plan made elsewhere the same figures (``het-plan score=``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from het_strategy.core.cost_model import CostModel
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.outer_sync_cost import OuterSyncCost
from het_strategy.core.plan import Plan
from het_strategy.core.plan_score import PlanScore
from het_strategy.core.runtime_rules import Runtime, raise_first, runtime_problems
from het_strategy.core.pricing import plan_price
from het_strategy.planning.joint import JointResult, search_joint
from het_strategy.planning.low_communication import LowCommunicationResult, plan_low_communication, recommendation
from het_strategy.planning.objective import ObjectiveResult, search_objective
from het_strategy.planning.request import CompressionPlanning, PlanMode, PlanRequest
from het_strategy.planning.runtimes import RuntimeChoice, search_runtime
from het_strategy.planning.search import search_plan

if TYPE_CHECKING:
    from het_strategy.core.cluster import ClusterSpec
    from het_strategy.core.train_settings import TrainSettings
    from het_strategy.core.workload import MeasuredProfile, WorkloadSpec

__all__ = ["PlanResult", "plan", "rescore"]


@dataclass(frozen=True)
class PlanResult:
    """The chosen plan and what a report prints beside it."""

    plan: Plan
    """The chosen plan; ``predicted`` holds the cost model's figures and the used devices' money figures."""
    score: PlanScore
    """The cost model's score of ``plan`` on the request's settings."""
    request: PlanRequest
    """What was asked."""
    runtime: RuntimeChoice | None = None
    """``runtime`` other than ``any`` (one cluster planned): the runnable best beside the unconstrained best."""
    joint: JointResult | None = None
    """``compression=joint`` (one cluster planned): every inter-node method's plan."""
    objective: ObjectiveResult | None = None
    """A money objective, budget or floor: how the sub-cluster search went."""
    low_communication: LowCommunicationResult | None = None
    """``mode=low_communication``: the plan's candidates (``joint`` holds the synchronous plan it is compared with)."""

    @property
    def unconstrained(self) -> Plan | None:
        """The fastest plan without the runtime's restriction (None: no runtime restriction asked)."""
        return None if self.runtime is None else self.runtime.unconstrained

    @property
    def runtime_slowdown(self) -> float | None:
        """Predicted step time over the unconstrained best's, minus 1 (None: no runtime restriction asked)."""
        return None if self.runtime is None else self.runtime.slowdown

    @property
    def blind(self) -> Plan | None:
        """The compression-blind plan (``compression=joint`` on a cluster of several nodes)."""
        return None if self.joint is None else self.joint.blind

    @property
    def brought_back(self) -> list[str]:
        """Devices the joint plan uses that the compression-blind plan leaves idle."""
        return [] if self.joint is None else self.joint.brought_back()

    @property
    def idle(self) -> dict[str, str]:
        """Each device the plan leaves idle, with the reason."""
        return dict(self.plan.idle_reasons)

    def summary(self) -> str | None:
        """The line a report prints under the plan's table (None: a plain search, nothing to add)."""
        if self.low_communication is not None:
            return recommendation(self.plan, None if self.joint is None else self.joint.plan,
                                  self.low_communication.budget.min_speedup)
        if self.objective is not None:
            return self.objective.summary()
        if self.joint is not None:
            return _joint_line(self.joint)
        if self.runtime is not None:
            return self.runtime.summary()
        return None


def _joint_line(result: JointResult) -> str:
    step = result.plan.predicted["step_time_s"]
    line = f"joint plan: {result.plan.compression.get('inter_node', 'none')} between nodes, {step * 1e3:.1f} ms/step"
    blind = result.blind
    if blind is not None:
        line += (f"; compression-blind plan {blind.predicted['step_time_s'] * 1e3:.1f} ms/step "
                 f"({blind.predicted['step_time_s'] / step:.2f}x slower)")
        back = result.brought_back()
        line += f"; devices brought back into use: {', '.join(back)}" if back else "; no device brought back"
    return line


def _check_profile(request: PlanRequest, profile: "MeasuredProfile | None") -> None:
    """Step 1: a request naming a profile source comes with that profile, loaded by the caller."""
    if request.profile is not None and profile is None:
        raise field_error("planner.profile", str(request.profile), "come with its profile (the planning core reads "
                          "no reference data)", "pass profile=het_strategy.reference.sailor_profiles."
                          "request_profile(request, workload), as het-plan does")


def _plan_cluster(cluster: "ClusterSpec", workload: "WorkloadSpec", settings: "TrainSettings", request: PlanRequest,
                  profile: "MeasuredProfile | None") -> tuple[Plan, RuntimeChoice | None, JointResult | None]:
    """Step 2: the plan of one cluster, with the runtime's or the joint search's detail."""
    if request.compression == CompressionPlanning.joint:
        joint = search_joint(cluster, workload, settings, mode=str(PlanMode.dp), profile=profile)
        return joint.plan, None, joint
    if request.runtime != "any":
        choice = search_runtime(cluster, workload, settings, mode=str(request.mode), profile=profile,
                                runtime=request.runtime)
        return choice.plan, choice, None
    return search_plan(cluster, workload, settings, str(request.mode), profile), None, None


def plan(cluster: "ClusterSpec", workload: "WorkloadSpec", settings: "TrainSettings",
         request: PlanRequest = PlanRequest(), profile: "MeasuredProfile | None" = None) -> PlanResult:
    """The best plan for ``request`` (see the module docstring for the order of the searches)."""
    _check_profile(request, profile)
    measured = profile
    if request.mode == PlanMode.low_communication:
        return _plan_low_communication(cluster, workload, settings, request, measured)
    runtime = joint = objective = None
    if request.searches_sub_clusters:
        def plan_one(sub: "ClusterSpec") -> Plan:
            return _plan_cluster(sub, workload, settings, request, measured)[0]

        objective = search_objective(cluster, workload, settings, request, plan_one, measured)
        chosen = objective.plan
    else:
        chosen, runtime, joint = _plan_cluster(cluster, workload, settings, request, measured)
    score = CostModel(cluster, workload, settings, measured).score(chosen)
    figures = {**(chosen.predicted or score.to_dict()), **plan_price(chosen, cluster, score.step_time_s).to_dict()}
    return PlanResult(dataclasses.replace(chosen, predicted=figures), score, request, runtime, joint, objective)


def _plan_low_communication(cluster: "ClusterSpec", workload: "WorkloadSpec", settings: "TrainSettings",
                            request: PlanRequest, measured: "MeasuredProfile | None") -> PlanResult:
    """``mode=low_communication``: the low-communication plan, beside the synchronous plan of the joint search
    (data parallelism x inter-node compression; None where no synchronous plan fits)."""
    low = plan_low_communication(cluster, workload, settings, request.outer_sync, measured)
    try:
        joint: JointResult | None = search_joint(cluster, workload, settings, mode=str(PlanMode.dp), profile=measured)
    except ConfigError:
        joint = None
    figures = {**low.plan.predicted, **plan_price(low.plan, cluster, low.score.step_time_s).to_dict()}
    return PlanResult(dataclasses.replace(low.plan, predicted=figures), low.score, request, joint=joint,
                      low_communication=low)


def rescore(given: Plan, cluster: "ClusterSpec", workload: "WorkloadSpec", settings: "TrainSettings",
            profile: "MeasuredProfile | None" = None) -> PlanResult:
    """A plan made elsewhere with this cost model's figures: ``predicted`` is the score, the used devices' money
    figures and the objective the plan records it was searched for, if any."""
    cm = CostModel(cluster, workload, settings, profile)
    base: dict[str, Any]
    if given.outer_sync is not None:  # a low-communication plan: rounds of H inner steps and one exchange
        raise_first(runtime_problems(given, Runtime.hetero_diloco))  # one single-device replica per device
        cost = OuterSyncCost(cm, given.outer_sync.groups)
        score = cost.score(given)
        shares = {pipe.stages[0].devices[0]: pipe.samples for pipe in given.pipelines}
        base = {**score.to_dict(), **cost.figures(shares, given.outer_sync.inner_steps, given.outer_sync.codec)}
    else:
        score = cm.score(given)
        base = score.to_dict()
    made_for: Any = given.predicted.get("objective")
    figures = {**base, **({"objective": made_for} if isinstance(made_for, dict) else {}),
               **plan_price(given, cluster, score.step_time_s).to_dict()}
    return PlanResult(dataclasses.replace(given, predicted=figures), score, PlanRequest())
