"""The communication terms of the cost model against hand-computed cases."""

from __future__ import annotations

import math

import pytest

from het_strategy.core.cluster import cluster_from_dict, load_cluster
from het_strategy.core.cost_model import CostModel
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.errors import ConfigError
from het_strategy.core.network import TP_LINK_EFFICIENCY, Network, SyncRoute
from het_strategy.core.plan import Plan
from het_strategy.core.workload import load_workload
from het_strategy.reference.sailor_profiles import (SAILOR_DATA_DIR, SailorNetwork, load_sailor_profile,
                                                    measured_tp_link_efficiency)
from het_strategy.reference.sailor_simulator import sailor_iteration_time

ALPHA = 10e-6


def _two_nodes(nic: float = 10.0, flow: float | None = None, intra: float = 100.0) -> dict:
    node = {"devices": [{"type": "A100-80GB", "count": 4}], "intra_bandwidth_gbs": intra, "inter_bandwidth_gbs": nic}
    if flow is not None:
        node["inter_flow_bandwidth_gbs"] = flow
    return {"name": "two", "inter_node_bandwidth_gbs": nic, "latency_us": 10,
            "nodes": [dict(node, name="a"), dict(node, name="b")]}


def test_ring_inside_one_node_runs_at_the_intra_link() -> None:
    net = Network(cluster_from_dict(_two_nodes()))
    S = 1e9
    t = net.ring_allreduce_s(S, SyncRoute(4, ("a",)))
    assert t == pytest.approx(2 * 3 * (ALPHA + S / 4 / 100e9))


def test_ring_across_two_nodes_one_flow_each_gets_the_flow_cap() -> None:
    net = Network(cluster_from_dict(_two_nodes(nic=10.0, flow=2.5)))
    S = 4e8
    t = net.ring_allreduce_s(S, SyncRoute(2, ("a", "b"), (1, 1)))
    assert t == pytest.approx(2 * 1 * (ALPHA + S / 2 / 2.5e9))


def test_concurrent_rings_share_the_node_interface() -> None:
    net = Network(cluster_from_dict(_two_nodes(nic=10.0, flow=4.0)))
    S = 4e8
    # 4 rings leave each node at once: 10 / 4 = 2.5 GB/s each, below the 4 GB/s one flow reaches alone
    t = net.ring_allreduce_s(S, SyncRoute(2, ("a", "b"), (4, 4)))
    assert t == pytest.approx(2 * (ALPHA + S / 2 / 2.5e9))
    # two rings: 5 GB/s each, but one flow is capped at 4 GB/s
    t2 = net.ring_allreduce_s(S, SyncRoute(2, ("a", "b"), (2, 2)))
    assert t2 == pytest.approx(2 * (ALPHA + S / 2 / 4e9))


def test_routes_count_the_rings_that_cross_each_node() -> None:
    cluster = cluster_from_dict(_two_nodes(nic=10.0))
    cm = CostModel(cluster, load_workload("gpt_small"), TrainSettings(8))
    a, b = [d.name for d in cluster.devices[:4]], [d.name for d in cluster.devices[4:]]
    # two pipelines of two tp-2 stages, one on each node: 2 rings per stage (one per tp rank), 2 stages
    structure = [((a[0], a[1]), (a[2], a[3])), ((b[0], b[1]), (b[2], b[3]))]
    routes = cm.ring_bandwidths(structure)
    assert routes[0][0].nodes == ("a", "b")
    assert routes[0][0].flows == (4, 4)
    assert routes[0][0].send_flows == (1, 1)  # the pipeline send stays inside the node


def test_pipeline_sends_across_nodes_share_the_interface() -> None:
    cluster = cluster_from_dict(_two_nodes(nic=8.0))
    cm = CostModel(cluster, load_workload("gpt_small"), TrainSettings(8))
    a, b = [d.name for d in cluster.devices[:4]], [d.name for d in cluster.devices[4:]]
    structure = [((a[i],), (b[i],)) for i in range(4)]  # four pipelines, every boundary a -> b
    routes = cm.ring_bandwidths(structure)
    assert routes[0][0].send_flows == (4, 4)
    alone = cm.send_s(2, 3, a[0], b[0])
    shared = cm.send_s(2, 3, a[0], b[0], routes[0][0])
    bytes_ = cm._out[3] * 2
    assert alone == pytest.approx(2 * (ALPHA + bytes_ / 8e9))
    assert shared == pytest.approx(2 * (ALPHA + bytes_ / 2e9))


def test_tensor_parallel_allreduce_nvlink_vs_pcie() -> None:
    def cluster(intra: float):
        return cluster_from_dict({"name": "n", "nodes": [{"devices": [{"type": "V100-16GB", "count": 2}],
                                                          "intra_bandwidth_gbs": intra}]})
    wl = load_workload("gpt2_amp", dtype="fp16")
    settings = TrainSettings(8, dtype="fp16", max_tp=2)
    out_bytes = wl.layers[1].output_bytes_per_sample
    times = {}
    for intra in (150.0, 6.25):
        c = cluster(intra)
        cm = CostModel(c, wl, settings)
        tp1 = cm.stage_compute_s(c.devices[0], 1, 1, 1, 2)
        tp2 = cm.stage_compute_s(c.devices[0], 2, 1, 1, 2)
        # 4 allreduces per block (2 forward, 2 backward), each 2 (tp-1) steps of bytes/tp, at the
        # fraction of the link a blocking tp allreduce reaches
        comm = 4 * 2 * (ALPHA + out_bytes / 2 / (intra * 1e9 * TP_LINK_EFFICIENCY))
        assert tp2 == pytest.approx(tp1 / 2 + comm)
        times[intra] = tp2
    assert times[6.25] > times[150.0]


def test_gradients_move_in_fp32_unless_told() -> None:
    assert TrainSettings(8, dtype="bf16").grad_bytes == 4
    assert TrainSettings(8, dtype="bf16", grad_dtype="bf16").grad_bytes == 2
    with pytest.raises(ConfigError, match="settings.grad_dtype"):
        TrainSettings(8, grad_dtype="int8")


def test_flow_cap_above_the_interface_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"nodes\[0\].inter_flow_bandwidth_gbs"):
        cluster_from_dict(_two_nodes(nic=5.0, flow=6.0))


def test_sailor_network_one_flow_and_four_flows_use_the_measured_fits() -> None:
    cluster = load_cluster("sailor_a100_v100_32_96")
    net = SailorNetwork(cluster)
    v0, v1 = "v100_0", "v100_1"
    one = net.inter_flow_bandwidth(v0, v1, 1, 1, 5e8)
    four = net.inter_flow_bandwidth(v0, v1, 4, 4, 5e8)
    assert one / 1e9 <= 1.72 + 1e-9
    assert four * 4 / 1e9 <= 5.787 + 1e-9
    assert four < one  # four flows share the interface


def test_sailor_plan_scores_close_to_sailor_simulator_on_gradient_sync() -> None:
    workload = load_workload("opt350", dtype="fp16")
    cluster = load_cluster("sailor_a100_v100_32_96")
    profile = load_sailor_profile("OPT-350", workload)
    plan = Plan.load(SAILOR_DATA_DIR / "sailor_plan_32_96.json")
    ours = CostModel(cluster, workload, TrainSettings(1024, dtype="fp16", max_tp=4), profile).score(plan)
    rings = CostModel(cluster, workload, TrainSettings(1024, dtype="fp16", max_tp=4, sync_model="stage_rings"),
                      profile).score(plan)
    theirs = sailor_iteration_time(plan, cluster)
    assert ours.grad_dtype == "fp32"
    # Sailor's rule is one ring per stage: the stage-ring model gives it
    assert rings.sync_time_s == pytest.approx(theirs.sync_s, rel=0.10)
    # stage 0 mixes tp-1 A100s with tp-4 V100s: our runtime reduces it as four holder sets, each A100 rank in all
    # four in turn, so the runtime's price is above the ring's
    assert rings.sync_time_s < ours.sync_time_s < 1.5 * rings.sync_time_s
    # Sailor charges a stage only the sends it starts; our runtime's blocking sends occupy both ends (cost_model)
    assert theirs.iteration_s * 0.95 < ours.step_time_s < theirs.iteration_s * 1.25
    assert math.isfinite(ours.step_time_s)


def test_tp_link_efficiency_is_what_sailors_tp_profiles_imply() -> None:
    median, count = measured_tp_link_efficiency()
    assert count >= 50
    assert TP_LINK_EFFICIENCY == pytest.approx(median, abs=0.01)


def test_analytic_tp_scaling_agrees_with_sailors_nvlink_profiles() -> None:
    """Measured tp-1 block time x the model's tp rule vs measured tp > 1 on NVLink nodes: V100 tp 2 and 4,
    A100 tp 2 within 15%.  A100 tp 4 is not: at these sizes its kernels are launch-bound (the measured
    forward hardly shrinks from tp 2 to tp 4), which a FLOP-and-bytes model does not see (README)."""
    workload = load_workload("opt350", dtype="fp32")
    profile = load_sailor_profile("OPT-350", workload)
    block = workload.num_layers // 2
    for gpu, intra, tps in (("V100-16GB", 68.17, (2, 4)), ("A100-40GB", 243.21, (2,))):
        cluster = cluster_from_dict({"name": "n", "nodes": [{"devices": [{"type": gpu, "count": 4}],
                                                             "intra_bandwidth_gbs": intra}]})
        cm = CostModel(cluster, workload, TrainSettings(8, dtype="fp32", max_tp=4))
        dev = cluster.devices[0]
        for tp in tps:
            for mbs in (2, 4):
                f1, b1, _ = profile.times[(gpu, 1)][mbs][block]
                f, b, _ = profile.times[(gpu, tp)][mbs][block]
                rule = cm.stage_compute_s(dev, tp, mbs, block, block + 1) / cm.stage_compute_s(dev, 1, mbs, block,
                                                                                               block + 1)
                assert (f1 + b1) * rule == pytest.approx(f + b, rel=0.15), (gpu, tp, mbs)


def test_amp_measured_best_plan_ranks_first_under_our_model() -> None:
    """AMP's six measured plans: (1, 1, 2, 8), fastest on the real cluster (1.28 s), is our fastest too."""
    from het_strategy.reference.amp_plans import amp_measured_plans

    cluster, workload = load_cluster("amp_v100_t4"), load_workload("gpt2_amp", dtype="fp16")
    cm = CostModel(cluster, workload, TrainSettings(32, dtype="fp16", max_tp=2))
    plans = amp_measured_plans(cluster, workload)
    assert len(plans) == 6
    predicted = {p.label: cm.score(p.plan).step_time_s for p in plans}
    assert min(predicted, key=predicted.get) == (1, 1, 2, 8)
    # the tp-2 plans, measured 2.2x and 3.0x slower than the best, are slower than every tp-1 pipeline plan
    tp1_pipelines = [t for label, t in predicted.items() if label[1] == 1 and label[3] >= 4]
    assert min(t for label, t in predicted.items() if label[1] == 2) > max(tp1_pipelines)


def test_planner_beats_sailors_plan_under_sailors_simulator_at_32_96() -> None:
    """With Sailor's runtime constraints (one micro-batch size, equal shares) our plan for 32:96, chosen by
    our model, is faster than Sailor's own plan under Sailor's simulator (5.884 s)."""
    from het_strategy.planning import search_plan as make_plan

    workload = load_workload("opt350", dtype="fp16")
    cluster = load_cluster("sailor_a100_v100_32_96")
    profile = load_sailor_profile("OPT-350", workload)
    settings = TrainSettings(1024, dtype="fp16", max_tp=4, max_stages=8, micro_batch_sizes=(2,), equal_shares=True)
    ours = make_plan(cluster, workload, settings, profile=profile)
    assert len({p.samples for p in ours.pipelines}) <= 2  # equal shares (B / dp, +1 for the remainder)
    theirs = sailor_iteration_time(Plan.load(SAILOR_DATA_DIR / "sailor_plan_32_96.json"), cluster).iteration_s
    assert sailor_iteration_time(ours, cluster).iteration_s < theirs
