"""The runtime probe: device measurement, link measurement over gloo, the probed ClusterSpec and its cache."""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests._spawned_ranks import run_spawned_ranks

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from het_strategy.core.errors import ConfigError  # noqa: E402
from het_strategy.profiling import device_probe, probe, probe_cache  # noqa: E402
from het_strategy.profiling.device_probe import measure_device  # noqa: E402
from het_strategy.profiling.measurements import (  # noqa: E402
    AllreduceTiming,
    DeviceMeasurement,
    LinkMeasurement,
    P2PTiming,
    SnappedFigures,
    best_rounds_figure,
    peak_noise,
    snap_like_devices,
)
from het_strategy.profiling.probe import ProbeResult, cluster_from_measurements  # noqa: E402

TIMEOUT_S = 60
BUDGET_S = 0.05
SIZES = (4096, 65536)
HOST_GIB = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def _device(host: str, tflops: float = 1.0, mem: float = 8.0, rounds: tuple[float, ...] = (),
            type_: str = "CPU", copy: float = 20.0) -> DeviceMeasurement:
    """A measurement; with ``rounds``, its TFLOPS is their figure (the median of the best three)."""
    return DeviceMeasurement(host=host, device="cpu", raw_name="cpu", type=type_, dtype="fp32",
                             tflops=best_rounds_figure(rounds) if rounds else tflops, memory_gb=mem,
                             memory_bandwidth_gbs=copy, tflops_rounds=rounds)


def _links(pairs: dict[tuple[int, int], float], world: int, busbw: float = 3.0) -> LinkMeasurement:
    size = 1 << 20
    return LinkMeasurement(
        backend="gloo", world_size=world,
        allreduce=(AllreduceTiming(size, 1e-3, size / 1e-3 / 1e9, busbw),),
        p2p=tuple(P2PTiming(a, b, size, size / gbs / 1e9, gbs) for (a, b), gbs in pairs.items()))


# -- one device -------------------------------------------------------------------------------------
def test_measure_device_on_cpu_gives_positive_figures_and_the_hosts_memory_share():
    m = measure_device("cpu", "fp32", budget_s=BUDGET_S, num_local_ranks=2)
    assert m.tflops > 0 and m.memory_bandwidth_gbs > 0
    assert m.memory_gb == pytest.approx(HOST_GIB / 2)
    assert (m.host, m.device, m.type, m.dtype) == (socket.gethostname(), "cpu", "CPU", "fp32")


def test_measure_device_counts_two_n_cubed_flops_per_matmul(monkeypatch):
    # a stand-in matmul that takes 10 ms: the figure must be 2 n^3 / 10 ms (sleep overshoots, never undershoots)
    delay, side = 0.01, 32

    def slow_mm(a, b, *, out):
        time.sleep(delay)
        return out

    monkeypatch.setattr(torch, "mm", slow_mm)
    m = measure_device("cpu", budget_s=BUDGET_S, matmul_size=side)
    expected = 2 * side**3 / delay / 1e12
    assert 0.8 * expected < m.tflops <= expected


def test_measure_device_runs_in_the_training_dtype(monkeypatch):
    seen = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b, **kw: seen.append(a.dtype) or real_mm(a, b, **kw))
    m = measure_device("cpu", "bf16", budget_s=0.01, matmul_size=16)
    assert m.dtype == "bf16" and set(seen) == {torch.bfloat16}


def test_device_measurement_round_trips_through_json():
    m = measure_device("cpu", budget_s=0.01, matmul_size=64)
    assert DeviceMeasurement.from_dict(json.loads(json.dumps(m.to_dict()))) == m


@pytest.mark.parametrize("bad", [{"host": "h"}, {**_device("h").to_dict(), "extra": 1},
                                 {**_device("h").to_dict(), "tflops": -1.0}, {**_device("h").to_dict(), "dtype": "fp8"}])
def test_device_measurement_rejects_bad_dicts(bad):
    with pytest.raises(ConfigError):
        DeviceMeasurement.from_dict(bad)


def test_measure_device_rejects_a_bad_dtype_naming_it():
    with pytest.raises(ConfigError, match="`dtype` is 'fp8'"):
        measure_device("cpu", "fp8")


def test_link_measurement_round_trips():
    links = _links({(0, 1): 2.0, (1, 0): 2.5}, world=2)
    assert LinkMeasurement.from_dict(json.loads(json.dumps(links.to_dict()))) == links


# -- measurements -> ClusterSpec ------------------------------------------------------------------------
def test_cluster_from_measurements_two_hosts_uses_slowest_pairs():
    devices = [_device("a", 1.0), _device("a", 2.0), _device("b", 3.0, mem=4.0), _device("b", 4.0)]
    # ring pairs: (0,1) and (2,3) inside hosts, (1,2) and (3,0) across
    links = _links({(0, 1): 9.0, (1, 2): 1.5, (2, 3): 7.0, (3, 0): 1.2}, world=4)
    cluster = cluster_from_measurements(devices, links, name="probed")
    assert cluster.name == "probed"
    assert [n.name for n in cluster.nodes] == ["a", "b"]
    assert [d.name for d in cluster.devices] == ["rank0", "rank1", "rank2", "rank3"]
    assert [n.intra_bandwidth_gbs for n in cluster.nodes] == [9.0, 7.0]
    assert cluster.inter_node_bandwidth_gbs == 1.2
    assert [d.tflops for d in cluster.devices] == [{"fp32": t} for t in (1.0, 2.0, 3.0, 4.0)]
    assert {d.efficiency for d in cluster.devices} == {1.0}
    assert cluster.device("rank2").memory_gb == 4.0 and cluster.device("rank2").memory_bandwidth_gbs == 20.0


def test_single_rank_nodes_take_the_allreduce_bus_bandwidth():
    links = _links({(0, 1): 2.0, (1, 0): 2.2}, world=2, busbw=3.0)
    cluster = cluster_from_measurements([_device("a"), _device("b")], links)
    assert [n.intra_bandwidth_gbs for n in cluster.nodes] == [3.0, 3.0]
    assert cluster.inter_node_bandwidth_gbs == 2.0


def test_unknown_device_type_is_described_by_its_measured_figures():
    dev = DeviceMeasurement(host="h", device="cuda:0", raw_name="Some New GPU", type="Some New GPU", dtype="bf16",
                            tflops=300.0, memory_gb=64.0, memory_bandwidth_gbs=2000.0)
    cluster = cluster_from_measurements([dev], _links({}, world=1, busbw=0.0))
    (d,) = cluster.devices
    assert (d.type, dict(d.tflops), d.memory_gb) == ("Some New GPU", {"bf16": 300.0}, 64.0)
    # one rank: no link exists, the device's own memory bandwidth stands in
    assert cluster.nodes[0].intra_bandwidth_gbs == 2000.0 == cluster.inter_node_bandwidth_gbs


def test_interleaved_hosts_warn():
    links = _links({(0, 1): 1.0, (1, 2): 1.0, (2, 0): 1.0}, world=3)
    with pytest.warns(UserWarning, match="not contiguous"):
        cluster = cluster_from_measurements([_device("a"), _device("b"), _device("a")], links)
    assert [d.name for d in cluster.node("a").devices] == ["rank0", "rank2"]


def test_table_lists_every_rank_and_link():
    devices = (_device("a", 1.25), _device("a", 2.5))
    links = _links({(0, 1): 2.0, (1, 0): 2.5}, world=2)
    text = ProbeResult(cluster_from_measurements(devices, links), devices, links, from_cache=True).table()
    assert "cached" in text and "p2p 0->1" in text and "p2p 1->0" in text and "allreduce" in text
    rows = [line.split() for line in text.splitlines()[3:5]]
    assert [r[:5] for r in rows] == [["0", "a", "cpu", "CPU", "1.25"], ["1", "a", "cpu", "CPU", "2.5"]]


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HET_STRATEGY_CACHE", str(tmp_path))
    assert probe_cache.default_cache_dir() == tmp_path
    monkeypatch.delenv("HET_STRATEGY_CACHE")
    assert probe_cache.default_cache_dir() == Path.home() / ".cache" / "het_strategy" / "probe"


# -- two gloo ranks ------------------------------------------------------------------------------------
def _summary(result: ProbeResult) -> dict:
    return {"cluster": result.cluster.to_dict(), "devices": [d.to_dict() for d in result.devices],
            "links": result.links.to_dict(), "from_cache": result.from_cache,
            "snapped": [s.to_dict() for s in result.snapped], "cached": list(result.cached)}


def _probe_worker(rank: int, port: int, cache_dir: str, out_dir: str) -> None:
    """One rank: probe four times (measure, cached, corrupt cache on rank 0, refresh), write what it saw."""
    out = Path(out_dir)
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=TIMEOUT_S))
        kw = dict(cache_dir=cache_dir, budget_s=BUDGET_S, sizes_bytes=SIZES, repeats=2, rounds=3, print_table=False)
        runs = {"first": probe.probe_cluster("cpu", **kw), "second": probe.probe_cluster("cpu", **kw)}
        if rank == 0:
            for path in Path(cache_dir).glob("device-*cpu0of2*.json"):
                path.write_text("{ not json")
        dist.barrier()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs["corrupt"] = probe.probe_cluster("cpu", **kw)
        runs["refresh"] = probe.probe_cluster("cpu", refresh=True, **kw)
        table = runs["second"].table()
        dist.destroy_process_group()
        summary = {k: _summary(v) for k, v in runs.items()}
        summary["warnings"] = [str(w.message) for w in caught]
        summary["table"] = table
        (out / f"rank{rank}.json").write_text(json.dumps(summary))
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _run_two_ranks(tmp_path: Path) -> list[dict]:
    return run_spawned_ranks(_probe_worker, 2, tmp_path, TIMEOUT_S)


@pytest.mark.multiprocess
def test_probe_cluster_measures_then_loads_from_cache(tmp_path):
    rank0, rank1 = _run_two_ranks(tmp_path)
    warned = rank0.pop("warnings") + rank1.pop("warnings")
    assert rank0 == rank1, "every rank must get the same probe result"

    first, second = rank0["first"], rank0["second"]
    assert (first["from_cache"], second["from_cache"]) == (False, True)
    # measured floats reproduced exactly: the second run read the files instead of measuring
    assert second["cluster"] == first["cluster"] and second["devices"] == first["devices"]
    assert second["links"] == first["links"]

    cluster = first["cluster"]
    devices = first["devices"]
    (node,) = cluster["nodes"]
    assert node["name"] == socket.gethostname()
    assert [d["name"] for d in node["devices"]] == ["rank0", "rank1"]
    for spec, measured, snapped in zip(node["devices"], devices, first["snapped"]):
        assert spec["type"] == "CPU" and spec["efficiency"] == 1.0
        # the cluster carries the snapped figure; the raw one is the median of the rank's 3 rounds (all its best)
        assert spec["tflops"] == {"fp32": snapped["tflops"]} and measured["tflops"] > 0
        assert len(measured["tflops_rounds"]) == 3 and measured["tflops"] == best_rounds_figure(measured["tflops_rounds"])
        assert spec["memory_gb"] == measured["memory_gb"] == pytest.approx(HOST_GIB / 2)
    raw_devices = tuple(DeviceMeasurement.from_dict(d) for d in devices)
    assert first["snapped"] == [s.to_dict() for s in snap_like_devices(raw_devices)]

    links = first["links"]
    assert (links["backend"], links["world_size"]) == ("gloo", 2)
    assert [t["size_bytes"] for t in links["allreduce"]] == list(SIZES)
    for t in links["allreduce"]:
        assert t["algbw_gbs"] == pytest.approx(t["size_bytes"] / t["seconds"] / 1e9)
        assert t["busbw_gbs"] == pytest.approx(t["algbw_gbs"])  # 2 (n-1)/n = 1 for two ranks
    assert sorted((t["src"], t["dst"], t["size_bytes"]) for t in links["p2p"]) == \
        sorted((s, 1 - s, size) for s in (0, 1) for size in SIZES)
    largest = [t["gbs"] for t in links["p2p"] if t["size_bytes"] == max(SIZES)]
    assert node["intra_bandwidth_gbs"] == min(largest) == cluster["inter_node_bandwidth_gbs"]

    # rank 0's device file was corrupt: a warning, and both ranks measured again (links still cached)
    assert any("unreadable" in w and "measuring again" in w for w in warned)
    corrupt = rank0["corrupt"]
    assert corrupt["from_cache"] is False and corrupt["links"] == first["links"]
    assert corrupt["devices"] != first["devices"]
    assert rank0["refresh"]["from_cache"] is False and rank0["refresh"]["links"] != first["links"]

    assert (first["cached"], second["cached"], corrupt["cached"]) == ([], ["devices", "links"], ["links"])
    assert rank0["table"].startswith("Probed cluster `auto` (cached; gloo, 2 ranks)")
    note = rank0["table"].splitlines()[-1]
    assert note.startswith("using measurements cached ") and " s ago (" in note
    assert f"at {tmp_path / 'cache'}; probe=\"refresh\"" in note
    files = sorted(p.name.split("-")[0] for p in (tmp_path / "cache").iterdir())
    assert files == ["device", "device", "links"]
    # a device file holds the raw rounds, when it was written and the snapped figures the rank was given
    raw = json.loads(next((tmp_path / "cache").glob("device-*cpu1of2*.json")).read_text())
    assert raw["format"] == probe_cache.CACHE_FORMAT and raw["written_at"] > 0
    assert len(raw["measurement"]["tflops_rounds"]) == 3 and set(raw["snapped"]) == {"tflops", "memory_bandwidth_gbs"}


def test_probed_latency_is_the_alpha_of_an_alpha_beta_fit_over_the_measured_sizes():
    alpha, beta = 50e-6, 2e9
    p2p = tuple(P2PTiming(src, 1 - src, size, alpha + size / beta, size / (alpha + size / beta) / 1e9)
                for src in (0, 1) for size in (64 * 2**10, 2**20, 8 * 2**20))
    links = LinkMeasurement(backend="gloo", world_size=2,
                            allreduce=(AllreduceTiming(8 * 2**20, 0.01, 0.8, 0.8),), p2p=p2p)
    assert links.latency_us() == pytest.approx(50.0)
    cluster = cluster_from_measurements([_device("a"), _device("b")], links)
    assert cluster.latency_us == pytest.approx(50.0)


# -- robust figures: best of rounds, snapping like devices, the cache's age -----------------------------
def test_measure_device_keeps_every_round_and_reports_the_best_three(monkeypatch):
    turns = []

    def in_turn(round_):
        turns.append(1)
        return round_()

    m = measure_device("cpu", budget_s=0.02, matmul_size=64, rounds=4, in_turn=in_turn)
    assert len(turns) == 2 * (4 + 1)  # one sizing turn and 4 rounds per figure, the same count on every rank
    assert len(m.tflops_rounds) == 4 == len(m.memory_bandwidth_rounds_gbs)
    assert m.tflops == sorted(m.tflops_rounds)[2]  # the median of the best three of four: the second best
    assert m.memory_bandwidth_gbs == best_rounds_figure(m.memory_bandwidth_rounds_gbs)
    assert m.tflops_noise == pytest.approx(peak_noise(m.tflops_rounds))


def test_a_cpu_round_leaves_out_the_time_its_thread_waited_for_a_core(monkeypatch):
    # a stand-in wall clock and schedstat: the round runs 30 ms of wall time, 20 ms of it waiting in the run queue
    now = {"wall_s": 100.0, "waited_s": 5.0}

    def round_with_a_wait() -> None:
        now["wall_s"] += 0.030
        now["waited_s"] += 0.020

    monkeypatch.setattr(device_probe, "time", SimpleNamespace(perf_counter=lambda: now["wall_s"]))
    monkeypatch.setattr(device_probe, "_runqueue_wait_s", lambda: now["waited_s"])
    clock = device_probe.round_clock(torch.device("cpu"))
    assert clock(round_with_a_wait) == pytest.approx(0.010)  # 10 ms on the core, not the 30 ms of the wall clock
    wall = device_probe.round_clock(torch.device("meta"))  # not a CPU: the wall clock
    assert wall(round_with_a_wait) == pytest.approx(0.030)


def test_a_figure_is_the_median_of_the_best_three_rounds_and_its_noise_how_far_the_median_falls_short():
    rounds = [0.5, 1.3, 0.9, 1.0, 0.6, 0.95, 0.4]  # one lucky round (1.3) does not set the figure
    assert best_rounds_figure(rounds) == 1.0 and best_rounds_figure([0.7, 0.8]) == pytest.approx(0.75)
    assert peak_noise(rounds) == pytest.approx((1.0 - 0.9) / 1.0)
    assert peak_noise([1.0]) == 0.0


def test_like_devices_within_ten_percent_are_snapped_to_their_median():
    devices = [_device("a", 1.00), _device("a", 1.06), _device("a", 1.09), _device("b", 2.0)]
    snapped = snap_like_devices(devices)
    assert [s.tflops for s in snapped] == [1.06, 1.06, 1.06, 2.0]
    assert [s.memory_bandwidth_gbs for s in snapped] == [20.0] * 4
    cluster = cluster_from_measurements(devices, _links({(0, 1): 1.0, (1, 2): 1.0, (2, 3): 1.0, (3, 0): 1.0}, 4),
                                        snapped=snapped)
    assert [d.tflops["fp32"] for d in cluster.devices] == [1.06, 1.06, 1.06, 2.0]


def test_a_real_difference_is_kept_unless_the_rounds_cannot_tell_it():
    tight = [_device("a", rounds=(1.0, 0.99, 0.995)), _device("a", rounds=(0.8, 0.79, 0.795))]
    assert [s.tflops for s in snap_like_devices(tight)] == [0.995, 0.795]  # a GPU throttled to 80% stays 80%
    noisy = [_device("a", rounds=(1.0,) * 3 + (0.9,) * 4), _device("a", rounds=(0.87,) * 3 + (0.8,) * 4)]
    assert len({s.tflops for s in snap_like_devices(noisy)}) == 1  # 15% apart, noise 10% + 8%: noise
    wild = [_device("a", rounds=(1.0, 1.0, 1.0, 0.1, 0.2)), _device("a", rounds=(0.5, 0.5, 0.5, 0.1, 0.2))]
    assert [s.tflops for s in snap_like_devices(wild)] == [1.0, 0.5]  # noise counts up to 25%: 2x is real


def test_snapping_never_mixes_device_types_and_can_be_turned_off():
    devices = [_device("a", 1.0, type_="A100-40"), _device("a", 1.02, type_="A100-80")]
    assert [s.tflops for s in snap_like_devices(devices)] == [1.0, 1.02]
    same = [_device("a", 1.0), _device("a", 1.02)]
    assert [s.tflops for s in snap_like_devices(same, tolerance=0)] == [1.0, 1.02]
    with pytest.raises(ConfigError, match="`snap_tolerance` is 1.5"):
        snap_like_devices(same, tolerance=1.5)


def test_table_shows_raw_and_snapped_figures_and_the_cache_age(monkeypatch):
    devices = (_device("a", rounds=(1.1, 1.0, 0.9)), _device("a", rounds=(1.1, 1.05, 1.0)))
    links = _links({(0, 1): 2.0, (1, 0): 2.5}, world=2)
    snapped = snap_like_devices(devices)
    written = time.time() - 3 * 3600
    result = ProbeResult(cluster_from_measurements(devices, links, snapped=snapped), devices, links,
                         from_cache=True, snapped=snapped, cached=("devices", "links"), cached_at=written,
                         cache_dir="/some/cache")
    rows = [line.split() for line in result.table().splitlines()[3:5]]
    assert [r[4:7] for r in rows] == [["1", "0%", "1.02"], ["1.05", "0%", "1.02"]]
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(written))
    assert result.cache_note() == (f"using measurements cached 3 h ago ({stamp}) at /some/cache; "
                                   'probe="refresh" (probe_cluster(refresh=True)) to measure again')
    assert result.table().endswith(result.cache_note())
    fresh = ProbeResult(result.cluster, devices, links, from_cache=False, snapped=snapped)
    assert fresh.cache_note() is None and "cached" not in fresh.table()


def test_cache_age_reads_in_the_unit_that_fits():
    now = 1_000_000.0
    assert probe_cache.cache_age(now - 5, now).startswith("5 s ago (")
    assert probe_cache.cache_age(now - 600, now).startswith("10 min ago (")
    assert probe_cache.cache_age(now - 3 * 86400, now).startswith("3 days ago (")


def test_cache_files_of_the_old_format_are_measured_anew(tmp_path):
    path = tmp_path / "device.json"
    path.write_text(json.dumps({"format": 1, "measurement": _device("a").to_dict()}))
    assert probe_cache.read_cache(path, DeviceMeasurement.from_dict) is None
    probe_cache.write_cache(path, _device("a"), notes={"snapped": SnappedFigures(1.0, 20.0).to_dict()})
    entry = probe_cache.read_cache(path, DeviceMeasurement.from_dict)
    assert entry.measurement == _device("a") and time.time() - entry.written_at < 60
