"""The 1F1B pipeline time: blocking sends occupy the stages at both ends of a boundary (``core/cost_model.py``)."""

from __future__ import annotations

import pytest

from het_strategy.core.cluster import cluster_from_dict
from het_strategy.core.cost_model import CostModel, bottleneck_s, fill_s, pipeline_time_s
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.core.plan_score import StageCost
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import load_workload


def test_a_stage_pays_its_compute_and_the_sends_at_both_its_boundaries() -> None:
    costs = [StageCost(1.0, 0.5, 0.0), StageCost(2.0, 0.25, 0.0), StageCost(1.0, 0.0, 0.0)]
    assert fill_s(costs) == 4.75  # 1 + 2 + 1 compute, 0.5 + 0.25 sends
    assert bottleneck_s(costs) == 2.75  # the middle stage: 0.5 in + 2 + 0.25 out (overlapped it would be 2)
    assert pipeline_time_s(costs, costs, 4) == 4.75 + 3 * 2.75
    assert pipeline_time_s(costs, costs, 1) == 4.75
    half = [StageCost(c.compute_s / 2, c.send_s / 2, 0.0) for c in costs]
    assert pipeline_time_s(costs, half, 3) == 4.75 + 2.75 + 1.375  # the last micro-batch at its own size


def _two_nodes() -> dict:
    dev = {"type": "CPU", "tflops": {"fp32": 0.016}, "efficiency": 1.0, "memory_gb": 16}
    return {"name": "two", "inter_node_bandwidth_gbs": 0.00125,
            "nodes": [{"name": f"n{i}", "intra_bandwidth_gbs": 1, "devices": [{"name": f"d{i}", **dev}]}
                      for i in range(2)]}


def test_a_send_bound_pipeline_is_priced_with_every_send_in_the_bottleneck() -> None:
    """Two one-device nodes at 10 Mbit/s: the step is the fill plus per further micro-batch a stage's compute and
    the boundary's activation and gradient one after another, not the larger of compute and sends."""
    cluster = cluster_from_dict(_two_nodes())
    workload = load_workload("tiny_gpt")
    settings = TrainSettings(global_batch_size=16, dtype="fp32", micro_batch_sizes=(4,), max_tp=1)
    cm = CostModel(cluster, workload, settings)
    half = workload.num_layers // 2
    plan = Plan(cluster="two", cluster_devices=("d0", "d1"), model={"name": workload.name,
                "num_layers": workload.num_layers}, global_batch_size=16, dtype="fp32", mode="manual", zero_stage=0,
                pipelines=(Pipeline((Stage(("d0",), (0, half)), Stage(("d1",), (half, workload.num_layers))),
                                    micro_batch_size=4, samples=16),))
    score = cm.score(plan)
    (first, second), = score.stage_costs
    send = cm.send_s(4, half - 1, "d0", "d1")
    assert first.send_s == pytest.approx(send) and second.send_s == 0.0
    assert send > max(first.compute_s, second.compute_s)  # send-bound: the rule decides the figure
    pipe = first.compute_s + second.compute_s + send + 3 * (max(first.compute_s, second.compute_s) + send)
    assert score.pipeline_times_s[0] == pytest.approx(pipe)
