"""A device's measured codec throughput (``codec_gbs``) prices the codec passes of a compressed sync
(core/compressed_sync.py); without it, a fraction of the memory bandwidth does."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from het_strategy.core import catalog
from het_strategy.core.catalog import DeviceType, lookup_device_type
from het_strategy.core.cluster import cluster_from_dict, load_cluster
from het_strategy.core.compressed_sync import CODEC_FRACTION, codec_bandwidth, hierarchical_sync_s, wire_fraction
from het_strategy.core.cost_model import CostModel
from het_strategy.core.device_spec import DeviceSpec, device_from_dict
from het_strategy.core.errors import ConfigError
from het_strategy.core.network import SyncRoute
from het_strategy.core.outer_sync_cost import OuterSyncCost
from het_strategy.core.train_settings import TrainSettings
from tests._planning_cases import device, small_workload

GRAD = 4e8  # bytes of gradient synced
ROUTE, LEADERS = SyncRoute(4, ("a", "b"), (1, 1)), SyncRoute(2, ("a", "b"), (1, 1))


def _cluster(codec_a: float | None = None, codec_b: float | None = None) -> dict:
    """Two nodes of two custom devices (memory bandwidth 1000 GB/s), node a's first and node b's first device
    given a ``codec_gbs`` where not None."""
    def dev(name: str, codec_gbs: float | None) -> dict:
        return device(name, 50) | ({} if codec_gbs is None else {"codec_gbs": codec_gbs})
    return {"name": "ab", "inter_node_bandwidth_gbs": 0.5, "nodes": [
        {"name": "a", "intra_bandwidth_gbs": 100, "devices": [dev("a0", codec_a), dev("a1", None)]},
        {"name": "b", "intra_bandwidth_gbs": 100, "devices": [dev("b0", codec_b), dev("b1", None)]}]}


def _q4_model(raw: dict) -> CostModel:
    s = TrainSettings(global_batch_size=8, micro_batch_sizes=(1, 2), inter_node_compression="q4")
    return CostModel(cluster_from_dict(raw), small_workload(), s)


def _by_hand(cm: CostModel, codec_bw: float) -> float:
    """The hierarchical exchange of GRAD over ROUTE with the codec passes at ``codec_bw`` bytes/s."""
    ring = cm.network.ring_allreduce_s(GRAD * wire_fraction("q4"), LEADERS)
    return hierarchical_sync_s(GRAD, 4, 2, 100e9, ring, cm.network.latency_s, codec_bw, "q4")


def test_a_measured_codec_gbs_prices_the_codec_passes() -> None:
    """Every device at 1000 GB/s of memory (125 GB/s of codec by the 1/8 fraction); node b's first device
    measured at 20 GB/s: the slowest device of the route, so the two passes run at 20 GB/s."""
    cm = _q4_model(_cluster(codec_b=20))
    assert [d.codec_gbs for d in cm.cluster.devices] == [None, None, 20.0, None]
    assert cm.allreduce_s(GRAD, 4, ROUTE) == pytest.approx(_by_hand(cm, 20e9))
    # halving it adds two passes over the gradient at 20 GB/s: 2 x GRAD / 20e9 = 40 ms
    halved = _q4_model(_cluster(codec_b=10))
    assert halved.allreduce_s(GRAD, 4, ROUTE) - cm.allreduce_s(GRAD, 4, ROUTE) == pytest.approx(2 * GRAD / 20e9)
    # a figure above the fraction's prices the passes faster than the fraction: the slowest device decides
    fast = _q4_model(_cluster(codec_a=500, codec_b=500))
    assert fast.allreduce_s(GRAD, 4, ROUTE) == pytest.approx(_by_hand(fast, 1000e9 / 8))
    every = {"name": "ab", "inter_node_bandwidth_gbs": 0.5, "nodes": [
        {"name": n, "intra_bandwidth_gbs": 100, "devices": [device(f"{n}{i}", 50) | {"codec_gbs": 500}
                                                            for i in range(2)]} for n in "ab"]}
    all_measured = _q4_model(every)
    assert all_measured.allreduce_s(GRAD, 4, ROUTE) == pytest.approx(_by_hand(all_measured, 500e9))


def test_without_codec_gbs_the_fraction_of_memory_bandwidth_prices_it() -> None:
    t4, cpu = (device_from_dict({"type": t}, t, "n", lookup_device_type(t), "d") for t in ("T4", "CPU"))
    assert t4.codec_gbs is None and cpu.codec_gbs is None  # the catalog CPU keeps its measured fraction
    assert codec_bandwidth(t4) == pytest.approx(320e9 / 8) == pytest.approx(320e9 * CODEC_FRACTION["accelerator"])
    assert codec_bandwidth(cpu) == pytest.approx(50e9 / 60) == pytest.approx(50e9 * CODEC_FRACTION["cpu"])
    custom = device_from_dict(device("c", 10), "c", "n", None, "d")  # memory bandwidth 1000 GB/s
    assert custom.codec_gbs is None and codec_bandwidth(custom) == pytest.approx(1000e9 / 8)
    cm = _q4_model(_cluster())
    assert cm.allreduce_s(GRAD, 4, ROUTE) == pytest.approx(_by_hand(cm, 1000e9 / 8))
    # given, the measured figure replaces the fraction, on a CPU too
    assert codec_bandwidth(dataclasses.replace(cpu, codec_gbs=0.65)) == pytest.approx(0.65e9)
    assert codec_bandwidth(dataclasses.replace(t4, codec_gbs=25)) == pytest.approx(25e9)


def test_the_outer_exchange_encodes_at_the_leaders_codec_gbs() -> None:
    """DiLoCo's outer exchange: one encode is half a round trip of the fp32 parameters at the slowest leader's."""
    raw = _cluster(codec_a=4, codec_b=8)
    cm = CostModel(cluster_from_dict(raw), small_workload(), TrainSettings(global_batch_size=8, micro_batch_sizes=(1,)))
    q4 = OuterSyncCost(cm, (("a0", "a1"), ("b0", "b1"))).exchange("q4")
    assert q4.encode_s == pytest.approx(4 * cm.workload.total_params / 4e9 / 2)


def test_codec_gbs_is_overridable_per_device_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "measured.yaml"
    path.write_text("nodes:\n  - name: a\n    devices: [{type: T4, count: 2, codec_gbs: 25}, L4]\n"
                    "  - name: b\n    intra_bandwidth_gbs: 10\n    devices: [{type: MyChip, tflops: 100,"
                    " memory_gb: 8, memory_bandwidth_gbs: 500, codec_gbs: 7.5}]\n")
    cluster = load_cluster(path)
    assert [d.codec_gbs for d in cluster.devices] == [25.0, 25.0, None, 7.5]  # a custom device may give it too
    again = cluster_from_dict(cluster.to_dict())  # the explicit form carries the figures
    assert [d.codec_gbs for d in again.devices] == [25.0, 25.0, None, 7.5]
    assert "codec_gbs" not in cluster.to_dict()["nodes"][0]["devices"][2]  # nothing written where none is given


@pytest.mark.parametrize(("text", "shown"), [("0", "0"), ("-1", "-1"), ("fast", "'fast'"), (".inf", "inf"),
                                             ("true", "True"), ("1.0e+9", "1000000000.0")])
def test_a_bad_codec_gbs_names_the_field_the_value_and_the_rule(tmp_path: Path, text: str, shown: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(f"nodes:\n  - devices: [{{type: T4, codec_gbs: {text}}}]\n")
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    msg = str(err.value)
    assert f"`cluster.nodes[0].devices[0].codec_gbs` is {shown}; it must " in msg, msg
    assert ("> 0 (GB/s" in msg) if text != "1.0e+9" else ("[0.001, 1e+06] GB/s" in msg)


def test_a_device_spec_checks_its_codec_gbs() -> None:
    t4 = cluster_from_dict({"nodes": [{"devices": ["T4"]}]}).devices[0]
    with pytest.raises(ConfigError, match=r"`device `x`.codec_gbs` is -2; it must be a finite number > 0"):
        dataclasses.replace(t4, name="x", codec_gbs=-2)


def _measured_t4() -> DeviceType:
    return dataclasses.replace(lookup_device_type("T4"), name="T4-measured", aliases=(), codec_gbs=30.0)


def test_a_catalog_entry_s_codec_gbs_reaches_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    dt = _measured_t4()
    spec = device_from_dict({"type": dt.name}, "x", "n", dt, "nodes[0].devices[0]")
    assert isinstance(spec, DeviceSpec) and spec.codec_gbs == 30.0 and codec_bandwidth(spec) == pytest.approx(30e9)
    # whatever else the entry overrides, the measured figure stays; the cluster file's own figure replaces it
    assert device_from_dict({"type": dt.name, "tflops": 20}, "x", "n", dt, "d").codec_gbs == 30.0
    assert device_from_dict({"type": dt.name, "codec_gbs": 12}, "x", "n", dt, "d").codec_gbs == 12.0
    # through the catalog a cluster file reads
    entries = {**catalog.device_catalog(), dt.name: dt}
    monkeypatch.setattr(catalog, "device_catalog", lambda: entries)
    cluster = cluster_from_dict({"nodes": [{"devices": ["T4-measured", "T4"]}]})
    assert [d.codec_gbs for d in cluster.devices] == [30.0, None]
    assert [codec_bandwidth(d) for d in cluster.devices] == pytest.approx([30e9, 320e9 / 8])


def test_the_catalog_reads_codec_gbs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "catalog.yaml"
    entry = ("{vendor: nvidia, tflops: {fp32: 10}, memory_gb: 16, memory_bandwidth_gbs: 300, efficiency: 0.4, "
             "intra_node_bandwidth_gbs: 16, price_per_hour: 1.0")
    path.write_text(f"X1: {entry}, codec_gbs: 42}}\nX2: {entry}}}\n")
    monkeypatch.setattr(catalog, "_CATALOG_PATH", path)
    catalog.device_catalog.cache_clear()
    try:
        entries = catalog.device_catalog()
        assert entries["X1"].codec_gbs == 42.0 and isinstance(entries["X1"].codec_gbs, float)
        assert entries["X2"].codec_gbs is None
    finally:
        monkeypatch.undo()
        catalog.device_catalog.cache_clear()
    assert catalog.device_catalog()["CPU"].codec_gbs is None
