"""AMP's measured GPT-2 profiles (``reference/amp_profile.py``) through the cost model's measured-profile path."""

from __future__ import annotations

import json

import pytest

from het_strategy.core.cluster import load_cluster
from het_strategy.core.cost_model import CostModel
from het_strategy.core.errors import ConfigError
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import load_workload
from het_strategy.reference.amp_plans import amp_measured_plans
from het_strategy.reference.amp_profile import AMP_KNOWN_COST, load_amp_profile

_RAW = json.loads(AMP_KNOWN_COST.read_text())


def _spearman(a: list[float], b: list[float]) -> float:
    def ranks(values: list[float]) -> list[int]:
        order = sorted(range(len(values)), key=values.__getitem__)
        return [order.index(i) for i in range(len(values))]

    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def test_amps_thirty_entries_map_onto_our_embedding_blocks_and_head() -> None:
    workload = load_workload("gpt2_amp", dtype="fp16")
    profile = load_amp_profile(workload)
    assert set(profile.times) == {(t, tp) for t in ("T4", "V100-16GB") for tp in (1, 2, 4)}
    amp = _RAW["gpt2"]["T4"]["2"]
    rows = profile.layer_times("T4", 2, 1)
    assert len(rows) == workload.num_layers == 26
    assert rows[0][0] == pytest.approx(amp[0] + amp[1])  # embed2h + its no-op
    assert [r[0] for r in rows[1:25]] == pytest.approx(amp[2:26])  # the 24 blocks
    assert rows[25][0] == pytest.approx(sum(amp[26:30]))  # no-op, no-op, embed2v, no-op
    assert all(b == pytest.approx(2 * f) and u is None for f, b, u in rows)  # AMP: forward + backward = 3x forward
    f4, b4, _ = profile.layer_times("V100-16GB", 1, 4)[5]  # one measured micro-batch: time in proportion
    assert f4 == pytest.approx(4 * _RAW["gpt2"]["V100-16"]["1"][6]) and b4 == pytest.approx(2 * f4)


def test_an_unmeasured_update_is_priced_from_memory_bandwidth() -> None:
    cluster, workload = load_cluster("amp_v100_t4"), load_workload("gpt2_amp", dtype="fp16")
    settings = TrainSettings(32, dtype="fp16")
    profiled, datasheet = CostModel(cluster, workload, settings, load_amp_profile(workload)), \
        CostModel(cluster, workload, settings)
    t4 = next(d for d in cluster.devices if d.type == "T4")
    by_hand = sum(layer.total_params for layer in workload.layers[1:25]) / 2 * 16 / (t4.memory_bandwidth_gbs * 1e9)
    assert profiled.stage_update_s(t4, 2, 1, 25, 1) == pytest.approx(by_hand)
    assert profiled.stage_update_s(t4, 2, 1, 25, 1) == datasheet.stage_update_s(t4, 2, 1, 25, 1)
    forward = sum(_RAW["gpt2"]["T4"]["2"][2:26])
    assert profiled.stage_compute_s(t4, 2, 1, 1, 25) == pytest.approx(3 * forward)  # no analytic tp term added


def test_a_table_of_another_length_is_refused_naming_it(tmp_path) -> None:
    bad = json.loads(json.dumps(_RAW))
    bad["gpt2"]["T4"]["4"] = bad["gpt2"]["T4"]["4"][:-1]
    path = tmp_path / "known_cost.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=r"amp\.gpt2\.T4\[tp=4\]"):
        load_amp_profile(load_workload("gpt2_amp", dtype="fp16"), path)


def test_amps_measured_order_under_its_own_profiles() -> None:
    """Nothing is fitted to AMP's six iteration times: the profiles only price the layers.  Priced from them, the
    measured best (1, 1, 2, 8) is our best, the two tp-2 plans (measured slowest) are our slowest, and the rank
    correlation with the measured times is at least the datasheet pricing's (1.0 against 0.83 at the time of
    writing)."""
    cluster, workload = load_cluster("amp_v100_t4"), load_workload("gpt2_amp", dtype="fp16")
    settings = TrainSettings(32, dtype="fp16", max_tp=2)
    profiled = CostModel(cluster, workload, settings, load_amp_profile(workload))
    datasheet = CostModel(cluster, workload, settings)
    plans = amp_measured_plans(cluster, workload)
    measured = [p.measured_s for p in plans]
    ours = {p.label: profiled.score(p.plan).step_time_s for p in plans}
    assert min(ours, key=ours.get) == (1, 1, 2, 8)
    assert _spearman(measured, list(ours.values())) >= 0.9
    assert _spearman(measured, list(ours.values())) >= _spearman(
        measured, [datasheet.score(p.plan).step_time_s for p in plans])
    assert max(ours, key=ours.get) == (1, 2, 1, 8)  # the slowest measured plan is our slowest
    assert sorted(ours, key=ours.get)[-2:] == [(1, 2, 2, 4), (1, 2, 1, 8)]  # both tp-2 plans last, as measured
