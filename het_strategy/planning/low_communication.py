"""The low-communication planner: groups, shares, inner steps H and the outer codec of a ``hetero_diloco`` plan.

Each group of devices (default: one per node) trains as an uneven
data-parallel replica; every H inner steps the groups exchange their
pseudo-gradients in a codec and take an outer step (``core/outer_sync.py``;
priced by ``core/outer_sync_cost.py``).

``plan_low_communication`` plans in three steps, each its own function:

1. **Groups** (``resolve_groups``; ``candidate_splits`` for ``groups=planned``);
2. **Inner split** of the global batch over all devices (``inner_shares``);
3. **H and codec** (``choose_outer_sync``: the choice rule, with a user's
   pinned H or codec).

What every plan keeps: every group takes the same H, so a faster device takes
more samples per inner step and nobody waits at the exchange; every device
takes part, with at least one sample (no idle device: the runtime launches
every rank); at least 2 groups.  ``LowCommunicationResult`` holds the plan
(mode ``low_communication``, one single-device pipeline per device with its
share, ``outer_sync`` set, ``predicted`` from ``OuterSyncCost.figures``) and
every codec's candidate.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import InitVar, dataclass, field
from enum import StrEnum
from typing import Any, Callable, Mapping, Sequence

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.codecs import Codec
from het_strategy.core.cost_model import CostModel
from het_strategy.core.errors import ConfigError, field_error, require_int, require_option
from het_strategy.core.outer_sync import OuterSync, outer_codec
from het_strategy.core.outer_sync_cost import OuterSyncCost
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.core.plan_score import PlanScore
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import MeasuredProfile, WorkloadSpec
from het_strategy.planning.allocation import allocate_min_max
from het_strategy.planning.structure import plan_from_pipelines

__all__ = ["InnerSplit", "OuterSyncBudget", "DEFAULT_BUDGET", "CodecCandidate", "LowCommunicationResult", "sync_overhead",
           "smallest_inner_steps", "resolve_groups", "candidate_splits", "inner_shares", "choose_outer_sync",
           "plan_low_communication",
           "recommendation"]

MODE = "low_communication"


class InnerSplit(StrEnum):
    """How the global batch is split over the devices for the inner steps."""

    planned = "planned"
    """Exact min-max shares: every device ends an inner step at the same time (``inner_shares``)."""
    even = "even"
    """The same share on every device (the baseline)."""


@dataclass(frozen=True)
class OuterSyncBudget:
    """The ``planner.outer_sync`` section: what a low-communication plan may be (``choose_outer_sync``)."""

    max_inner_steps: int = 500
    """The largest H accepted (the quality budget: more local steps drift further between exchanges)."""
    max_sync_overhead: float = 0.05
    """The fraction of an outer round the exchange may take, in (0, 1)."""
    codecs: tuple[str, ...] = ("none", "fp16", "q8", "q4")
    """The outer codecs accepted (each in ``OUTER_CODECS``), the most faithful first."""
    groups: Any = "node"
    """node: one group per node | device: one group per device | planned: the split of the least time per sample
    among ``candidate_splits`` | a list of lists of device names."""
    split: InnerSplit = InnerSplit.planned
    """planned: min-max shares, all devices finish an inner step together | even: equal shares."""
    min_speedup: float = 1.2
    """The predicted speed-up per sample over the synchronous plan below which the synchronous plan is
    recommended: the local steps' cost in quality is not priced, so a small predicted gain does not pay it."""

    names: InitVar[Mapping[str, str] | None] = None
    """Each field's full dotted name in an error, where it is not ``planner.outer_sync.<field>`` (the
    ``hetero_diloco`` strategy's arguments: ``{"codecs": "outer_codecs", ...}``)."""

    def __post_init__(self, names: Mapping[str, str] | None) -> None:
        def name(field_name: str) -> str:
            return (names or {}).get(field_name, f"planner.outer_sync.{field_name}")

        require_int(self.max_inner_steps, name("max_inner_steps"), minimum=1)
        m = self.min_speedup
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 1 <= m < float("inf"):
            raise field_error(name("min_speedup"), m, "be a number >= 1 (the predicted speed-up per sample "
                              "low_communication must reach to be recommended)")
        object.__setattr__(self, "min_speedup", float(m))
        o = self.max_sync_overhead
        if isinstance(o, bool) or not isinstance(o, (int, float)) or not 0 < o < 1:
            raise field_error(name("max_sync_overhead"), o, "be a number in (0, 1) (the fraction of an outer "
                              "round the exchange may take)")
        object.__setattr__(self, "max_sync_overhead", float(o))
        if isinstance(self.codecs, str) or not isinstance(self.codecs, Sequence) or not self.codecs:
            raise field_error(name("codecs"), self.codecs, "be a non-empty list of codecs, e.g. [none, q8, q4]")
        tokens = tuple(str(outer_codec(c, f"{name('codecs')}[{i}]")) for i, c in enumerate(self.codecs))
        if len(set(tokens)) != len(tokens):
            raise field_error(name("codecs"), list(tokens), "list each codec once")
        object.__setattr__(self, "codecs", tokens)
        object.__setattr__(self, "split", require_option(InnerSplit, self.split, name("split"),
                                                         "planned: min-max shares; even: equal shares"))
        object.__setattr__(self, "groups", _checked_groups(self.groups, name("groups")))


def _checked_groups(groups: Any, field_name: str) -> Any:
    if groups in ("node", "device", "planned"):
        return str(groups)
    rule = "be node, device, planned, or a list of lists of device names, e.g. [[a0, a1], [b0, b1]]"
    if isinstance(groups, str) or not isinstance(groups, Sequence) or not all(
            not isinstance(g, str) and isinstance(g, Sequence) and g and all(isinstance(d, str) for d in g)
            for g in groups):
        raise field_error(field_name, groups, rule)
    out = tuple(tuple(g) for g in groups)
    held = [d for g in out for d in g]
    repeated = sorted({d for d in held if held.count(d) > 1})
    if repeated:
        raise field_error(field_name, [list(g) for g in out], f"hold each device once ({', '.join(repeated)} "
                          "are in more than one group)")
    return out


@dataclass(frozen=True)
class CodecCandidate:
    """One codec's candidate (what the report's table prints)."""

    codec: Codec
    inner_steps: int
    """``H_c``: the smallest H within the overhead budget (the pinned H when H is pinned)."""
    exchange_s: float
    """One outer exchange in this codec."""
    round_s: float
    """H x inner step + exchange, at ``min(H_c, max_inner_steps)`` (the pinned H when pinned)."""
    sync_overhead: float
    """The exchange's fraction of that round."""
    feasible: bool
    """Overhead within budget at an H within ``max_inner_steps`` (any H when pinned)."""


@dataclass(frozen=True)
class LowCommunicationResult:
    """The low-communication plan and what a report prints beside it."""

    plan: Plan
    """Mode ``low_communication``, ``outer_sync`` set, ``predicted`` from ``OuterSyncCost.figures``."""
    candidates: tuple[CodecCandidate, ...]
    """Every codec considered, in ``budget.codecs`` order (the pinned codec alone when pinned)."""
    score: PlanScore
    """The plan's figures as a ``PlanScore`` (``OuterSyncCost.score``)."""
    cost: OuterSyncCost
    """The pricing the plan was chosen with (for reports and checks)."""
    even_inner_step_s: float
    """One inner step with equal shares (the baseline the planned split is compared with)."""
    budget: OuterSyncBudget = field(default_factory=OuterSyncBudget)
    splits: tuple[tuple[tuple[tuple[str, ...], ...], float], ...] = ()
    """``groups=planned``: every candidate split and its predicted time per step (``step_time_s``)."""


def sync_overhead(exchange_s: float, inner_step_s: float, inner_steps: int) -> float:
    """The exchange's fraction of one round: ``E / (H x I + E)``."""
    return exchange_s / (inner_steps * inner_step_s + exchange_s)


def smallest_inner_steps(exchange_s: float, inner_step_s: float, max_overhead: float) -> int:
    """The smallest H >= 1 with ``sync_overhead(E, I, H) <= max_overhead`` (``H >= E (1 - o) / (o I)``)."""
    h = max(1, math.ceil(exchange_s * (1 - max_overhead) / (max_overhead * inner_step_s)))
    while h > 1 and sync_overhead(exchange_s, inner_step_s, h - 1) <= max_overhead:  # floating-point edges
        h -= 1
    while sync_overhead(exchange_s, inner_step_s, h) > max_overhead:
        h += 1
    return h


DEFAULT_BUDGET = OuterSyncBudget()
"""The budget's defaults (the ``hetero_diloco`` strategy's options default to them)."""


def resolve_groups(cluster: ClusterSpec, groups: Any, field_name: str = "planner.outer_sync.groups"
                   ) -> tuple[tuple[str, ...], ...]:
    """``node``/``device``/explicit lists as device-name groups covering the cluster once (at least 2 groups).

    ``budget.groups``: ``node`` (one group per node of the cluster), ``device`` (one group per device) or
    explicit lists of device names that cover the cluster's devices exactly once.  ``planned`` is resolved by
    ``plan_low_communication`` over ``candidate_splits``, not here.
    """
    groups = _checked_groups(groups, field_name)
    if groups == "planned":
        raise field_error(field_name, groups, "be node, device or lists of device names here (planned is the "
                          "planner's choice: het-plan planner.outer_sync.groups=planned, then run its plan.json)")
    if groups == "node":
        out = tuple(tuple(d.name for d in node.devices) for node in cluster.nodes)
    elif groups == "device":
        out = tuple((d.name,) for d in cluster.devices)
    else:
        out = groups
        OuterSync(1, "none", out).check_covers([d.name for d in cluster.devices], field_name)
    if len(out) < 2:
        fix = ("the cluster has one node: use groups=device or list the groups" if groups == "node" else
               "split the devices into at least two groups")
        raise field_error(field_name, groups if isinstance(groups, str) else [list(g) for g in out],
                          f"give at least 2 groups (a low-communication plan exchanges between groups; cluster "
                          f"`{cluster.name}` gives {len(out)})", fix)
    return out


def inner_shares(cost: OuterSyncCost, global_batch: int, split: InnerSplit | str) -> dict[str, int]:
    """Per device (cluster order): its samples per inner step.

    ``planned`` is the exact min-max integer split (``allocation.allocate_min_max``, each device at least one
    sample) of ``cost_i(b) = compute_i(b) + post_g`` — the device's forward + backward of b samples plus its
    group's allreduce and update (``OuterSyncCost.device_step_s``) — so every device ends an inner step at
    (nearly) the same time; ``even`` gives every device the same share (``dp_split.equal_split_plan``'s split:
    the baseline).
    """
    devices = [d.name for d in cost.cm.cluster.devices]
    n = len(devices)
    if global_batch < n:
        raise field_error("settings.global_batch_size", global_batch, f"be >= the number of devices ({n}): every "
                          "device of a low-communication plan takes part in every inner step")
    if split == InnerSplit.even:
        return {d: global_batch // n + (1 if i < global_batch % n else 0) for i, d in enumerate(devices)}
    callables: dict[tuple, Callable[[int], float]] = {}  # devices alike share one: allocate_min_max solves them once

    def cost_of(device: str) -> Callable[[int], float]:
        dev = cost.cm.cluster.device(device)
        g = cost.group_of[device]
        key = (cost.cm.device_key(dev), len(cost.groups[g]), cost.post_s(g))
        if key not in callables:
            callables[key] = lambda b, d=device: cost.device_step_s(d, b)
        return callables[key]

    shares = allocate_min_max([cost_of(d) for d in devices], global_batch, minimum=[1] * n)
    if shares is None:
        raise ConfigError("no split of the global batch fits every device of the low-communication plan (each "
                          "device holds a whole replica)", field="settings.global_batch_size", value=global_batch)
    return dict(zip(devices, shares))


def choose_outer_sync(cost: OuterSyncCost, inner_step_s: float, budget: OuterSyncBudget,
                      inner_steps: int | None = None, codec: str | None = None
                      ) -> tuple[int, Codec, tuple[CodecCandidate, ...]]:
    """(H, codec, candidates) by the choice rule, H and/or codec pinned if given.

    With I the inner step and E_c the exchange in codec c, a round's sync overhead at H is
    ``E_c / (H x I + E_c)`` (``sync_overhead``).

    1. For each allowed codec c, ``H_c`` is the smallest H whose overhead is at most
       ``budget.max_sync_overhead`` (``smallest_inner_steps``); c is feasible when
       ``H_c <= budget.max_inner_steps``.
    2. The plan takes the feasible candidate of the smallest H (fewest local steps: the closest to synchronous
       training); among equal H the codec listed first in ``budget.codecs`` (the most faithful).
    3. When none is feasible, H = ``max_inner_steps`` with the codec of the least round time per sample (ties:
       listed first).

    Pinned choices (the strategy passes a user's fixed H or codec): with H pinned, the codec is the first
    listed whose overhead at that H is within the budget, else the one of the least round time; with the
    codec pinned, H is its ``H_c`` when feasible, else ``max_inner_steps``; with both pinned the planner only
    prices them.
    """
    if inner_steps is not None:
        require_int(inner_steps, "plan.outer_sync.inner_steps", minimum=1)
    tokens = (outer_codec(codec, "plan.outer_sync.codec"),) if codec is not None else tuple(Codec(c) for c in
                                                                                           budget.codecs)
    o, cap = budget.max_sync_overhead, budget.max_inner_steps
    candidates = []
    for token in tokens:
        e = cost.exchange(token).total_s
        h_c = inner_steps if inner_steps is not None else smallest_inner_steps(e, inner_step_s, o)
        at = h_c if inner_steps is not None else min(h_c, cap)
        overhead = sync_overhead(e, inner_step_s, at)
        feasible = overhead <= o if inner_steps is not None else h_c <= cap
        candidates.append(CodecCandidate(token, h_c, e, at * inner_step_s + e, overhead, feasible))
    feasible = [c for c in candidates if c.feasible]
    if feasible:  # the smallest H, then the codec listed first (min keeps the first of equals)
        best = min(feasible, key=lambda c: c.inner_steps)
        return best.inner_steps, best.codec, tuple(candidates)
    h = inner_steps if inner_steps is not None else cap
    best = min(candidates, key=lambda c: c.exchange_s)  # the least round time per sample at a common H
    return h, best.codec, tuple(candidates)


def candidate_splits(cluster: ClusterSpec) -> list[tuple[tuple[str, ...], ...]]:
    """The group splits ``groups=planned`` chooses among: one group per node, then, merge by merge, the two groups
    joined by the fastest link (the slowest node pair between them, ``Network.send_s`` of a 1 MB message: every
    such pair would sync each step once merged), down to 2 groups; and one group per device when a node holds
    more than one (its devices' own link is then left out of every step)."""
    from het_strategy.core.network import Network

    net = Network(cluster)
    first = {node.name: node.devices[0].name for node in cluster.nodes}
    groups = [[node.name] for node in cluster.nodes]

    def link_s(a: list[str], b: list[str]) -> float:
        return max(net.send_s(1e6, first[x], first[y]) for x in a for y in b)

    def named(split: list[list[str]]) -> tuple[tuple[str, ...], ...]:
        return tuple(tuple(d.name for n in cluster.nodes if n.name in g for d in n.devices) for g in split)

    out = [named(groups)] if len(groups) >= 2 else []
    while len(groups) > 2:
        i, j = min(((i, j) for i in range(len(groups)) for j in range(i + 1, len(groups))),
                   key=lambda ij: (link_s(groups[ij[0]], groups[ij[1]]), ij))
        groups = groups[:i] + [groups[i] + groups[j]] + groups[i + 1:j] + groups[j + 1:]
        out.append(named(groups))
    if any(len(node.devices) > 1 for node in cluster.nodes):
        out.append(tuple((d.name,) for d in cluster.devices))
    return out


def plan_low_communication(cluster: ClusterSpec, workload: WorkloadSpec, settings: TrainSettings,
                           budget: OuterSyncBudget = OuterSyncBudget(), profile: MeasuredProfile | None = None,
                           inner_steps: int | None = None, codec: str | None = None) -> LowCommunicationResult:
    """The low-communication plan of ``cluster``: groups (``resolve_groups``), inner split (``inner_shares``),
    H and codec (``choose_outer_sync``).

    ``budget.groups="planned"``: every split of ``candidate_splits`` (per node, then nodes merged along their
    fastest links, and per device) is planned so, and the one of the least predicted time per sample wins
    (ties, within 1e-9: the fewest groups, the closest to synchronous training).
    """
    if budget.groups != "planned":
        return _plan_split(cluster, workload, settings, budget, profile, inner_steps, codec)
    results = []
    for split in candidate_splits(cluster):
        try:
            results.append(_plan_split(cluster, workload, settings, dataclasses.replace(budget, groups=split),
                                       profile, inner_steps, codec))
        except ConfigError:
            continue
    if not results:
        raise field_error("planner.outer_sync.groups", "planned", f"find a split of cluster `{cluster.name}` into "
                          "at least 2 groups whose devices each hold the whole model")
    floor = min(r.plan.predicted["step_time_s"] for r in results)
    best = min((r for r in results if r.plan.predicted["step_time_s"] <= floor * (1 + 1e-9)),
               key=lambda r: len(r.plan.outer_sync.groups))
    splits = tuple((r.plan.outer_sync.groups, r.plan.predicted["step_time_s"]) for r in results)
    return dataclasses.replace(best, splits=splits)


def _plan_split(cluster: ClusterSpec, workload: WorkloadSpec, settings: TrainSettings, budget: OuterSyncBudget,
                profile: MeasuredProfile | None, inner_steps: int | None, codec: str | None) -> LowCommunicationResult:
    """The plan for ``budget.groups`` (a fixed split)."""
    cm = CostModel(cluster, workload, settings, profile)
    groups = resolve_groups(cluster, budget.groups)
    cost = OuterSyncCost(cm, groups)
    unfit = [d.name for d in cluster.devices if cost.micro_batch(d.name, 1) is None]
    if unfit:
        raise field_error("settings.micro_batch_sizes", list(settings.micro_batch_sizes), "hold a size whose "
                          f"whole replica fits every device (none fits {', '.join(unfit)}): every device of a "
                          "low-communication plan holds the whole model", "a smaller model, ZeRO or activation "
                          "checkpointing; or leave those devices out of the cluster")
    shares = inner_shares(cost, settings.global_batch_size, budget.split)
    even = inner_shares(cost, settings.global_batch_size, InnerSplit.even)
    inner = cost.inner_step_s(shares)
    h, token, candidates = choose_outer_sync(cost, inner, budget, inner_steps, codec)
    L = workload.num_layers
    pipes = [Pipeline((Stage((d,), (0, L)),), cost.micro_batch(d, b) or 1, b) for d, b in shares.items()]
    made = dataclasses.replace(plan_from_pipelines(cm, pipes, MODE), outer_sync=OuterSync(h, token, groups))
    figures = {**cost.figures(shares, h, token), "inner_split": str(budget.split), "groups": len(groups)}
    made = dataclasses.replace(made, predicted=figures)
    return LowCommunicationResult(made, candidates, cost.score(made), cost, cost.inner_step_s(even), budget)


def recommendation(low: Plan, synchronous: Plan | None, min_speedup: float = 1.2) -> str:
    """One line: low_communication where its predicted time per sample beats the synchronous plan's by at least
    ``min_speedup`` (``OuterSyncBudget.min_speedup``), by how much; else the synchronous plan, saying whether it
    is predicted faster or low_communication's gain is below the bar (time per sample only: H local steps may
    need more samples to reach the same loss)."""
    low_s = low.predicted["step_time_s"] / low.global_batch_size
    assert low.outer_sync is not None
    what = f"low_communication (hetero_diloco, H={low.outer_sync.inner_steps}, {low.outer_sync.codec})"
    if synchronous is None:
        return f"recommendation: {what}; no synchronous plan fits to compare with"
    sync_s = synchronous.predicted["step_time_s"] / synchronous.global_batch_size
    sync = f"the synchronous plan ({synchronous.compression.get('inter_node', 'none')} between nodes)"
    if low_s * min_speedup <= sync_s:
        return (f"recommendation: {what}: predicted {sync_s / low_s:.2f}x faster per sample than {sync} "
                f"({low_s * 1e3:.3g} against {sync_s * 1e3:.3g} ms/sample)")
    if low_s < sync_s:
        return (f"recommendation: {sync}: {what} is predicted only {sync_s / low_s:.2f}x faster per sample "
                f"({low_s * 1e3:.3g} against {sync_s * 1e3:.3g} ms/sample), below "
                f"planner.outer_sync.min_speedup={min_speedup:g}, which would pay for the local steps")
    return (f"recommendation: {sync}: predicted {low_s / sync_s:.2f}x faster per sample than {what} "
            f"({sync_s * 1e3:.3g} against {low_s * 1e3:.3g} ms/sample)")
