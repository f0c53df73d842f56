"""The low-communication planner (planning/low_communication.py) and its pricing (core/outer_sync_cost.py):
the choice of H and codec against brute force, the inner split, the plan JSON, the errors, and het-plan's
``planner.mode=low_communication`` report."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from het_strategy.cli.plan_cli import main
from het_strategy.core.cluster import cluster_from_dict
from het_strategy.core.codecs import CodecParams, packed_bytes
from het_strategy.core.cost_model import CostModel
from het_strategy.core.errors import ConfigError
from het_strategy.core.outer_sync_cost import OuterSyncCost, outer_payload_bytes
from het_strategy.core.plan import Plan
from het_strategy.core.runtime_rules import runtime_problems
from het_strategy.core.train_settings import TrainSettings
from het_strategy.planning import PlanRequest, plan
from het_strategy.planning.low_communication import OuterSyncBudget, plan_low_communication, sync_overhead
from tests._planning_cases import device, small_workload


def _cluster(link_gbs: float, speeds: tuple[tuple[float, ...], ...] = ((50, 50), (20, 20)),
             name: str = "nodes") -> dict:
    return {"name": name, "inter_node_bandwidth_gbs": link_gbs, "nodes": [
        {"name": f"n{i}", "intra_bandwidth_gbs": 100, "devices": [device(f"n{i}d{j}", s) for j, s in enumerate(node)]}
        for i, node in enumerate(speeds)]}


def _settings(batch: int = 24) -> TrainSettings:
    return TrainSettings(global_batch_size=batch, micro_batch_sizes=(1, 2, 4))


def _brute_force(inner_s: float, exchange: dict[str, float], budget: OuterSyncBudget, batch: int,
                 inner_steps: int | None = None, codec: str | None = None) -> tuple[int, str]:
    """Every H in 1..max_inner_steps (or the pinned H) x every allowed codec (or the pinned one)."""
    codecs = [codec] if codec is not None else list(budget.codecs)
    steps = [inner_steps] if inner_steps is not None else range(1, budget.max_inner_steps + 1)
    within = [(h, i, c) for i, c in enumerate(codecs) for h in steps
              if exchange[c] / (h * inner_s + exchange[c]) <= budget.max_sync_overhead]
    if within:
        h, _, c = min(within)
        return h, c
    h = inner_steps if inner_steps is not None else budget.max_inner_steps
    return h, min(codecs, key=lambda c: ((h * inner_s + exchange[c]) / (h * batch), codecs.index(c)))


_CASES = [
    pytest.param(_cluster(0.00125), _settings(24), OuterSyncBudget(max_inner_steps=300), {}, id="10mbit-infeasible"),
    pytest.param(_cluster(0.00125), _settings(24), OuterSyncBudget(max_inner_steps=60, max_sync_overhead=0.9), {},
                 id="10mbit-loose-budget"),
    pytest.param(_cluster(1.0, ((50, 20), (30,), (10, 10))), _settings(30), OuterSyncBudget(max_inner_steps=200), {},
                 id="3-groups-1GBs"),
    pytest.param(_cluster(0.05, ((40,), (40,), (40,))), _settings(12),
                 OuterSyncBudget(max_inner_steps=400, max_sync_overhead=0.2, codecs=("q4", "fp16", "none")), {},
                 id="3-groups-codecs-reordered"),
    pytest.param(_cluster(25.0), _settings(24), OuterSyncBudget(max_inner_steps=100, codecs=("none", "bf16", "q8")),
                 {}, id="fast-link"),
    pytest.param(_cluster(0.01), _settings(24), OuterSyncBudget(max_inner_steps=300), {"inner_steps": 40},
                 id="pinned-H"),
    pytest.param(_cluster(0.01), _settings(24), OuterSyncBudget(max_inner_steps=300, max_sync_overhead=0.5),
                 {"codec": "fp16"}, id="pinned-codec"),
    pytest.param(_cluster(0.01), _settings(24), OuterSyncBudget(max_inner_steps=300), {"codec": "q2"},
                 id="pinned-codec-infeasible"),
    pytest.param(_cluster(0.01), _settings(24), OuterSyncBudget(), {"inner_steps": 7, "codec": "q8"},
                 id="both-pinned"),
    pytest.param(_cluster(0.2, ((50, 20), (30, 30))), _settings(24),
                 OuterSyncBudget(max_inner_steps=100, groups="device", split="even"), {}, id="device-groups-even"),
]


@pytest.mark.parametrize("raw, settings, budget, pinned", _CASES)
def test_the_choice_equals_brute_force_over_h_and_codecs(raw, settings, budget, pinned) -> None:
    cluster, workload = cluster_from_dict(raw), small_workload()
    result = plan_low_communication(cluster, workload, settings, budget, **pinned)
    sync, fig = result.plan.outer_sync, result.plan.predicted
    assert sync is not None
    cost = OuterSyncCost(CostModel(cluster, workload, settings), sync.groups)  # the same pricing, built anew
    shares = {p.stages[0].devices[0]: p.samples for p in result.plan.pipelines}
    inner = cost.inner_step_s(shares)
    codecs = set(budget.codecs) | ({pinned["codec"]} if "codec" in pinned else set())
    exchange = {c: cost.exchange(c).total_s for c in codecs}
    expected = _brute_force(inner, exchange, budget, settings.global_batch_size, **pinned)
    assert (sync.inner_steps, str(sync.codec)) == expected
    assert fig["inner_step_s"] == pytest.approx(inner) and fig["exchange_s"] == pytest.approx(exchange[expected[1]])
    assert fig["round_s"] == pytest.approx(sync.inner_steps * inner + exchange[expected[1]])
    assert fig["step_time_s"] == pytest.approx(fig["round_s"] / sync.inner_steps)
    assert fig["samples_per_s"] == pytest.approx(settings.global_batch_size / fig["step_time_s"])
    assert fig["sync_overhead"] == pytest.approx(sync_overhead(exchange[expected[1]], inner, sync.inner_steps))
    assert fig["bytes_per_sample"] == pytest.approx(
        fig["exchange_bytes_per_round"] / (sync.inner_steps * settings.global_batch_size))
    feasible = {str(c.codec): c.feasible for c in result.candidates}
    if "codec" not in pinned and "inner_steps" not in pinned:
        assert feasible == {c: exchange[c] / (budget.max_inner_steps * inner + exchange[c])
                            <= budget.max_sync_overhead for c in budget.codecs}


def test_the_infeasible_case_falls_back_to_the_largest_h_and_the_cheapest_codec() -> None:
    cluster = cluster_from_dict(_cluster(0.00125))
    result = plan_low_communication(cluster, small_workload(), _settings(), OuterSyncBudget(max_inner_steps=50))
    assert not any(c.feasible for c in result.candidates)
    assert result.plan.outer_sync.inner_steps == 50 and result.plan.outer_sync.codec == "q4"
    assert result.plan.predicted["sync_overhead"] > 0.05


def test_the_exchange_is_priced_as_the_leaders_allgather_of_the_payload() -> None:
    """Two groups over a 10 Mbit/s link: each leader sends its one payload across; q4 pads to whole buckets."""
    cluster, workload, settings = cluster_from_dict(_cluster(0.00125)), small_workload(), _settings()
    cost = OuterSyncCost(CostModel(cluster, workload, settings), (("n0d0", "n0d1"), ("n1d0", "n1d1")))
    p = workload.total_params
    assert outer_payload_bytes("q4", p) == packed_bytes(math.ceil(p / 256) * 256, 4, CodecParams())
    assert outer_payload_bytes("none", p) == 4 * p and outer_payload_bytes("bf16", p) == 2 * p
    q4 = cost.exchange("q4")
    assert q4.allgather_s == pytest.approx(1e-5 + q4.payload_bytes / 0.00125e9)
    assert q4.inter_node_bytes == 2 * q4.payload_bytes  # one payload each way
    assert cost.exchange("none").encode_s == 0 and q4.encode_s > 0


def _spread(cost: OuterSyncCost, shares: dict[str, int]) -> float:
    times = [cost.device_step_s(d, b) for d, b in shares.items()]
    return max(times) - min(times)


def test_the_planned_split_balances_the_devices_better_than_even() -> None:
    cluster = cluster_from_dict(_cluster(0.01, ((80, 40), (20, 10))))
    planned = plan_low_communication(cluster, small_workload(), _settings(48), OuterSyncBudget())
    even = plan_low_communication(cluster, small_workload(), _settings(48), OuterSyncBudget(split="even"))
    shares = {p.stages[0].devices[0]: p.samples for p in planned.plan.pipelines}
    even_shares = {p.stages[0].devices[0]: p.samples for p in even.plan.pipelines}
    assert set(even_shares.values()) == {12} and shares["n0d0"] > shares["n0d1"] > shares["n1d0"] > shares["n1d1"]
    assert _spread(planned.cost, shares) < _spread(planned.cost, even_shares) / 3
    assert planned.plan.predicted["inner_step_s"] < 0.5 * even.plan.predicted["inner_step_s"]
    assert planned.even_inner_step_s == pytest.approx(even.plan.predicted["inner_step_s"])


def test_the_planned_split_is_the_brute_force_min_max_on_a_tiny_case() -> None:
    cluster = cluster_from_dict(_cluster(0.1, ((50, 20), (30,))))
    settings = _settings(9)
    result = plan_low_communication(cluster, small_workload(), settings, OuterSyncBudget())
    cost, names = result.cost, [d.name for d in cluster.devices]
    best = min(max(cost.device_step_s(d, b) for d, b in zip(names, split))
               for split in itertools.product(range(1, 10), repeat=3) if sum(split) == 9)
    assert result.plan.predicted["inner_step_s"] == pytest.approx(best, rel=1e-9)


def test_the_plan_json_round_trips_with_outer_sync(tmp_path: Path) -> None:
    cluster = cluster_from_dict(_cluster(0.00125))
    made = plan_low_communication(cluster, small_workload(), _settings(), OuterSyncBudget()).plan
    again = Plan.from_dict(made.to_dict())
    assert again == made and again.outer_sync == made.outer_sync and again.mode == "low_communication"
    assert made.to_dict()["outer_sync"] == {"inner_steps": made.outer_sync.inner_steps,
                                           "codec": str(made.outer_sync.codec),
                                           "groups": [["n0d0", "n0d1"], ["n1d0", "n1d1"]]}
    assert Plan.load(made.save(tmp_path / "p.json")) == made
    assert runtime_problems(made, "hetero_diloco") == [] and runtime_problems(made, "hetero")
    assert not made.idle_reasons and set(made.used_devices) == {d.name for d in cluster.devices}


@pytest.mark.parametrize("build, field", [
    (lambda c: plan_low_communication(c, small_workload(), _settings(), inner_steps=0), "plan.outer_sync.inner_steps"),
    (lambda c: plan_low_communication(c, small_workload(), _settings(), codec="topk"), "plan.outer_sync.codec"),
    (lambda c: plan_low_communication(c, small_workload(), _settings(), codec="powersgd"), "plan.outer_sync.codec"),
    (lambda c: OuterSyncBudget(max_inner_steps=0), "planner.outer_sync.max_inner_steps"),
    (lambda c: OuterSyncBudget(max_sync_overhead=1.0), "planner.outer_sync.max_sync_overhead"),
    (lambda c: OuterSyncBudget(max_sync_overhead=0), "planner.outer_sync.max_sync_overhead"),
    (lambda c: OuterSyncBudget(codecs=("q4", "topk")), "planner.outer_sync.codecs[1]"),
    (lambda c: OuterSyncBudget(codecs=("powersgd",)), "planner.outer_sync.codecs[0]"),
    (lambda c: OuterSyncBudget(codecs=()), "planner.outer_sync.codecs"),
    (lambda c: OuterSyncBudget(split="random"), "planner.outer_sync.split"),
    (lambda c: OuterSyncBudget(groups="rack"), "planner.outer_sync.groups"),
    (lambda c: OuterSyncBudget(groups=[["n0d0"], ["n0d0", "n1d0"]]), "planner.outer_sync.groups"),
    (lambda c: plan_low_communication(c, small_workload(), _settings(), OuterSyncBudget(
        groups=[["n0d0", "n0d1"], ["n1d0"]])), "planner.outer_sync.groups"),
    (lambda c: plan_low_communication(c, small_workload(), _settings(), OuterSyncBudget(
        groups=[["n0d0", "n0d1"], ["n1d0", "n1d1", "x9"]])), "planner.outer_sync.groups"),
    (lambda c: plan_low_communication(c, small_workload(), _settings(), OuterSyncBudget(
        groups=[["n0d0", "n0d1", "n1d0", "n1d1"]])), "planner.outer_sync.groups"),
    (lambda c: plan_low_communication(cluster_from_dict(_cluster(1, ((50, 50),))), small_workload(), _settings()),
     "planner.outer_sync.groups"),
    (lambda c: plan_low_communication(c, small_workload(), _settings(3)), "settings.global_batch_size"),
    (lambda c: PlanRequest(mode="dp", runtime="hetero_diloco"), "planner.runtime"),
    (lambda c: PlanRequest(mode="low_communication", runtime="hetero"), "planner.mode"),
    (lambda c: PlanRequest(mode="low_communication", objective="cost"), "planner.objective"),
    (lambda c: PlanRequest(outer_sync={"max_inner_step": 3}), "planner.outer_sync.max_inner_step"),
])
def test_bad_input_names_the_field(build, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(cluster_from_dict(_cluster(0.00125)))
    assert info.value.field == field and f"`{field}`" in str(info.value)


def test_the_request_reads_hetero_diloco_as_low_communication() -> None:
    assert PlanRequest(runtime="hetero_diloco").mode == "low_communication"
    assert PlanRequest(mode="low_communication", outer_sync={"max_inner_steps": 7}).outer_sync.max_inner_steps == 7
    result = plan(cluster_from_dict(_cluster(0.00125)), small_workload(), _settings(),
                  PlanRequest(runtime="hetero_diloco"))
    assert result.plan.outer_sync is not None and result.joint is not None and result.low_communication is not None
    assert result.summary().startswith("recommendation: ") and "low_communication (hetero_diloco, H=" in \
        result.summary()
    assert result.plan.predicted["step_time_s"] == pytest.approx(result.score.step_time_s)


def _write(tmp_path: Path, link_gbs: float, nodes: int = 2) -> Path:
    kinds = ["A100-80GB", "A100-40GB"]
    body = "".join(f"  - name: n{i}\n    intra_bandwidth_gbs: 300\n    devices:\n"
                   f"      - {{type: {kinds[i % 2]}, count: 2}}\n" for i in range(nodes))
    path = tmp_path / f"c{nodes}_{link_gbs:g}.yaml"
    path.write_text(f"name: c{nodes}\ninter_node_bandwidth_gbs: {link_gbs}\nnodes:\n{body}")
    return path


def test_het_plan_recommends_low_communication_behind_a_10_mbit_link(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = main([f"cluster={_write(tmp_path, 0.00125)}", "model=gpt_small", "planner.mode=low_communication",
                 "settings.global_batch_size=256", "planner.outer_sync.codecs=[q8,q4]"])
    out = capsys.readouterr().out
    assert code == 0
    assert "synchronous (joint compression)" in out and "candidates" in out and "H_c" in out
    assert "recommendation: low_communication (hetero_diloco, H=500, q4): predicted" in out
    written = Plan.load(tmp_path / "plan.json")
    assert written.mode == "low_communication" and written.outer_sync.codec == "q4"
    assert written.outer_sync.groups == (("n0/0", "n0/1"), ("n1/0", "n1/1"))


@pytest.mark.parametrize("nodes, link_gbs, overrides", [
    (1, 10, ["planner.outer_sync.groups=device"]),  # one fast node, one group per device
    (2, 300, ["planner.runtime=hetero_diloco", "planner.outer_sync.split=even"]),  # links as fast as NVLink
], ids=["one-node", "fast-links"])
def test_het_plan_recommends_the_synchronous_plan_on_fast_links(nodes: int, link_gbs: float, overrides, tmp_path: Path,
                                                                capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = main([f"cluster={_write(tmp_path, link_gbs, nodes=nodes)}", "model=gpt_small", "output.plan=null",
                 *overrides] + ([] if "planner.runtime=hetero_diloco" in overrides else
                                ["planner.mode=low_communication"]))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "recommendation: the synchronous plan (none between nodes): predicted" in out


def test_a_small_predicted_gain_does_not_win_the_recommendation(tmp_path: Path, capsys, monkeypatch) -> None:
    """Two nodes at 25 GB/s: low_communication is predicted a few percent faster per sample (H of a few steps
    amortises one sync), below min_speedup 1.2, so the synchronous plan is recommended; min_speedup 1 takes it."""
    monkeypatch.chdir(tmp_path)
    cluster = f"cluster={_write(tmp_path, 25)}"
    assert main([cluster, "model=gpt_small", "planner.mode=low_communication", "output.plan=null"]) == 0
    out = capsys.readouterr().out
    assert "recommendation: the synchronous plan (q4 between nodes): low_communication" in out
    assert "below planner.outer_sync.min_speedup=1.2" in out
    assert main([cluster, "model=gpt_small", "planner.mode=low_communication", "output.plan=null",
                 "planner.outer_sync.min_speedup=1"]) == 0
    assert "recommendation: low_communication (hetero_diloco" in capsys.readouterr().out


@pytest.mark.parametrize("override, expected", [
    ("planner.outer_sync.min_speedup=0.5", "`planner.outer_sync.min_speedup` is 0.5"),
    ("planner.outer_sync.max_sync_overhead=2", "`planner.outer_sync.max_sync_overhead` is 2"),
    ("planner.outer_sync.codecs=[q4,topk]", "`planner.outer_sync.codecs[1]` is 'topk'"),
    ("planner.outer_sync.groups=rack", "`planner.outer_sync.groups` is 'rack'"),
    ("planner.outer_sync.max_inner_steps=0", "`planner.outer_sync.max_inner_steps` is 0"),
    ("planner.runtime=hetero", "`planner.mode` is 'low_communication'"),
    ("output.ds_config=true", "`output.ds_config` is True"),
])
def test_het_plan_refuses_a_bad_budget_in_one_line(override: str, expected: str, tmp_path: Path, capsys,
                                                   monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = main([f"cluster={_write(tmp_path, 0.00125)}", "model=tiny_gpt", "planner.mode=low_communication", override])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("het-plan: error: ") and err.count("\n") == 1, err
    assert expected in err
    assert not (tmp_path / "plan.json").exists()


def test_a_device_that_cannot_hold_a_replica_is_named() -> None:
    raw = _cluster(0.01)
    raw["nodes"][1]["devices"][1] = device("n1d1", 20, memory_gb=0.5)
    with pytest.raises(ConfigError, match="none fits n1d1") as info:
        plan_low_communication(cluster_from_dict(raw), small_workload(), _settings(), OuterSyncBudget())
    assert info.value.field == "settings.micro_batch_sizes"


def test_planned_groups_merge_nodes_along_their_fastest_links_and_keep_the_fastest_split() -> None:
    """Three nodes, a and b joined at 10 GB/s, c behind 10 Mbit/s: the candidates are per node, a+b | c, and per
    device; the planned split is the candidate of the least predicted time per step, here a+b | c."""
    from het_strategy.core.cluster import load_cluster
    from het_strategy.core.train_settings import TrainSettings
    from het_strategy.core.workload import load_workload
    from het_strategy.planning.low_communication import OuterSyncBudget, candidate_splits, plan_low_communication

    cluster = load_cluster({"name": "three_sites", "inter_node_bandwidth_gbs": 10, "links": [
        {"nodes": ["a", "c"], "bandwidth_gbs": 0.00125}, {"nodes": ["b", "c"], "bandwidth_gbs": 0.00125}],
        "nodes": [{"name": n, "devices": [{"type": t, "count": 2}]}
                  for n, t in (("a", "A100-40GB"), ("b", "V100-16GB"), ("c", "T4"))]})
    splits = candidate_splits(cluster)
    assert [len(s) for s in splits] == [3, 2, 6]
    assert splits[1] == (("a/0", "a/1", "b/0", "b/1"), ("c/0", "c/1"))
    workload, settings = load_workload("gpt_small"), TrainSettings(global_batch_size=256, dtype="bf16")
    chosen = plan_low_communication(cluster, workload, settings, OuterSyncBudget(groups="planned"))
    each = {split: plan_low_communication(cluster, workload, settings, OuterSyncBudget(groups=split)).plan
            for split in splits}
    best = min(each, key=lambda s: (each[s].predicted["step_time_s"], len(s)))
    assert chosen.plan.outer_sync.groups == best == splits[1]
    assert [t for _, t in chosen.splits] == pytest.approx([each[s].predicted["step_time_s"] for s in splits])


def test_the_outer_state_counts_against_a_devices_memory() -> None:
    """A device that holds a replica but not the outer loop's fp32 outer parameters, momentum and residual
    (``OUTER_STATE_BYTES`` per parameter) takes no micro-batch; with room for both it does, and the plan's
    memory figure includes the outer state."""
    from het_strategy.core.cluster import load_cluster
    from het_strategy.core.cost_model import CostModel
    from het_strategy.core.outer_sync_cost import OUTER_STATE_BYTES, OuterSyncCost
    from het_strategy.core.train_settings import TrainSettings
    from het_strategy.core.workload import load_workload
    from het_strategy.planning.low_communication import OuterSyncBudget, plan_low_communication

    workload = load_workload("tiny_gpt")
    settings = TrainSettings(global_batch_size=4, dtype="fp32", micro_batch_sizes=(1,))

    def cluster(memory_gb: float):  # type: ignore[no-untyped-def]
        return load_cluster({"name": "two", "inter_node_bandwidth_gbs": 0.00125, "nodes": [
            {"name": n, "devices": [{"name": f"{n}0", "type": "CPU", "tflops": {"fp32": 1.0},
                                     "memory_gb": memory_gb}]} for n in ("a", "b")]})

    probe = CostModel(cluster(100.0), workload, settings)
    replica = probe.stage_memory_bytes(0, workload.num_layers, 1, 1, 1, 1)
    outer = OUTER_STATE_BYTES * workload.total_params
    per_gb = probe.memory_capacity_bytes(probe.cluster.devices[0]) / 100.0
    tight = cluster((replica + outer / 2) / per_gb)
    assert probe.memory_budget_bytes(probe.cluster.devices[0], 1) >= replica  # CPU: no framework overhead
    assert OuterSyncCost(CostModel(tight, workload, settings), (("a0",), ("b0",))).micro_batch("a0", 1) is None
    with pytest.raises(ConfigError, match="settings.micro_batch_sizes"):
        plan_low_communication(tight, workload, settings, OuterSyncBudget())
    roomy = plan_low_communication(cluster((replica + 2 * outer) / per_gb), workload, settings, OuterSyncBudget())
    assert roomy.score.memory_bytes["a0"] == pytest.approx(replica + outer)
