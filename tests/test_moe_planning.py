"""Planning MoE experts: counts by speed (brute force), the cost model's expert time, the workload of a user's model."""

from __future__ import annotations

import itertools

import pytest

from het_strategy.core.cluster import load_cluster
from het_strategy.core.cost_model import CostModel
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.plan import Pipeline, Stage
from het_strategy.core.workload import load_workload
from het_strategy.planning.dp_split import equal_split_plan
from het_strategy.planning.experts import expert_counts_by_speed, place_experts
from het_strategy.planning.strategy_plans import estimate_workload
from het_strategy.planning.structure import plan_from_pipelines


@pytest.mark.parametrize("rates, experts", [([1, 1, 0.5, 0.5], 12), ([1, 1, 0.5, 0.5], 16), ([5, 2, 1], 6),
                                            ([3, 1], 7), ([1, 0.25, 0.25, 0.5], 9)])
def test_expert_counts_equal_brute_force(rates: list[float], experts: int) -> None:
    got = expert_counts_by_speed(rates, experts)
    assert got is not None and sum(got) == experts and min(got) >= 1
    best = min(max(n / r for n, r in zip(c, rates)) for c in itertools.product(range(1, experts + 1), repeat=len(rates))
               if sum(c) == experts)
    assert max(n / r for n, r in zip(got, rates)) == pytest.approx(best)


def test_moe_gpt_tiny_is_placed_4_4_2_2_on_speeds_1_1_half_half() -> None:
    cluster, workload = load_cluster("local_cpu4_moe"), load_workload("moe_gpt_tiny", "fp32")
    cm = CostModel(cluster, workload, TrainSettings(global_batch_size=16, dtype="fp32", micro_batch_sizes=(1,)))
    placement = place_experts(cm, equal_split_plan(cm))
    assert sorted(placement) == [2, 4]  # blocks 1 and 3 (layers 2 and 4) are MoE
    assert [len(placement[2][d.name]) for d in cluster.devices] == [4, 4, 2, 2]
    assert sorted(e for ids in placement[2].values() for e in ids) == list(range(12))


def test_expert_time_is_the_holders_share_of_the_whole_batch_whatever_its_micro_batches() -> None:
    """A holder of n of E experts runs n/E of every routed token of the step, spread over its own micro-batches."""
    cluster, workload = load_cluster("local_cpu4_moe"), load_workload("moe_gpt_tiny", "fp32")
    cm = CostModel(cluster, workload, TrainSettings(global_batch_size=16, dtype="fp32", micro_batch_sizes=(1, 5)))
    names = [d.name for d in cluster.devices]
    layers = workload.num_layers
    for mb in (1, 5):
        pipes = [Pipeline((Stage((n,), (0, layers)),), min(mb, s), s) for n, s in zip(names, (5, 5, 3, 3))]
        plan = plan_from_pipelines(cm, pipes, "dp")
        plan.experts = {layer: {n: list(range(i * 3, i * 3 + 3)) for i, n in enumerate(names)} for layer in (2, 4)}
        score = cm.score(plan)
        slow = cluster.device("rank2")
        expert_s = 2 * 3.0 * 16 * workload.seq_len * 2 * (3 / 12) * workload.layers[2].moe.flops_per_token_per_expert \
            / slow.flops_per_second("fp32")
        dense_s = 3 * cm.stage_compute_s(slow, 1, 1, 0, layers)
        assert score.pipeline_times_s[2] == pytest.approx(dense_s + expert_s, rel=1e-9)


def test_a_users_moe_model_gets_one_workload_layer_per_moe_layer() -> None:
    w = estimate_workload("Net", 1000, 8, "fp32", moe=[(6, 2, 200), (4, 1, 50)])
    assert [layer.name for layer in w.layers] == ["model", "moe0", "moe1"]
    assert w.layers[1].moe.num_experts == 6 and w.layers[1].moe.flops_per_token_per_expert == 400
    assert w.layers[0].total_params == 1000 and w.layers[1].total_params == 1200
