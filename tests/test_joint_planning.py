"""Placement and compression planned together (planning/joint.py, core/compressed_sync.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
from pathlib import Path

import pytest

from het_strategy.core.cluster import cluster_from_dict
from het_strategy.core.compressed_sync import JOINT_CHOICES, hierarchical_sync_s, wire_fraction
from het_strategy.core.cost_model import CostModel
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.errors import ConfigError
from het_strategy.core.network import SyncRoute
from het_strategy.core.plan import Plan
from het_strategy.planning import PlanRequest, plan, search_plan
from het_strategy.planning.joint import JointResult

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from plan_optimality import brute_force_plan  # noqa: E402

from tests._planning_cases import device, small_workload  # noqa: E402

_workload, _dev = small_workload, device


def _joint(cluster, workload, settings: TrainSettings) -> JointResult:
    """``planning.plan``'s joint search (data parallelism), with every choice's plan."""
    result = plan(cluster, workload, settings, PlanRequest(compression="joint", mode="dp"))
    assert result.joint is not None and result.plan.to_dict()["pipelines"] == result.joint.plan.to_dict()["pipelines"]
    return result.joint


def _two_nodes(link_gbs: float) -> dict:
    return {"name": "fast+slow", "inter_node_bandwidth_gbs": link_gbs, "nodes": [
        {"name": "a", "intra_bandwidth_gbs": 100, "devices": [_dev("a0", 50), _dev("a1", 50)]},
        {"name": "b", "intra_bandwidth_gbs": 100, "devices": [_dev("b0", 20), _dev("b1", 20)]}]}


def test_wire_fractions() -> None:
    assert wire_fraction("none") == 1 and wire_fraction("bf16") == 0.5
    assert wire_fraction("q4") == pytest.approx((4 + 0.25) / 32) and wire_fraction("q8") == pytest.approx(8.25 / 32)
    with pytest.raises(ConfigError):
        wire_fraction("q9")


def test_the_hierarchical_price_by_hand() -> None:
    """1 GB over 4 replicas on 2 nodes: node reduce + broadcast at 100 GB/s, the leaders' ring (given), two
    codec passes at 10 GB/s."""
    got = hierarchical_sync_s(1e9, 4, 2, 100e9, 0.05, 1e-5, 10e9, "q4")
    intra = 2 * (1 / 2) * 1e9 / 100e9 + 2 * 1e-5
    assert got == pytest.approx(intra + 0.05 + 2 * 1e9 / 10e9)
    assert hierarchical_sync_s(1e9, 4, 2, 100e9, 0.05, 1e-5, 10e9, "bf16") == pytest.approx(intra + 0.05)


def test_the_cost_model_prices_the_compressed_inter_node_hop() -> None:
    cluster, workload = cluster_from_dict(_two_nodes(0.5)), _workload()
    s = TrainSettings(global_batch_size=8, micro_batch_sizes=(1, 2))
    cm, cm4 = CostModel(cluster, workload, s), CostModel(cluster, workload, dataclasses.replace(
        s, inter_node_compression="q4"))
    route = SyncRoute(4, ("a", "b"), (1, 1))
    grad = 4e8
    leaders = SyncRoute(2, ("a", "b"), (1, 1))
    expected = hierarchical_sync_s(grad, 4, 2, 100e9, cm.network.ring_allreduce_s(grad * wire_fraction("q4"), leaders),
                                   cm.network.latency_s, 1000e9 / 8, "q4")
    assert cm4.allreduce_s(grad, 4, route) == pytest.approx(expected)
    assert cm4.allreduce_s(grad, 4, route) < 0.3 * cm.allreduce_s(grad, 4, route)
    intra = SyncRoute(2, ("a",), (1,))
    assert cm4.allreduce_s(grad, 2, intra) == cm.allreduce_s(grad, 2, intra)  # inside a node: never compressed


def test_a_slow_link_idles_a_node_unless_the_sync_is_compressed() -> None:
    """The issue's case in small: the blind plan leaves node b idle behind a slow link; compressed, it pays."""
    cluster, workload = cluster_from_dict(_two_nodes(1.0)), _workload(hidden_size=1024, seq_len=1024)
    s = TrainSettings(global_batch_size=256, micro_batch_sizes=(1, 2))
    joint = _joint(cluster, workload, s)
    blind = joint.blind
    assert set(blind.used_devices) == {"a0", "a1"} and joint.plan.compression == {"inter_node": "q4"}
    assert joint.brought_back() == ["b0", "b1"]
    assert joint.plan.predicted["step_time_s"] < 0.8 * blind.predicted["step_time_s"]  # 0.403 s against 0.530 s
    again = Plan.from_dict(json.loads(joint.plan.to_json()))  # the choice travels in plan.json
    assert again.compression == {"inter_node": "q4"}
    cm = CostModel(cluster, workload, s)  # a plan is scored in the compression it carries
    assert cm.score(again).step_time_s == pytest.approx(joint.plan.predicted["step_time_s"])


def _brute_joint(cluster, workload, settings) -> float:
    one_stage = dataclasses.replace(settings, max_stages=1, max_tp=1)
    return min(brute_force_plan(cluster, workload, dataclasses.replace(one_stage, inter_node_compression=t)
                                ).step_time_s for t in JOINT_CHOICES)


@pytest.mark.parametrize("seed", range(8))
def test_joint_dp_plans_equal_brute_force_over_placement_and_compression(seed: int) -> None:
    rng = random.Random(100 + seed)
    nodes = []
    for n in range(rng.randint(2, 3)):
        devs = [_dev(f"n{n}d{i}", rng.choice([1, 5, 20, 100])) for i in range(rng.randint(1, 2))]
        nodes.append({"name": f"n{n}", "intra_bandwidth_gbs": rng.choice([10, 100]), "devices": devs})
    cluster = cluster_from_dict({"name": f"r{seed}", "inter_node_bandwidth_gbs": rng.choice([0.05, 0.3, 3]),
                                 "nodes": nodes})
    workload = _workload(hidden_size=rng.choice([256, 1024]))
    n = cluster.num_devices
    s = TrainSettings(global_batch_size=rng.randint(n, n + 8), micro_batch_sizes=(1, 2), memory_reserve_gb=0.5)
    brute = _brute_joint(cluster, workload, s)
    assert math.isfinite(brute)
    joint = _joint(cluster, workload, s)
    assert joint.plan.predicted["step_time_s"] == pytest.approx(brute, rel=1e-9)
    assert joint.plan.predicted["step_time_s"] <= joint.blind.predicted["step_time_s"]


def test_one_node_has_no_inter_node_hop() -> None:
    cluster = cluster_from_dict({"name": "one", "nodes": [{"name": "a", "intra_bandwidth_gbs": 100,
                                                        "devices": [_dev("a0", 5), _dev("a1", 5)]}]})
    joint = _joint(cluster, _workload(), TrainSettings(global_batch_size=4))
    assert list(joint.by_choice) == ["none"] and joint.plan.compression == {}


@pytest.mark.parametrize("raw, field", [({"inter_node": "q9"}, "plan.compression.inter_node"),
                                        ({"intra_node": "q4"}, "plan.compression.intra_node"),
                                        ("q4", "plan.compression")])
def test_bad_plan_compression_names_the_field(raw, field) -> None:
    cluster, workload = cluster_from_dict(_two_nodes(3)), _workload()
    good = json.loads(search_plan(cluster, workload, TrainSettings(global_batch_size=8), mode="dp").to_json())
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        Plan.from_dict({**good, "compression": raw})


def test_a_bad_inter_node_compression_setting_names_the_field() -> None:
    with pytest.raises(ConfigError, match="settings.inter_node_compression"):
        TrainSettings(global_batch_size=8, inter_node_compression="gzip")


def test_compression_planned_runs_the_plans_inter_node_choice() -> None:
    pytest.importorskip("lightning")
    import het_strategy
    from het_strategy.compression import CompressionConfig

    cluster, workload = cluster_from_dict(_two_nodes(1.0)), _workload(hidden_size=1024, seq_len=1024)
    joint = _joint(cluster, workload, TrainSettings(global_batch_size=256, micro_batch_sizes=(1, 2)))
    strategy = het_strategy.HeteroStrategy(cluster=_two_nodes(1.0), plan=joint.plan, compression="planned")
    assert strategy.run.comm.config == CompressionConfig(method="q4", scope="inter_node")
    blind = het_strategy.HeteroStrategy(cluster=_two_nodes(1.0), plan=joint.blind, compression="planned")
    assert blind.run.comm.config.method == "none"
    with pytest.raises(ConfigError, match="`compression` is 'planned'; it must go with plan="):
        het_strategy.HeteroStrategy(cluster=_two_nodes(1.0), compression="planned")


def test_het_plan_joint_prints_both_plans_and_writes_the_choice(tmp_path: Path, capsys) -> None:
    from het_strategy.cli.plan_cli import main

    path = tmp_path / "cluster.yaml"
    path.write_text(json.dumps(_two_nodes(1.0)))
    big = ["model.hidden_size=1024", "model.seq_len=1024", "model.num_layers=2", "model.num_heads=8",
           "model.vocab_size=4096", "settings.global_batch_size=256", "settings.micro_batch_sizes=[1,2]", "settings.dtype=fp32"]
    assert main([f"cluster={path}", *big, "planner.mode=dp", "planner.compression=joint",
                 f"output.dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "gradient compression: q4 between nodes" in out
    assert "joint plan: q4 between nodes" in out and "devices brought back into use: b0, b1" in out
    assert json.loads((tmp_path / "plan.json").read_text())["compression"] == {"inter_node": "q4"}
    for bad, needle in ((["planner.compression=zip"], "`planner.compression` is 'zip'"),
                        (["planner.compression=joint", "planner.mode=pipeline"], "go with planner.mode=dp")):
        assert main([f"cluster={path}", *big, *bad, f"output.dir={tmp_path}"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and needle in err, err


def test_the_benchmark_shows_the_v100s_a_compressed_sync_brings_back() -> None:
    """benchmarks/plan_uneven_dp.py's joint row for sailor_a100_v100_32_96 (gpt_small, fp16, batch 1024): the
    blind plan trains on the 32 A100s only; with q4 between the nodes the 96 V100s pay for their sync."""
    from plan_uneven_dp import brought_back_text, joint_row, joint_speedup

    from het_strategy.core.cluster import load_cluster
    from het_strategy.core.workload import load_workload

    cluster = load_cluster("sailor_a100_v100_32_96")
    settings = TrainSettings(global_batch_size=1024, dtype="fp16")
    joint = _joint(cluster, load_workload("gpt_small", dtype="fp16"), settings)
    v100 = sorted(d.name for d in cluster.devices if d.type == "V100-16GB")
    assert {cluster.device(d).type for d in joint.blind.used_devices} == {"A100-40GB"}
    assert joint.plan.compression == {"inter_node": "q4"} and joint.brought_back() == v100
    assert joint_speedup(joint) > 2.5  # 0.724 s against 0.240 s
    assert brought_back_text(joint, cluster) == "96 x V100-16GB"
    row = joint_row("sailor_a100_v100_32_96", joint, cluster)
    assert row.split()[5:7] == ["q4", f"{joint_speedup(joint):.2f}"]
    fast = cluster_from_dict(_two_nodes(100.0))  # a fast link: compression does not pay, the blind plan wins
    same = _joint(fast, _workload(), TrainSettings(global_batch_size=8))
    assert same.plan is same.blind and brought_back_text(same, fast) == "none (the same 2 devices)"


def test_the_joint_planning_benchmarks_cluster_brings_the_slow_node_back() -> None:
    """benchmarks/joint_planning.py's premise, planning only: blind leaves the slow node idle, joint (q4) uses it,
    and the blind plan re-planned on the devices it uses (what the benchmark runs) is the same split."""
    import joint_planning as bench  # benchmarks/ is on sys.path (above)

    source = bench.cluster_dict(100.0, 0.6, 1.0)
    _, workload = bench._workload()
    result = bench.plans(cluster_from_dict(source), workload, 24)
    blind, joint = result.blind, result.plan
    assert sorted(blind.used_devices) == ["fast0", "fast1"]
    assert joint.compression == {"inter_node": "q4"} and result.brought_back() == ["slow0", "slow1"]
    assert joint.predicted["step_time_s"] < 0.8 * blind.predicted["step_time_s"]
    again = bench.plans(cluster_from_dict(bench.sub_cluster(source, list(blind.used_devices))), workload, 24).plan
    assert again.rank_shares() == {d: n for d, n in blind.rank_shares().items() if n}
