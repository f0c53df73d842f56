"""The money objective: device prices, ``planner.objective=cost``, ``planner.budget_per_hour``, ``planner.min_throughput``.

Every choice is checked against brute force: each sub-cluster (how many devices of each kind to keep) planned
with ``planning.plan``, priced by the devices its plan uses, the best taken by hand.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import pytest

from het_strategy.cli.plan_cli import main
from het_strategy.core.catalog import device_catalog, lookup_device_type
from het_strategy.core.cluster import ClusterSpec, cluster_from_dict, load_cluster
from het_strategy.core.cost_model import CostModel
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.errors import ConfigError
from het_strategy.core.pricing import plan_price
from het_strategy.planning import PlanRequest, plan, search_plan
from het_strategy.planning.objective import MAX_SUBSETS, search_objective, sub_cluster
from het_strategy.report.table import plan_table

from tests._planning_cases import device, small_workload

SETTINGS = TrainSettings(global_batch_size=64, dtype="fp32")
FAST_PRICE, SLOW_PRICE = 10.0, 1.0


def _kind(type_name: str, tflops: float, price: float, count: int) -> dict:
    entry = {**device("x", tflops), "type": type_name, "price_per_hour": price, "count": count}
    del entry["name"]
    return entry


def _box() -> ClusterSpec:
    """2 FAST (40 TFLOPS, $10/hour) + 2 SLOW (10 TFLOPS, $1/hour) in one node: SLOW does 2.5x the work per dollar."""
    return cluster_from_dict({"name": "box", "nodes": [
        {"name": "n", "intra_bandwidth_gbs": 100,
         "devices": [_kind("FAST", 40.0, FAST_PRICE, 2), _kind("SLOW", 10.0, SLOW_PRICE, 2)]}]})


def _brute_force(cluster: ClusterSpec, planner=None) -> list[dict]:
    """Every sub-cluster's plan (first k devices of each (node, type) group kept), priced by its used devices."""
    planner = planner or (lambda sub: search_plan(sub, small_workload(), SETTINGS, "dp"))
    groups: dict[tuple[str, str], list[str]] = {}
    for d in cluster.devices:
        groups.setdefault((d.node, d.type), []).append(d.name)
    out = []
    for counts in itertools.product(*(range(len(g) + 1) for g in groups.values())):
        kept = frozenset(n for g, k in zip(groups.values(), counts) for n in g[:k])
        if not kept:
            continue
        try:
            found = planner(sub_cluster(cluster, kept))
        except ConfigError:
            continue
        step = found.predicted["step_time_s"]
        per_hour = sum(cluster.device(n).price_per_hour for n in found.used_devices)
        out.append({"used": set(found.used_devices), "step": step, "per_hour": per_hour,
                    "per_iteration": per_hour * step / 3600, "samples_per_s": SETTINGS.global_batch_size / step})
    return out


def _objective(cluster: ClusterSpec, mode: str = "dp", max_subsets: int = MAX_SUBSETS, **kw):
    """The sub-cluster search of ``planning.plan`` (with ``max_subsets``: that step alone, each sub-cluster planned
    by ``plan`` with the request's objective, budget and floor dropped)."""
    request = PlanRequest(mode=mode, **kw)
    if max_subsets == MAX_SUBSETS:
        return plan(cluster, small_workload(), SETTINGS, request).objective
    one = dataclasses.replace(request, objective="time", budget_per_hour=None, min_throughput=None)
    return search_objective(cluster, small_workload(), SETTINGS, request,
                            lambda sub: plan(sub, small_workload(), SETTINGS, one).plan, max_subsets=max_subsets)


# -- prices ----------------------------------------------------------------------------------------

def test_every_catalog_entry_has_a_list_price() -> None:
    prices = {name: t.price_per_hour for name, t in device_catalog().items()}
    assert all(isinstance(p, float) and 0 < p < 100 for p in prices.values()), prices
    assert lookup_device_type("A100-40").price_per_hour == 3.67 and lookup_device_type("V100").price_per_hour == 2.48
    assert lookup_device_type("T4").price_per_hour == 0.35 and lookup_device_type("CPU").price_per_hour == 0.05
    assert prices["H100-SXM"] > prices["A100-80GB"] > prices["A100-40GB"] > prices["V100-16GB"] > prices["T4"]


def test_a_device_entry_overrides_the_catalog_price(tmp_path: Path) -> None:
    path = tmp_path / "priced.yaml"
    path.write_text("nodes:\n  - name: a\n    devices: [{type: A100-40GB, count: 2, price_per_hour: 1.2}, T4]\n"
                    "  - name: b\n    devices: [{type: V100-16GB, tflops: 100, price_per_hour: 0.5}]\n")
    cluster = load_cluster(path)
    assert [d.price_per_hour for d in cluster.devices] == [1.2, 1.2, 0.35, 0.5]
    again = cluster_from_dict(cluster.to_dict())  # the explicit form carries the prices
    assert [d.price_per_hour for d in again.devices] == [1.2, 1.2, 0.35, 0.5]


@pytest.mark.parametrize("value", [-1, 0, True, "cheap", math.inf, None])
def test_a_bad_price_names_the_field_the_value_and_the_rule(value) -> None:
    raw = {"nodes": [{"devices": ["T4"]}, {"devices": ["T4", {"type": "A100-40GB", "price_per_hour": value}]}]}
    with pytest.raises(ConfigError) as err:
        cluster_from_dict(raw)
    msg = str(err.value)
    shown = "null" if value is None else repr(value)
    assert f"`cluster.nodes[1].devices[1].price_per_hour` is {shown}" in msg and "> 0" in msg and "USD per device-hour" in msg


def test_a_custom_device_has_no_price_and_cost_asks_for_one() -> None:
    cluster = cluster_from_dict({"nodes": [{"name": "n", "intra_bandwidth_gbs": 10, "devices": [device("c", 10.0)]}]})
    assert cluster.devices[0].price_per_hour is None
    with pytest.raises(ConfigError, match=r"`device `c`.price_per_hour` is null; it must be given for "
                                          r"planner.objective=cost"):
        _objective(cluster, objective="cost")


# -- the objective, against brute force ------------------------------------------------------------------

def test_cost_picks_the_cheap_devices_and_time_all_of_them() -> None:
    cluster = _box()
    slow = {d.name for d in cluster.devices if d.type == "SLOW"}
    everything = _brute_force(cluster)
    cheapest = min(everything, key=lambda r: r["per_iteration"])
    result = _objective(cluster, objective="cost")
    assert set(result.plan.used_devices) == cheapest["used"] <= slow
    # by hand: $1/hour for each SLOW device used x the cost model's step time of that sub-cluster's plan
    alone = search_plan(sub_cluster(cluster, frozenset(cheapest["used"])), small_workload(), SETTINGS, "dp")
    expected = SLOW_PRICE * len(cheapest["used"]) * alone.predicted["step_time_s"] / 3600
    assert result.plan.predicted["dollars_per_iteration"] == pytest.approx(expected, rel=1e-12)
    assert result.plan.predicted["dollars_per_hour"] == pytest.approx(SLOW_PRICE * len(cheapest["used"]))
    fastest = _objective(cluster, objective="time", budget_per_hour=1000.0)
    assert set(fastest.plan.used_devices) == {d.name for d in cluster.devices}
    assert fastest.plan.predicted["dollars_per_hour"] == pytest.approx(2 * FAST_PRICE + 2 * SLOW_PRICE)
    assert result.plan.predicted["dollars_per_iteration"] < fastest.plan.predicted["dollars_per_iteration"]


@pytest.mark.parametrize("mode", ["auto", "pipeline"])
def test_cost_in_the_other_modes_equals_brute_force(mode: str) -> None:
    cluster = _box()
    found = lambda sub: search_plan(sub, small_workload(), SETTINGS, mode)  # noqa: E731
    best = min(_brute_force(cluster, found), key=lambda r: (r["per_iteration"], r["step"]))
    result = _objective(cluster, mode, objective="cost")
    assert result.plan.predicted["dollars_per_iteration"] == pytest.approx(best["per_iteration"], rel=1e-12)


def test_the_chosen_plan_names_every_cluster_device_and_is_rescored_there() -> None:
    cluster = _box()
    result = _objective(cluster, objective="cost")
    chosen = result.plan
    assert chosen.cluster_devices == tuple(d.name for d in cluster.devices)
    left_out = [d.name for d in cluster.devices if d.name not in chosen.used_devices]
    assert left_out and all("not rented" in chosen.idle_reasons[n] for n in left_out)
    rescored = CostModel(cluster, small_workload(), SETTINGS).score(chosen)
    assert rescored.step_time_s == pytest.approx(result.best.step_time_s, rel=1e-12)
    assert chosen.predicted["objective"] == {"objective": "cost", "budget_per_hour": None, "min_throughput": None}
    assert plan_price(chosen, cluster).dollars_per_hour == chosen.predicted["dollars_per_hour"]


def test_a_budget_caps_the_fastest_plan() -> None:
    cluster = _box()
    budget = FAST_PRICE + 2 * SLOW_PRICE + 0.5  # one FAST and both SLOW at most: not the whole box
    within = [r for r in _brute_force(cluster) if r["per_hour"] <= budget]
    best = min(within, key=lambda r: (r["step"], r["per_hour"]))
    result = _objective(cluster, objective="time", budget_per_hour=budget)
    assert result.plan.predicted["dollars_per_hour"] <= budget
    assert result.best.step_time_s == pytest.approx(best["step"], rel=1e-12)
    assert set(result.plan.used_devices) == best["used"]


def test_a_throughput_floor_is_kept_by_the_cheapest_plan() -> None:
    cluster = _box()
    everything = _brute_force(cluster)
    one_slow = max(r["samples_per_s"] for r in everything if len(r["used"]) == 1 and r["per_hour"] == SLOW_PRICE)
    floor = one_slow * 1.5  # more than one SLOW device does
    fast_enough = [r for r in everything if r["samples_per_s"] >= floor]
    best = min(fast_enough, key=lambda r: (r["per_iteration"], r["step"]))
    result = _objective(cluster, objective="cost", min_throughput=floor)
    assert result.best.samples_per_s >= floor
    assert result.plan.predicted["dollars_per_iteration"] == pytest.approx(best["per_iteration"], rel=1e-12)
    assert set(result.plan.used_devices) == best["used"]


def test_cost_composes_with_joint_compression_planning() -> None:
    cluster = cluster_from_dict({"name": "two", "inter_node_bandwidth_gbs": 1, "nodes": [
        {"name": "f", "intra_bandwidth_gbs": 100, "devices": [_kind("FAST", 40.0, FAST_PRICE, 2)]},
        {"name": "s", "intra_bandwidth_gbs": 100, "devices": [_kind("SLOW", 10.0, SLOW_PRICE, 2)]}]})
    joint = lambda sub: plan(sub, small_workload(), SETTINGS, PlanRequest(compression="joint", mode="dp")).plan  # noqa: E731
    best = min(_brute_force(cluster, joint), key=lambda r: (r["per_iteration"], r["step"]))
    result = _objective(cluster, objective="cost", compression="joint", min_throughput=1.0)
    assert result.plan.predicted["dollars_per_iteration"] == pytest.approx(best["per_iteration"], rel=1e-12)


def test_many_groups_search_whole_nodes_and_too_many_is_an_error() -> None:
    cluster = cluster_from_dict({"name": "rack", "nodes": [
        {"name": "n", "count": 3, "intra_bandwidth_gbs": 100, "devices": [_kind("SLOW", 10.0, SLOW_PRICE, 2)]}]})
    result = _objective(cluster, objective="time", budget_per_hour=4.5, max_subsets=10)  # 26 per-device subsets
    assert result.search == "whole nodes" and result.num_subsets == 3
    assert len({cluster.device(d).node for d in result.plan.used_devices}) == 2  # two whole nodes: $4/hour
    with pytest.raises(ConfigError, match=r"`planner.budget_per_hour` is 4.5; it must go with a cluster of at "
                                          r"most 2 sub-clusters to search: `rack` has 26 .* and 3 "):
        _objective(cluster, objective="time", budget_per_hour=4.5, max_subsets=2)


# -- bad input -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, field, shown", [
    ({"objective": "money"}, "planner.objective", "'money'"),
    ({"objective": None}, "planner.objective", "null"),
    ({"budget_per_hour": 0}, "planner.budget_per_hour", "0"),
    ({"budget_per_hour": -3.5}, "planner.budget_per_hour", "-3.5"),
    ({"budget_per_hour": "ten"}, "planner.budget_per_hour", "'ten'"),
    ({"budget_per_hour": True}, "planner.budget_per_hour", "True"),
    ({"min_throughput": 0}, "planner.min_throughput", "0"),
    ({"min_throughput": -1}, "planner.min_throughput", "-1"),
])
def test_bad_objective_settings_name_the_field_and_the_value(kw, field, shown) -> None:
    with pytest.raises(ConfigError) as err:
        PlanRequest(**kw)
    assert str(err.value).startswith(f"`{field}` is {shown}; it must ")
    with pytest.raises(ConfigError, match=f"`{field}`"):
        _objective(_box(), **kw)


def test_a_budget_no_plan_meets_names_the_cheapest_plan() -> None:
    cluster = _box()
    cheapest = min(_brute_force(cluster), key=lambda r: (r["per_hour"], r["step"]))
    with pytest.raises(ConfigError) as err:
        _objective(cluster, objective="cost", budget_per_hour=0.5)
    msg = str(err.value)
    assert "`planner.budget_per_hour` is 0.5" in msg and f"${cheapest['per_hour']:.2f}/hour" in msg
    assert f"{cheapest['samples_per_s']:.1f} samples/s" in msg


def test_a_floor_no_plan_reaches_names_the_fastest_plan() -> None:
    cluster = _box()
    fastest = min(_brute_force(cluster), key=lambda r: r["step"])
    with pytest.raises(ConfigError) as err:
        _objective(cluster, objective="cost", min_throughput=1e9)
    msg = str(err.value)
    assert "`planner.min_throughput` is 1000000000.0" in msg
    assert f"{fastest['samples_per_s']:.1f} samples/s at ${fastest['per_hour']:.2f}/hour" in msg


# -- het-plan and the report -------------------------------------------------------------------------------

def test_het_plan_bad_objective_exits_2_with_one_line(capsys) -> None:
    assert main(["cluster=local_cpu4_mixed", "model=tiny_gpt", "planner.objective=money", "output.plan=null"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("het-plan: error: `planner.objective` is 'money'")


def test_het_plan_budget_too_small_exits_2_with_one_line(capsys) -> None:
    assert main(["cluster=local_cpu4_mixed", "model=tiny_gpt", "planner.budget_per_hour=0.01",
                 "output.plan=null"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`planner.budget_per_hour` is 0.01" in err and "cheapest plan costs $0.05" in err


def test_het_plan_cost_prints_and_records_the_money_figures(tmp_path: Path, capsys) -> None:
    assert main(["cluster=local_cpu4_mixed", "model=tiny_gpt", "planner.objective=cost",
                 f"output.dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    predicted = json.loads((tmp_path / "plan.json").read_text())["predicted"]
    per_hour, per_iteration = predicted["dollars_per_hour"], predicted["dollars_per_iteration"]
    assert per_iteration == pytest.approx(per_hour * predicted["step_time_s"] / 3600, rel=1e-12)
    assert predicted["objective"]["objective"] == "cost"
    assert f"cost: ${per_hour:.2f}/hour" in out and "objective: cost" in out and "objective cost:" in out


def test_the_table_prices_a_plain_plan_by_its_used_devices() -> None:
    cluster = _box()
    found = search_plan(cluster, small_workload(), SETTINGS, "dp")
    score = CostModel(cluster, small_workload(), SETTINGS).score(found)
    per_hour = sum(cluster.device(d).price_per_hour for d in found.used_devices)
    text = plan_table(found, score, cluster)
    assert f"cost: ${per_hour:.2f}/hour for the {len(found.used_devices)} used devices" in text
    assert f"${per_hour * score.step_time_s / 3600:.3g}/iteration; objective: time" in text
