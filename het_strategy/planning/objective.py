"""Plans for a money objective: the cheapest plan per iteration, or the fastest within a budget (as Sailor's).

The mode search finds the fastest plan and already leaves slow devices
idle; an idle device is not rented, so a plan's price is that of its *used*
devices (``core/pricing.py``).  Money changes the answer: the cheapest plan
per iteration often leaves fast, expensive devices out, and a budget can rule
out the fastest plan.  ``search_objective`` (step 3 of ``planning.plan``, for a
``PlanRequest`` with ``objective=cost``, a ``budget_per_hour`` or a
``min_throughput``) therefore plans sub-clusters (``_subsets``) in the order of
a lower bound on their step time (``sub_cluster_bound``) and stops once the bound exceeds
the best plan found (the steps: there).

Why skipping by a sub-cluster's own bound, or its total price, loses no plan: a
plan on a sub-cluster that leaves some of its devices idle is a plan of the
smaller sub-cluster of its used devices (up to the interchangeable devices'
names), which the search holds too and whose planner search covers it.  (The
planners are exact for data parallelism; for pipelines and hybrids, which are
searched heuristically, this is an assumption the tests check against brute
force on small clusters.)

The winner is returned on the whole cluster's device list (``cluster_devices``
unchanged, so the strategy and ``het-plan score=`` accept it), rescored there,
with the devices left out marked idle ("not rented") and the money figures and
the objective in ``plan.predicted``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

from het_strategy.core.cluster import ClusterSpec, NodeSpec
from het_strategy.core.cost_model import CostModel
from het_strategy.core.device_spec import DeviceSpec
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.plan import Plan
from het_strategy.core.pricing import SECONDS_PER_HOUR, devices_price_per_hour, plan_price, require_prices
from het_strategy.core.workload import MeasuredProfile, WorkloadSpec
from het_strategy.planning.request import PlanRequest
from het_strategy.planning.search import fsdp_in_auto
from het_strategy.planning.sub_cluster_bound import SubClusterBound

__all__ = ["MAX_SUBSETS", "Candidate", "ObjectiveResult", "search_objective", "sub_cluster"]

MAX_SUBSETS = 4096
"""Most sub-clusters one search may hold (each one may be planned: about 0.05-0.5 s each)."""


@dataclass(frozen=True)
class _Goal:
    """The request's objective, budget and floor applied to candidates (the request checked the values)."""

    request: PlanRequest

    def within_budget(self, c: "Candidate") -> bool:
        budget = self.request.budget_per_hour
        return budget is None or (c.dollars_per_hour or 0.0) <= budget * (1 + 1e-12)

    def reaches_floor(self, c: "Candidate") -> bool:
        floor = self.request.min_throughput
        return floor is None or c.samples_per_s >= floor * (1 - 1e-12)

    def allows(self, c: "Candidate") -> bool:
        return self.within_budget(c) and self.reaches_floor(c)

    def score(self, c: "Candidate") -> tuple[float, ...]:
        """Smaller is better: (USD/iteration, step time, devices) for ``cost``; (step time, USD/hour, devices)."""
        if self.request.objective == "cost":
            return (c.dollars_per_iteration or 0.0, c.step_time_s, len(c.plan.used_devices))
        return (c.step_time_s, c.dollars_per_hour or 0.0, len(c.plan.used_devices))


@dataclass(frozen=True)
class Candidate:
    """One planned sub-cluster's plan and its figures."""

    kept: tuple[str, ...]
    """The sub-cluster's devices (cluster order)."""
    plan: Plan
    """Its plan, on the sub-cluster."""
    dollars_per_hour: float | None
    """USD per hour of the plan's used devices (None: some has no price)."""
    step_time_s: float
    samples_per_s: float

    @property
    def dollars_per_iteration(self) -> float | None:
        return None if self.dollars_per_hour is None else self.dollars_per_hour * self.step_time_s / SECONDS_PER_HOUR

    def describe(self) -> str:
        money = "price unknown" if self.dollars_per_hour is None else \
            f"${self.dollars_per_hour:.2f}/hour, ${self.dollars_per_iteration:.3g}/iteration"
        return f"{money}, {self.samples_per_s:.1f} samples/s on {_devices(len(self.plan.used_devices))}"


@dataclass
class ObjectiveResult:
    """The chosen plan and how the search went."""

    plan: Plan
    """The chosen plan on the whole cluster's device list (money figures in ``predicted``)."""
    request: PlanRequest
    """The request searched for (its objective, budget and floor)."""
    best: Candidate
    """The chosen plan's figures (on its sub-cluster)."""
    fastest: Candidate | None
    """The plan of the whole cluster (the planner's fastest), when one fits."""
    search: str
    """``whole cluster``, ``devices per (node, kind)`` or ``whole nodes``."""
    num_subsets: int
    """Sub-clusters in the search space."""
    candidates: list[Candidate] = field(default_factory=list)
    """Every sub-cluster planned that has a plan (the others were bounded out, skipped or fit nothing)."""

    def summary(self) -> str:
        line = f"{self.request.describe_objective()}: {self.best.describe()}"
        if self.search != "whole cluster":
            line += f"; {len(self.candidates)} of {self.num_subsets} sub-clusters planned ({self.search})"
        if self.fastest is not None and self.fastest.kept != self.best.kept:
            line += f"; the fastest plan: {self.fastest.describe()}"
        return line


def _devices(n: int) -> str:
    return f"{n} device{'s' if n != 1 else ''}"


def sub_cluster(cluster: ClusterSpec, kept: set[str] | frozenset[str]) -> ClusterSpec:
    """``cluster`` with only the devices ``kept`` (same names; empty nodes, their links and slowdowns dropped)."""
    nodes = tuple(dataclasses.replace(n, devices=tuple(d for d in n.devices if d.name in kept))
                  for n in cluster.nodes if any(d.name in kept for d in n.devices))
    names = {n.name for n in nodes}
    return dataclasses.replace(cluster, nodes=nodes, links=tuple(l for l in cluster.links if set(l.nodes) <= names),
                               slowdowns=tuple(s for s in cluster.slowdowns if s.device in kept))


def search_objective(cluster: ClusterSpec, workload: WorkloadSpec, settings: TrainSettings, request: PlanRequest,
                     plan_cluster: Callable[[ClusterSpec], Plan], profile: MeasuredProfile | None = None, *,
                     max_subsets: int = MAX_SUBSETS) -> ObjectiveResult:
    """The best plan for the request's objective within its budget and floor.

    ``plan_cluster(sub)`` plans one sub-cluster (``ConfigError``: nothing fits there).

    1. The whole cluster is planned first: that plan is the planner's fastest, so a floor it misses is an
       error right away; with ``objective="time"``, when it meets the budget (and floor) it is the answer (no
       search).
    2. The sub-clusters (``_subsets``): per node, how many devices of each kind to keep, or, past
       ``max_subsets``, how many whole nodes per class of identical nodes.
    3. Each sub-cluster gets a lower bound on its step time that holds for any plan using all its devices
       (``sub_cluster_bound``): its compute alone, every device running at its best per-sample rate (any
       micro-batch, tensor-parallel degree) with no bubble, send or sync, in closed form.  Sub-clusters are
       planned in the order of that bound (of $/iteration for ``cost``, of step time for ``time``); the search
       stops once the bound exceeds the best plan found.  A sub-cluster is skipped when a sharper bound shows
       it cannot beat the best plan (the LP over the layers, with each device's pipeline fill and optimizer
       update: ``SubClusterBound.exceeds``), when it is pricier in total than the budget, or when its bound
       misses the floor.
    4. Each sub-cluster is planned by ``plan_cluster`` (``planning.plan`` passes its one-cluster step: the
       mode search, the runtime's or the joint search, as the request asks), its plan priced by its used
       devices; the best plan meeting the budget and floor wins (``cost``: least $/iteration, then fastest;
       ``time``: fastest, then cheapest).

    Tuning: a cluster with many distinct (node, kind) groups searches whole nodes; describe identical nodes
    with ``count:`` so they form one class.
    """
    goal = _Goal(request)
    if request.objective == "cost" or request.budget_per_hour is not None:
        require_prices(cluster, f"planner.objective={request.objective}" if request.objective == "cost"
                       else "planner.budget_per_hour")
    search = _Search(cluster, workload, settings, profile, plan_cluster, goal, max_subsets)
    everything = tuple(d.name for d in cluster.devices)
    full = search.run(everything)
    if full is not None and not goal.reaches_floor(full):
        raise search.floor_error(full, within_budget=False)  # the planner's fastest plan misses it: every plan does
    if request.objective == "time" and full is not None and goal.allows(full):
        return search.result(full, full, "whole cluster", 1)
    space, how = _subsets(cluster, max_subsets, request)
    best = full if full is not None and goal.allows(full) else None
    cm = CostModel(cluster, workload, settings, profile)
    # every plan a sub-cluster can get is a pipeline plan (no fsdp, whose update is sharded): overheads count
    pipelines_only = (settings.zero_stage == 0 and str(request.mode) != "fsdp" and str(request.runtime) != "hetero_fsdp"
                      and not fsdp_in_auto(cm))
    bounds = SubClusterBound(cm, settings, with_overheads=pipelines_only)
    order = sorted(space, key=lambda kept: (_bound_key(bounds, kept, request.objective, search), kept))
    for kept in order:
        if kept == everything:
            continue
        if request.budget_per_hour is not None and search.total_price(kept) > request.budget_per_hour:
            continue
        if request.min_throughput is not None and bounds.max_samples_per_s(kept) < request.min_throughput:
            continue
        if best is not None and _bound_key(bounds, kept, request.objective, search) > goal.score(best)[0]:
            break  # ordered by the bound: no later sub-cluster can beat the best
        if best is not None and bounds.exceeds(kept, _limit_s(best, kept, request.objective, search, goal)):
            continue  # the sharper bound: this one cannot beat the best
        found = search.run(kept)
        if found is not None and goal.allows(found) and (best is None or goal.score(found) < goal.score(best)):
            best = found
    if best is None:
        raise search.nothing_meets(space)
    return search.result(best, full, how, len(space))


# -- the search -------------------------------------------------------------------------------------

class _Search:
    """Plans sub-clusters (once each) with the planner the settings ask for."""

    def __init__(self, cluster: ClusterSpec, workload: WorkloadSpec, settings: TrainSettings,
                 profile: MeasuredProfile | None, plan_cluster: Callable[[ClusterSpec], Plan], goal: _Goal,
                 max_subsets: int) -> None:
        self.cluster, self.workload, self.settings, self.profile = cluster, workload, settings, profile
        self.plan_cluster, self.goal, self.max_subsets = plan_cluster, goal, max_subsets
        self.request = goal.request
        self.planned: dict[tuple[str, ...], Candidate | None] = {}
        self.errors: dict[tuple[str, ...], ConfigError] = {}

    def total_price(self, kept: tuple[str, ...]) -> float:
        return devices_price_per_hour(self.cluster, kept) or 0.0

    def run(self, kept: tuple[str, ...]) -> Candidate | None:
        """The plan of the sub-cluster ``kept`` (None when nothing fits on it)."""
        if kept in self.planned:
            return self.planned[kept]
        try:
            found = self.plan_cluster(sub_cluster(self.cluster, frozenset(kept)))
        except ConfigError as exc:  # nothing fits there (memory, batch < ranks, ...): other sub-clusters may fit
            self.errors[kept] = exc
            self.planned[kept] = None
            return None
        step = float(found.predicted["step_time_s"])
        cand = Candidate(kept, found, devices_price_per_hour(self.cluster, found.used_devices), step,
                         self.settings.global_batch_size / step)
        self.planned[kept] = cand
        return cand

    def result(self, best: Candidate, full: Candidate | None, how: str, num_subsets: int) -> ObjectiveResult:
        return ObjectiveResult(self._on_whole_cluster(best), self.goal.request, best, full, how, num_subsets,
                               [c for c in self.planned.values() if c is not None])

    def _on_whole_cluster(self, best: Candidate) -> Plan:
        """The chosen plan on every device of the cluster: the left-out ones idle (not rented), rescored."""
        why = (f"not rented: planner.objective={self.request.objective}" +
               (f" within planner.budget_per_hour={self.request.budget_per_hour:g}"
                if self.request.budget_per_hour is not None else "") + " leaves it out of the plan")
        reasons = {d.name: best.plan.idle_reasons.get(d.name, why) for d in self.cluster.devices
                   if d.name not in set(best.plan.used_devices)}
        plan = dataclasses.replace(best.plan, cluster_devices=tuple(d.name for d in self.cluster.devices),
                                   idle_reasons=reasons, predicted={})
        score = CostModel(self.cluster, self.workload, self.settings, self.profile).score(plan)
        plan.predicted = {**score.to_dict(), **plan_price(plan, self.cluster, score.step_time_s).to_dict(),
                          "objective": self.request.objective_dict()}
        return plan

    def nothing_meets(self, space: list[tuple[str, ...]]) -> ConfigError:
        """Why no plan meets the budget and floor, in the figures of the cheapest (or fastest) plan there is."""
        goal, request = self.goal, self.request
        cheapest = self._cheapest(space)
        if cheapest is None:  # nothing fits anywhere: the planner's own reason, for the whole cluster
            err = self.errors.get(tuple(d.name for d in self.cluster.devices))
            return err if err is not None else ConfigError("no sub-cluster has a plan that fits", field="planner")
        if request.budget_per_hour is not None and not goal.within_budget(cheapest):
            return field_error("planner.budget_per_hour", request.budget_per_hour,
                               f"be met by some plan; the cheapest plan costs ${cheapest.dollars_per_hour:.2f}/hour "
                               f"({cheapest.samples_per_s:.1f} samples/s on "
                               f"{_devices(len(cheapest.plan.used_devices))})",
                               "raise the budget or add cheaper devices")
        return self.floor_error(self._fastest_within_budget(), within_budget=request.budget_per_hour is not None)

    def floor_error(self, fastest: Candidate | None, within_budget: bool) -> ConfigError:
        request = self.request
        scope = f" within planner.budget_per_hour={request.budget_per_hour:g}" if within_budget else ""
        figures = "no plan fits" + scope if fastest is None else (
            f"the fastest plan{scope} reaches {fastest.samples_per_s:.1f} samples/s at "
            + ("an unknown price" if fastest.dollars_per_hour is None else f"${fastest.dollars_per_hour:.2f}/hour")
            + f" on {_devices(len(fastest.plan.used_devices))}")
        return field_error("planner.min_throughput", request.min_throughput, "be reached by some plan; " + figures,
                           "lower the floor" + (", raise the budget" if scope else "") + " or add faster devices")

    def _cheapest(self, space: list[tuple[str, ...]]) -> Candidate | None:
        """The plan with the least $/hour: sub-clusters planned from the cheapest up until one fits."""
        best = min((c for c in self.planned.values() if c is not None), key=lambda c: c.dollars_per_hour,
                   default=None)
        for kept in sorted(space, key=lambda k: (self.total_price(k), k)):
            if best is not None and self.total_price(kept) >= best.dollars_per_hour:
                break
            found = self.run(kept)
            if found is not None and (best is None or found.dollars_per_hour < best.dollars_per_hour):
                best = found
        return best

    def _fastest_within_budget(self) -> Candidate | None:
        try:
            fastest = dataclasses.replace(self.goal.request, objective="time", min_throughput=None)
            return search_objective(self.cluster, self.workload, self.settings, fastest, self.plan_cluster,
                                    self.profile, max_subsets=self.max_subsets).best
        except ConfigError:
            return None


# -- the sub-clusters and their bounds ------------------------------------------------------------------

def _device_kind(cluster: ClusterSpec, d: DeviceSpec) -> tuple:
    """Devices of one kind cost the same and price the same (a scheduled slowdown makes a device its own kind)."""
    own = (d.name,) if any(s.device == d.name for s in cluster.slowdowns) else ()
    return (d.type, tuple(sorted(d.tflops.items())), d.memory_gb, d.memory_bandwidth_gbs, d.efficiency,
            d.emulated_speed, d.price_per_hour, d.codec_gbs, own)


def _node_class(cluster: ClusterSpec, n: NodeSpec, linked: set[str]) -> tuple:
    if n.name in linked:
        return ("linked", n.name)
    return (tuple(_device_kind(cluster, d) for d in n.devices), n.intra_bandwidth_gbs, n.inter_bandwidth_gbs,
            n.inter_flow_bandwidth_gbs)


def _subsets(cluster: ClusterSpec, max_subsets: int, request: PlanRequest) -> tuple[list[tuple[str, ...]], str]:
    """Every sub-cluster of the search (device names in cluster order) and how they were formed.

    Per node, how many devices of each kind to keep (0..n of each (node, device kind) group; devices of one
    kind in one node are interchangeable, so which ones is immaterial and the first ones are kept, under their
    own names).  When that space exceeds ``max_subsets`` (``MAX_SUBSETS``), whole nodes are kept instead: per
    class of identical nodes (same devices and bandwidths, named in no ``links`` entry), how many (partial
    nodes are then not searched, though each node's plan may still leave devices idle); beyond that too,
    ``ConfigError``.
    """
    groups: dict[tuple, list[str]] = {}
    for d in cluster.devices:
        groups.setdefault((d.node, _device_kind(cluster, d)), []).append(d.name)
    units, how = list(groups.values()), "devices per (node, kind)"
    size = math.prod(len(u) + 1 for u in units) - 1
    if size > max_subsets:
        linked = {n for link in cluster.links for n in link.nodes}
        classes: dict[tuple, list[list[str]]] = {}
        for n in cluster.nodes:
            classes.setdefault(_node_class(cluster, n, linked), []).append([d.name for d in n.devices])
        whole = math.prod(len(c) + 1 for c in classes.values()) - 1
        if whole > max_subsets:
            field = "planner.objective" if request.objective == "cost" else "planner.budget_per_hour"
            raise field_error(field, request.objective if request.objective == "cost" else request.budget_per_hour,
                              f"go with a cluster of at most {max_subsets} sub-clusters to search: `{cluster.name}` "
                              f"has {size} (devices per node and kind) and {whole} (whole nodes per class of "
                              f"identical nodes)", "describe identical nodes with `count:` so they form one "
                              "class, or plan a representative part of the cluster")
        counts = [range(len(nodes) + 1) for nodes in classes.values()]
        members = list(classes.values())
        order = {d.name: i for i, d in enumerate(cluster.devices)}
        space = [tuple(sorted((d for nodes, k in zip(members, ks) for node in nodes[:k] for d in node),
                              key=order.__getitem__))
                 for ks in itertools.product(*counts) if any(ks)]
        return space, "whole nodes"
    order = {d.name: i for i, d in enumerate(cluster.devices)}
    space = [tuple(sorted((d for unit, k in zip(units, ks) for d in unit[:k]), key=order.__getitem__))
             for ks in itertools.product(*(range(len(u) + 1) for u in units)) if any(ks)]
    return space, how


def _limit_s(best: Candidate, kept: tuple[str, ...], objective: str, search: _Search, goal: _Goal) -> float:
    """The step seconds past which a plan on ``kept`` cannot beat ``best`` (with a margin of 1e-9: a tie is
    never skipped)."""
    figure = goal.score(best)[0] * (1 + 1e-9)
    if objective != "cost":
        return figure
    price = search.total_price(kept)
    return figure * SECONDS_PER_HOUR / price if price > 0 else math.inf


def _bound_key(bounds: SubClusterBound, kept: tuple[str, ...], objective: str, search: _Search) -> float:
    """The bound on the objective's figure: $/iteration (``cost``) or step seconds (``time``)."""
    lower = bounds.step_time_s(kept)
    return search.total_price(kept) * lower / SECONDS_PER_HOUR if objective == "cost" else lower
