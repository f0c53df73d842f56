"""Which devices a data-parallel plan leaves idle, and why.

A very slow device beside fast ones (a CPU needing seconds per sample beside
GPUs) sets the step time if it must take a sample; one on a slow link can cost
more in gradient sync than its compute saves; one that cannot hold a model
replica cannot take part at all.  So the data-parallel planner searches over
the set of devices that run, not only over the shares.

- ``best_device_set``: the fastest pure data-parallel plan over a set of the
  devices (every subset up to ``EXHAUSTIVE_DEVICES`` devices, unions of device
  classes beyond: the steps there) and a reason per idle device;
- ``structure_idle_reasons``: the same reasons for a plan with pipelines (the
  plan plus that device as one more replica, against the plan);
- ``replica_memory``: what a model replica needs on a device, and what it has.

What callers may rely on: no single device left idle would make the step
faster (each was compared with the plan it would join), and every idle device
has a reason: it does not fit, it is too slow (the step with and without it),
or its sync over the slowest link costs more than its compute saves.  With
``settings.idle_devices`` off, every device that fits runs (or there is no plan).
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

from het_strategy.core.cost_model import CostModel
from het_strategy.core.memory import GiB
from het_strategy.core.memory import overhead_bytes
from het_strategy.core.plan import Plan
from het_strategy.core.plan_score import PlanScore
from het_strategy.planning.structure import StructureResult, assemble_plan

__all__ = ["EXHAUSTIVE_DEVICES", "EXHAUSTIVE_CLASSES", "MAX_GROUPS", "replica_memory", "best_device_set",
           "structure_idle_reasons"]

EXHAUSTIVE_DEVICES = 8
EXHAUSTIVE_CLASSES = 6
MAX_GROUPS = 16


def replica_memory(cm: CostModel, device: str) -> tuple[float, float]:
    """(bytes a full model replica needs at the smallest micro-batch, the framework's overhead included; bytes the
    device has) in pure DP."""
    dev = cm.cluster.device(device)
    m = min(cm.settings.micro_batch_sizes)
    dp = max(1, min(cm.cluster.num_devices, cm.settings.global_batch_size))  # most ranks ZeRO can shard over
    need = cm.stage_memory_bytes(0, cm.workload.num_layers, 1, m, 1, dp) + overhead_bytes(dev, 1)
    return need, cm.memory_capacity_bytes(dev)


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


class _Search:
    """Assemblies of the pure-DP plan over device sets, memoised by set."""

    def __init__(self, cm: CostModel) -> None:
        self.cm = cm
        self.order = {d.name: i for i, d in enumerate(cm.cluster.devices)}
        self._memo: dict[frozenset, StructureResult | None] = {}

    def run(self, names: Sequence[str]) -> StructureResult | None:
        key = frozenset(names)
        if key not in self._memo:
            ranked = sorted(key, key=self.order.__getitem__)
            ok = 0 < len(ranked) <= self.cm.settings.global_batch_size
            self._memo[key] = assemble_plan(self.cm, [((d,),) for d in ranked], "dp") if ok else None
        return self._memo[key]

    def best_of(self, sets: Sequence[Sequence[str]]) -> StructureResult | None:
        best = None
        for names in sets:
            res = self.run(names)
            if res is not None and (best is None or res.step_time_s < best.step_time_s):
                best = res
        return best


def _classes(cm: CostModel, names: Sequence[str], key: Callable) -> list[list[str]]:
    out: dict[object, list[str]] = {}
    for n in names:
        out.setdefault(key(cm.cluster.device(n)), []).append(n)
    return list(out.values())


def _idle_groups(cm: CostModel, names: Sequence[str]) -> list[list[str]]:
    """Idle devices alike for the comparison: same class and node; same class alone when that makes too many."""
    groups = _classes(cm, names, lambda d: (cm.device_key(d), d.node))
    return groups if len(groups) <= MAX_GROUPS else _classes(cm, names, cm.device_key)


def _search_sets(cm: CostModel, search: _Search, fitting: list[str]) -> StructureResult | None:
    if len(fitting) <= EXHAUSTIVE_DEVICES:
        subsets = [c for k in range(1, len(fitting) + 1) for c in itertools.combinations(fitting, k)]
        return search.best_of(subsets)
    classes = _classes(cm, fitting, cm.device_key)
    if len(classes) <= EXHAUSTIVE_CLASSES:
        unions = _unions(classes)
    else:  # many kinds of device: drop the slowest kinds one by one
        L = cm.workload.num_layers
        speed = sorted(classes, key=lambda cl: cm.stage_compute_s(cm.cluster.device(cl[0]), 1, 1, 0, L))
        unions = [[n for cl in speed[:k] for n in cl] for k in range(1, len(speed) + 1)]
    best = search.best_of(unions + _node_unions(cm, fitting))
    if best is None:
        return None
    groups = _classes(cm, list(best.plan.used_devices), lambda d: (cm.device_key(d), d.node))
    while 1 < len(groups) <= MAX_GROUPS:
        cands = [[n for h in groups if h is not g for n in h] for g in groups]
        trial = search.best_of(cands)
        if trial is None or trial.step_time_s >= best.step_time_s:
            break
        best = trial
        used = set(trial.plan.used_devices)
        groups = [g for g in groups if g[0] in used]
    return best


def _node_unions(cm: CostModel, fitting: list[str]) -> list[list[str]]:
    """Every union of device classes within one node: the fastest kind spread over several nodes can lose to
    one node of it (no inter-node sync), which the dropping of whole groups from the best union never reaches
    when that union is a slower kind on one node."""
    by_node: dict[str, list[str]] = {}
    for n in fitting:
        by_node.setdefault(cm.cluster.device(n).node, []).append(n)
    out: list[list[str]] = []
    seen: set[tuple] = set()
    for node, names in by_node.items():
        classes = _classes(cm, names, cm.device_key)
        # nodes alike (figures, and the same count of each device class) plan alike within themselves: the
        # first of them stands for the rest, which ``best_of`` would not prefer (it keeps the first best)
        alike = (cm.network.node_class(node), tuple((cm.device_key(cm.cluster.device(cl[0])), len(cl))
                                                     for cl in classes))
        if len(classes) > EXHAUSTIVE_CLASSES or alike in seen:
            continue
        seen.add(alike)
        out += _unions(classes)
    return out


def _unions(classes: list[list[str]]) -> list[list[str]]:
    """The devices of every non-empty combination of ``classes``."""
    return [[n for cl in combo for n in cl] for k in range(1, len(classes) + 1)
            for combo in itertools.combinations(classes, k)]


def best_device_set(cm: CostModel) -> tuple[StructureResult | None, dict[str, str]]:
    """The fastest pure-DP plan over a subset of the devices, and why each device left out is idle.

    1. Devices whose replica (weights, gradients, optimizer state, one micro-batch of the smallest size)
       exceeds their memory are idle: "does not fit".
    2. Among the others, the set S minimising the step time of the exact uneven split
       (``structure.assemble_plan``) over S:

       * up to ``EXHAUSTIVE_DEVICES`` devices: every non-empty subset (exact);
       * otherwise every union of device classes (a class: devices of equal cost figures,
         ``CostModel.device_key``; up to ``EXHAUSTIVE_CLASSES`` classes) and every union of classes within
         one node, then, per (class, node) group, drop it while that is faster (``MAX_GROUPS`` groups at
         most);
       * then every idle device is compared with the plan it would join: the best plan over S plus that
         device.  If that is faster, it joins (and the comparison repeats), so no single device left idle
         would make the step faster.

    3. Each idle device gets its reason from that comparison: too slow (the step with and without it), or its
       sync over the slowest link costs more than its compute saves.  (The global batch is at least the device
       count, ``dp_split``: every launched rank takes part in every step.)

    Tuning: the search costs at most ``2**EXHAUSTIVE_DEVICES`` assemblies on small clusters and a few dozen on
    large ones.
    """
    reasons: dict[str, str] = {}
    fitting = []
    m = min(cm.settings.micro_batch_sizes)
    for d in cm.cluster.devices:
        need, have = replica_memory(cm, d.name)
        if need > have:
            reasons[d.name] = (f"does not fit: a model replica needs {need / GiB:.1f} GiB at micro-batch {m}, "
                               f"it has {have / GiB:.1f} GiB")
        else:
            fitting.append(d.name)
    search = _Search(cm)
    if not cm.settings.idle_devices:  # every launched rank runs each step: all of them, or no plan
        return (search.best_of([fitting]) if not reasons else None), reasons
    best = _search_sets(cm, search, fitting) if fitting else None
    if best is None:
        return None, reasons
    best = _add_back(cm, search, best, fitting)
    used = set(best.plan.used_devices)
    idle = [n for n in fitting if n not in used]
    without = cm.score(best.plan)
    for group in _idle_groups(cm, idle):
        why = _reason(cm, search, best, without, group[0])
        for n in group:
            reasons[n] = why
    best.plan.idle_reasons = {d.name: reasons[d.name] for d in cm.cluster.devices if d.name in reasons}
    return best, best.plan.idle_reasons


def _add_back(cm: CostModel, search: _Search, best: StructureResult, fitting: list[str]) -> StructureResult:
    """Let an idle device join while one joining makes the step faster (one per (class, node) group tried)."""
    while True:
        used = list(best.plan.used_devices)
        taken = set(used)
        idle = [n for n in fitting if n not in taken]
        reps = [g[0] for g in _idle_groups(cm, idle)]
        trial = search.best_of([used + [r] for r in reps])
        if trial is None or trial.step_time_s >= best.step_time_s * (1 - 1e-12):
            return best
        best = trial


def _reason(cm: CostModel, search: _Search, best: StructureResult, s_without: PlanScore, device: str) -> str:
    """Why ``device`` is idle: the plan with it against the plan without it."""
    used = list(best.plan.used_devices)
    with_it = search.run(used + [device])
    if with_it is None:
        return "no plan with it fits in memory"
    s_with = cm.score(with_it.plan)
    post_with = s_with.sync_time_s + s_with.update_time_s
    post_without = s_without.sync_time_s + s_without.update_time_s
    compute_with, compute_without = max(s_with.pipeline_times_s), max(s_without.pipeline_times_s)
    steps = f"with it the step takes {_fmt_s(s_with.step_time_s)}, without {_fmt_s(s_without.step_time_s)}"
    if compute_with < compute_without and post_with > post_without:
        bw = cm.cluster.min_bandwidth(used + [device]) / 1e9
        return (f"its gradient sync over the {bw:g} GB/s link costs more than its compute saves: {steps} "
                f"(sync + update {_fmt_s(post_with)} against {_fmt_s(post_without)})")
    k = with_it.plan.used_devices.index(device)
    pipe = with_it.plan.pipelines[k]
    return (f"too slow: {steps} (its share, {pipe.samples} sample{'s' if pipe.samples != 1 else ''}, takes it "
            f"{_fmt_s(s_with.pipeline_times_s[k])})")


def structure_idle_reasons(cm: CostModel, plan: Plan) -> dict[str, str]:
    """Reasons for the idle devices of a plan with pipelines: each compared with one more replica on it."""
    used = set(plan.used_devices)
    idle = [d.name for d in cm.cluster.devices if d.name not in used]
    if not idle:
        return {}
    structure = [tuple(stage.devices for stage in pipe.stages) for pipe in plan.pipelines]
    without = cm.score(plan).step_time_s
    m = min(cm.settings.micro_batch_sizes)
    reasons: dict[str, str] = {}
    for group in _idle_groups(cm, idle):
        need, have = replica_memory(cm, group[0])
        if need > have:
            why = (f"no stage of the {plan.mode} plan is on it, and a model replica does not fit: it needs "
                   f"{need / GiB:.1f} GiB at micro-batch {m}, it has {have / GiB:.1f} GiB")
        else:
            res = assemble_plan(cm, [*structure, ((group[0],),)], plan.mode)
            if res is None:
                why = f"no stage of the {plan.mode} plan is on it, and no plan with it as one more replica fits"
            else:
                with_s = res.step_time_s  # assemble_plan's step is the plan's score
                steps = f"with it as one more replica the step takes {_fmt_s(with_s)}, without {_fmt_s(without)}"
                why = (f"too slow: {steps}" if with_s >= without else
                       f"left out by the {plan.mode} search, which does not try it as one more replica ({steps})")
        for n in group:
            reasons[n] = why
    return reasons
