"""The planner issue's reference scenarios (AMP, Metis, Sailor), planned and compared under one cost model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import reference_scenarios as scen  # noqa: E402

from het_strategy.core.cluster import load_cluster  # noqa: E402
from het_strategy.core.cost_model import CostModel  # noqa: E402
from het_strategy.core.train_settings import TrainSettings  # noqa: E402
from het_strategy.core.workload import load_workload  # noqa: E402
from het_strategy.reference.sailor_profiles import load_sailor_profile  # noqa: E402


def test_amp_plan_beats_amps_own_choices_under_the_same_model():
    res = scen.run_amp()
    assert res["ours"].predicted["fits"]
    # AMP's measured-best (1,1,2,8) and its model's pick (1,1,4,4), rebuilt and scored like ours
    assert res["ours_s"] <= res["amp_measured_best_s"]
    assert res["ours_s"] <= res["amp_predicted_best_s"]
    used = {d for p in res["ours"].pipelines for d in p.devices}
    assert len(used) <= 16


def test_metis_plan_rebuilt_fits_and_ours_is_no_slower():
    res = scen.run_metis()
    assert res["metis_fits"], "Metis's published plan must fit our memory model (2 stages, tp 2, [0,4,10])"
    assert res["ours_s"] <= res["metis_s"]
    plan = scen.metis_plan(load_cluster("metis_t4_a100"), load_workload("metis_gpt", dtype="fp16"), 128)
    assert [p.boundaries() for p in plan.pipelines] == [[0, 4, 10]] * 4


@pytest.mark.parametrize("name", ["sailor_a100_v100_32_96"])
def test_sailor_scenario_uses_measured_profiles(name):
    cluster = load_cluster(name)
    workload = load_workload("opt350", dtype="fp16")
    profile = load_sailor_profile("OPT-350", workload)
    cm = CostModel(cluster, workload, TrainSettings(1024, dtype="fp16"), profile)
    assert cm.uses_profile(cluster.devices[0], 1)
    res = scen.run_sailor(name)
    plan = res["ours"]
    assert plan.predicted["fits"]
    assert sum(p.samples for p in plan.pipelines) == 1024
    # the plan's time is the measured per-layer times, not datasheet figures: rescoring without
    # the profile gives another step time
    no_profile = CostModel(cluster, workload, TrainSettings(1024, dtype="fp16", max_tp=4, max_stages=8)).score(plan)
    assert abs(no_profile.step_time_s - plan.predicted["step_time_s"]) > 1e-6
    # uses both device types, as a heterogeneity-aware plan should on this cluster
    types = {cluster.device(d).type for p in plan.pipelines for d in p.devices}
    assert types == {"A100-40GB", "V100-16GB"}


def test_metis_planned_jointly_brings_the_t4s_back_beside_ours():
    """The joint plan (placement x inter-node compression, same mode as ours) beside ours, its blind plan."""
    res = scen.run_metis()
    joint = res["joint"]
    assert joint.blind.predicted["step_time_s"] == pytest.approx(res["ours_s"])  # ours is the blind plan
    assert joint.plan.compression == {"inter_node": "q4"}
    assert joint.plan.predicted["step_time_s"] < 0.95 * res["ours_s"]  # 1.136 s against 1.436 s
    cluster = load_cluster("metis_t4_a100")
    back = joint.brought_back()
    assert back and not set(back) & set(joint.blind.used_devices) and set(back) <= set(joint.plan.used_devices)
    lines = scen._joint_lines(joint, cluster).splitlines()
    assert lines[0].startswith("  compression-blind (ours)") and "samples/s" in lines[0]
    assert "joint: q4 between nodes" in lines[1] and f"brought back into use: {len(back)} x " in lines[1]
