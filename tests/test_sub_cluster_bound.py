"""The sub-cluster bound of the cost search (``planning/sub_cluster_bound.py``): valid, tight, and plan-preserving.

The LP check (``SubClusterBound.exceeds``) only skips sub-clusters; the reference is the same search with the
closed-form bound alone (the order and stop rule the search had before the LP), which plans more of them.
"""

from __future__ import annotations

import itertools

import pytest

from het_strategy.core.cluster import ClusterSpec, cluster_from_dict
from het_strategy.core.cost_model import CostModel
from het_strategy.core.errors import ConfigError
from het_strategy.core.shipped import shipped_path
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import load_workload
from het_strategy.planning import PlanRequest, plan, search_plan
from het_strategy.planning.objective import sub_cluster
from het_strategy.planning.sub_cluster_bound import SubClusterBound


def _mixed() -> ClusterSpec:
    """The default cluster's kinds, smaller: A100 + V100 + T4 on one PCIe node, two A10G on another."""
    return cluster_from_dict({"name": "mixed_small", "inter_node_bandwidth_gbs": 12.5, "nodes": [
        {"name": "mixed", "intra_bandwidth_gbs": 16, "devices": [
            {"type": "A100-40GB", "count": 1}, {"type": "V100-16GB", "count": 1}, {"type": "T4", "count": 1}]},
        {"name": "a10g", "intra_bandwidth_gbs": 16, "devices": [{"type": "A10G", "count": 2}]}]})


def _identical_nodes() -> ClusterSpec:
    """Metis' shape, smaller: a T4 node and two identical A100 nodes of two (many sub-clusters of one kind)."""
    return cluster_from_dict({"name": "metis_small", "inter_node_bandwidth_gbs": 12.5, "nodes": [
        {"name": "t4", "intra_bandwidth_gbs": 16, "devices": [{"type": "T4", "count": 2}]},
        {"name": "a100_", "count": 2, "intra_bandwidth_gbs": 300, "devices": [{"type": "A100-80GB", "count": 2}]}]})


def _gpt_small():
    return load_workload(shipped_path("model", "gpt_small"))


def _settings(compute_model: str, batch: int = 8) -> TrainSettings:
    return TrainSettings(global_batch_size=batch, compute_model=compute_model)


def _closed_form_only(monkeypatch) -> None:
    monkeypatch.setattr(SubClusterBound, "exceeds", lambda self, kept, limit_s: self.step_time_s(kept) > limit_s)


@pytest.mark.parametrize("cluster", [_mixed, _identical_nodes])
@pytest.mark.parametrize("compute_model", ["roofline", "flops"])
@pytest.mark.parametrize("objective", ["cost", "time"])
def test_the_lp_check_keeps_every_chosen_plan_and_plans_fewer(cluster, compute_model, objective,
                                                              monkeypatch) -> None:
    request = PlanRequest(objective=objective, budget_per_hour=None if objective == "cost" else 12.0)
    wl, settings = _gpt_small(), _settings(compute_model)
    fast = plan(cluster(), wl, settings, request)
    with monkeypatch.context() as m:
        _closed_form_only(m)
        reference = plan(cluster(), wl, settings, request)
    assert fast.plan.to_dict() == reference.plan.to_dict()
    assert fast.plan.predicted == reference.plan.predicted
    assert len(fast.objective.candidates) <= len(reference.objective.candidates)


def test_the_lp_check_plans_far_fewer_sub_clusters_under_the_roofline(monkeypatch) -> None:
    request, wl, settings = PlanRequest(objective="cost"), _gpt_small(), _settings("roofline")
    fast = plan(_mixed(), wl, settings, request).objective
    with monkeypatch.context() as m:
        _closed_form_only(m)
        reference = plan(_mixed(), wl, settings, request).objective
    assert fast.best.kept == reference.best.kept
    assert len(reference.candidates) >= 2 * len(fast.candidates)


@pytest.mark.parametrize("cluster", [_mixed, _identical_nodes])
@pytest.mark.parametrize("compute_model", ["roofline", "flops"])
def test_no_bound_exceeds_the_plan_of_a_sub_cluster_that_uses_all_of_it(cluster, compute_model) -> None:
    whole, wl, settings = cluster(), _gpt_small(), _settings(compute_model)
    bounds = SubClusterBound(CostModel(whole, wl, settings), settings, with_overheads=True)
    names = [d.name for d in whole.devices]
    checked = 0
    for k in range(1, len(names) + 1):
        for kept in itertools.combinations(names, k):
            try:
                found = search_plan(sub_cluster(whole, frozenset(kept)), wl, settings)
            except ConfigError:
                continue
            if set(found.used_devices) != set(kept):
                continue
            step = found.predicted["step_time_s"]
            assert bounds.step_time_s(kept) <= step
            assert not bounds.exceeds(kept, step * (1 - 1e-9)), kept
            checked += 1
    assert checked >= 6


@pytest.mark.parametrize("compute_model", ["roofline", "flops"])
def test_one_kind_is_bounded_by_its_compute_over_the_devices_plus_its_overhead(compute_model) -> None:
    """Two A100s of one node: the LP's optimum is B x (the per-sample device time) / 2 + each device's overhead
    (per layer, the least of one sample's wall time and its update)."""
    whole, wl, settings = _identical_nodes(), _gpt_small(), _settings(compute_model, batch=16)
    cm = CostModel(whole, wl, settings)
    bounds = SubClusterBound(cm, settings, with_overheads=True)
    kept = ("a100_0/0", "a100_0/1")
    a100 = whole.device(kept[0])
    L, sizes = wl.num_layers, range(1, 9)
    device = [min(t * cm.stage_compute_s(a100, t, m, l, l + 1) / m for t in (1, 2) for m in sizes) for l in range(L)]
    wall = [min(cm.stage_compute_s(a100, t, m, l, l + 1) / m for t in (1, 2) for m in sizes) for l in range(L)]
    update = [min(cm.stage_update_s(a100, t, l, l + 1, 6) for t in (1, 2)) for l in range(L)]
    expected = 16 * sum(device) / 2 + sum(min(w, u) for w, u in zip(wall, update))
    assert bounds.exceeds(kept, expected * (1 - 1e-6))
    assert not bounds.exceeds(kept, expected * (1 + 1e-6))
    assert not SubClusterBound(cm, settings).exceeds(kept, 16 * sum(device) / 2 * (1 + 1e-6))  # no overheads
