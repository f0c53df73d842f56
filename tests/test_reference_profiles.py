"""Sailor's measured data read into our types: profile lookups, bandwidth fits, ratios."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from het_strategy.core.catalog import device_catalog
from het_strategy.core.errors import ConfigError
from het_strategy.core.workload import load_workload
from het_strategy.reference.sailor_profiles import (
    SAILOR_DATA_DIR,
    load_sailor_profile,
    load_sailor_training_config,
    sailor_bandwidth_gbs,
    sailor_peak_bandwidth_gbs,
)

_SHARED = Path("/work/shared/reference/sailor")


@pytest.fixture(scope="module")
def opt350_profile():
    return load_sailor_profile("OPT-350", workload=load_workload("opt350"))


# -- profiles ---------------------------------------------------------------------------------


def test_lookup_returns_the_json_numbers(opt350_profile):
    # layer_profiles.json: OPT-350 / A100-40 / mbs "1" / tp "1" / layer "1"
    assert opt350_profile.layer_times("A100-40GB", 1, 1)[1] == (0.002786, 0.005906, 0.002938)
    # V100-16 / mbs "4" / tp "2" / layer "2"
    assert opt350_profile.layer_times("V100-16GB", 2, 4)[2] == (0.016014, 0.035784, 0.002492)


def test_keys_are_catalog_names_and_ints(opt350_profile):
    catalog = set(device_catalog())
    assert opt350_profile.device_types() <= catalog
    assert {"A100-40GB", "V100-16GB", "GH200-96GB", "A100-80GB", "RTX-3090", "Titan-RTX",
            "RTX-2080-Ti"} == opt350_profile.device_types()  # Sailor's RTX-2080 (11 GB)
    for (dt, tp), table in opt350_profile.times.items():
        assert isinstance(tp, int) and all(isinstance(mb, int) for mb in table)
        assert all(len(rows) == 26 for rows in table.values())


def test_key_order_is_micro_batch_then_tp(opt350_profile):
    # A100-40 was measured at tp 1, 2, 4 (nodes of 4) and micro-batch 1, 2, 4, 8
    assert {tp for dt, tp in opt350_profile.times if dt == "A100-40GB"} == {1, 2, 4}
    assert set(opt350_profile.times[("A100-40GB", 1)]) == {1, 2, 4, 8}
    # the optimizer update shards with tp (halves) and does not depend on the micro-batch
    upd = {tp: opt350_profile.layer_times("A100-40GB", tp, 1)[2][2] for tp in (1, 2)}
    assert upd[2] == pytest.approx(upd[1] / 2, rel=0.05)
    assert opt350_profile.layer_times("A100-40GB", 1, 8)[2][2] == pytest.approx(upd[1], rel=0.01)
    # block time grows about linearly with the micro-batch
    t1 = sum(opt350_profile.layer_times("A100-40GB", 1, 1)[2][:2])
    t8 = sum(opt350_profile.layer_times("A100-40GB", 1, 8)[2][:2])
    assert 6.5 < t8 / t1 < 8.5


def test_interpolates_between_measured_micro_batches(opt350_profile):
    # mbs 3 lies halfway between the measured 2 ([0.004169, 0.011628]) and 4 ([0.008204, 0.022715])
    fwd, bwd, upd = opt350_profile.layer_times("A100-40GB", 1, 3)[2]
    assert fwd == pytest.approx((0.004169 + 0.008204) / 2)
    assert bwd == pytest.approx((0.011628 + 0.022715) / 2)
    assert upd == pytest.approx(0.00293)


def test_v100_over_a100_block_ratio(opt350_profile):
    a100 = opt350_profile.layer_times("A100-40GB", 1, 1)
    v100 = opt350_profile.layer_times("V100-16GB", 1, 1)
    blocks = range(1, 25)
    ratio = sum(v100[i][0] + v100[i][1] for i in blocks) / sum(a100[i][0] + a100[i][1] for i in blocks)
    print(f"measured V100-16GB / A100-40GB per-block fwd+bwd time, tp1 mbs1: {ratio:.3f}x")
    # by hand from layer 2: (0.007321 + 0.017195) / (0.002314 + 0.005909) = 2.981
    assert 2.5 <= ratio <= 3.5


def test_layer_count_mismatch_is_rejected():
    with pytest.raises(ConfigError, match="26 layers"):
        load_sailor_profile("OPT-350", workload=load_workload("gpt_small"))


def test_unknown_model_is_rejected():
    with pytest.raises(ConfigError, match="`model` is 'OPT-13'"):
        load_sailor_profile("OPT-13")


def test_opt350_config_matches_sailors_training_config():
    sailor = load_sailor_training_config("OPT-350")
    w = load_workload("opt350")
    assert w.num_layers == sailor["num_all_layers"] == 26
    assert w.seq_len == sailor["sequence_length"]
    assert w.layers[0].params == sailor["vocab_size"] * sailor["hidden_size"] + w.seq_len * sailor["hidden_size"]


# -- bandwidth fits -------------------------------------------------------------------------------


def test_intra_node_fit_by_hand():
    # intra_node_bandwidth_fits.json A100-40 / "4": [0.8303558, 15.58397854, 31.19114521], peak 243214602913.5
    m = math.log2(1e8 / 1e6)
    by_hand = 0.8303558 * m**2 + 15.58397854 * m + 31.19114521  # 171.38 GB/s, below the peak
    assert sailor_bandwidth_gbs("A100-40GB", 4, 1e8) == pytest.approx(by_hand, rel=1e-12)
    assert sailor_bandwidth_gbs("A100-40", 4, 1e8) == pytest.approx(171.38, abs=0.01)
    # at 1 GB the polynomial (269 GB/s) passes the measured peak: capped
    assert sailor_bandwidth_gbs("A100-40GB", 4, 1e9) == pytest.approx(243.2146029135, rel=1e-12)
    assert sailor_peak_bandwidth_gbs("V100-16GB", 4) == pytest.approx(68.172954066, rel=1e-12)


def test_inter_node_fit_by_hand():
    # us-central1-a V100-16 "4" -> A100-40 "4": [-0.008450897567554275, 0.32345407867588116, 3.446937175278422]
    m = math.log2(1e8 / 1e6)
    by_hand = -0.008450897567554275 * m**2 + 0.32345407867588116 * m + 3.446937175278422  # 5.223 GB/s
    got = sailor_bandwidth_gbs("V100-16GB", 4, 1e8, inter_node=True, peer_gpu="A100-40GB")
    assert got == pytest.approx(by_hand, rel=1e-12)
    assert got == pytest.approx(5.2229, abs=1e-3)
    assert sailor_peak_bandwidth_gbs("A100-40GB", 4, inter_node=True) == pytest.approx(6.03591305104673, rel=1e-12)


def test_fit_outside_its_range_and_unknown_gpu_raise():
    with pytest.raises(ConfigError, match="message_bytes"):
        sailor_bandwidth_gbs("A100-40GB", 4, 1e3)  # the fit is negative for a 1 kB message
    with pytest.raises(ConfigError, match="`gpu` is 'T4'"):
        sailor_bandwidth_gbs("T4", 4, 1e8)
    with pytest.raises(ConfigError, match="`num_gpus` is 3"):
        sailor_bandwidth_gbs("A100-40GB", 3, 1e8)


def test_devices_sailor_did_not_measure_are_priced_by_the_analytic_model_and_the_cluster_file_and_said_so(
        opt350_profile):
    """planner.profile=sailor on a cluster with GPU types Sailor did not measure (A10G; a node mixing A100 and T4):
    those links get the cluster file's figures, those stages the analytic model, and the table lines name both;
    a node of one measured type keeps Sailor's fit."""
    from het_strategy.core.cluster import load_cluster
    from het_strategy.core.cost_model import CostModel
    from het_strategy.core.network import Network
    from het_strategy.core.train_settings import TrainSettings
    from het_strategy.planning import PlanRequest, plan
    from het_strategy.reference.sailor_profiles import SailorNetwork, request_profile

    cluster = load_cluster({"name": "three", "inter_node_bandwidth_gbs": 12.5, "nodes": [
        {"name": "a100", "intra_bandwidth_gbs": 100, "devices": [{"type": "A100-40GB", "count": 2}]},
        {"name": "mixed", "intra_bandwidth_gbs": 16, "devices": [{"type": "A100-40GB"}, {"type": "T4"}]},
        {"name": "a10g", "intra_bandwidth_gbs": 16, "devices": [{"type": "A10G", "count": 2}]}]})
    sailor, plain = SailorNetwork(cluster), Network(cluster)
    for node in ("mixed", "a10g"):
        assert sailor.intra_bandwidth(node, 2, 1e8) == plain.intra_bandwidth(node, 2, 1e8) == 16e9
    assert sailor.inter_flow_bandwidth("a100", "a10g", 1, 1, 1e8) == plain.inter_flow_bandwidth("a100", "a10g", 1, 1,
                                                                                                   1e8)
    assert sailor.intra_bandwidth("a100", 2, 1e8) == pytest.approx(sailor_bandwidth_gbs("A100-40GB", 2, 1e8) * 1e9)
    assert "the cluster file's figures on nodes mixed, a10g" in sailor.describe()

    workload = load_workload("opt350")
    request = PlanRequest(profile="sailor")
    result = plan(cluster, workload, TrainSettings(global_batch_size=32), request, request_profile(request, workload))
    # it plans with the devices Sailor did not measure; a device left out is left out for a reason it gives (the
    # T4 joins no pipeline at less cost than it adds to the holder-set sync, and holds no replica)
    assert {"a10g/0", "a10g/1"} <= set(result.plan.used_devices)
    assert set(result.plan.used_devices) | set(result.idle) == {d.name for d in cluster.devices}
    # under the stage-ring sync the T4 earns a stage; scoring that plan names how each unmeasured type was priced
    rings = TrainSettings(global_batch_size=32, sync_model="stage_rings")
    with_t4 = plan(cluster, workload, rings, request, request_profile(request, workload))
    assert set(with_t4.plan.used_devices) == {d.name for d in cluster.devices}
    score = CostModel(cluster, workload, rings, opt350_profile).score(with_t4.plan)
    assert score.step_time_s == pytest.approx(with_t4.score.step_time_s) and score.network == sailor.describe()
    assert score.compute == ("measured per-layer times of OPT-350 for A100-40GB tp 1; the analytic model for "
                             "A10G tp 1, T4 tp 1 (not in the profile); FLOPs over the datasheet rate "
                             "(compute_model=flops): A10G at bf16 70 TFLOPS x 0.4 efficiency, T4 at fp32 8.1 TFLOPS "
                             "x 0.3 efficiency")


@pytest.mark.skipif(not _SHARED.is_dir(), reason="the shared reference folder is not on this machine")
def test_vendored_copy_is_identical():
    for src in _SHARED.iterdir():
        assert (SAILOR_DATA_DIR / src.name).read_bytes() == src.read_bytes(), src.name
