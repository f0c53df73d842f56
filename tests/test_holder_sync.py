"""The sync of replicas that differ, priced by holder sets (``core/holder_sync.py``): by hand, against the runtime's
layout, against the stage rings where replicas are alike, and in the planner's choice."""

from __future__ import annotations

import pytest

from het_strategy.core.cluster import cluster_from_dict
from het_strategy.core.cost_model import CostModel
from het_strategy.core.errors import ConfigError
from het_strategy.core.holder_sync import holder_reductions, schedule
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import LayerCost, TransformerConfig, WorkloadSpec, transformer_workload
from het_strategy.ds_runtime.replicas import replica_layout

LATENCY_US = 20.0
INTER_GBS = 0.5
PARAMS = 1_000_000


def _cluster() -> object:
    """Two nodes of two devices; one flow alone gets the whole interface."""
    node = {"intra_bandwidth_gbs": 50.0, "inter_bandwidth_gbs": INTER_GBS}
    return cluster_from_dict({
        "name": "two", "inter_node_bandwidth_gbs": INTER_GBS, "latency_us": LATENCY_US,
        "nodes": [{"name": "a", **node, "devices": [{"type": "A100-40GB", "count": 2}]},
                  {"name": "b", **node, "devices": [{"type": "V100-16GB", "count": 2}]}]})


def _workload(layers: int = 4) -> WorkloadSpec:
    """Equal layers of ``PARAMS`` parameters each (no tied matrix)."""
    return WorkloadSpec("flat", tuple(LayerCost(f"block{i}", 1e9, PARAMS, 1e3, 1e3) for i in range(layers)), 64)


def _plan(cluster, workload: WorkloadSpec, pipelines: list[list[tuple[tuple[str, ...], tuple[int, int]]]]) -> Plan:
    pipes = tuple(Pipeline(stages=tuple(Stage(devs, layers) for devs, layers in stages), micro_batch_size=1,
                           samples=2) for stages in pipelines)
    return Plan(cluster=cluster.name, cluster_devices=tuple(d.name for d in cluster.devices),
                model=workload.fingerprint(), global_batch_size=2 * len(pipes), pipelines=pipes)


def _unlike(cluster, workload):
    """Replica 0: two tp-1 stages on node a; replica 1: one tp-2 stage on node b."""
    return _plan(cluster, workload, [[(("a/0",), (0, 2)), (("a/1",), (2, 4))], [(("b/0", "b/1"), (0, 4))]])


def test_two_unlike_families_by_hand():
    """Four sets of two, one per (layer half, unit); the shared order runs (a/0, b/0) alone, then (a/0, b/1)
    beside (a/1, b/0), sharing both interfaces, then (a/1, b/1) alone."""
    cluster, workload = _cluster(), _workload()
    plan = _unlike(cluster, workload)
    cm = CostModel(cluster, workload, TrainSettings(global_batch_size=4))
    assert cm.syncs_by_holder_sets(plan)
    sched = cm.holder_sync_schedule(plan)
    nbytes = 2 * PARAMS / 2 * 4  # two layers, half of each (unit of tp 2), fp32
    assert [(r.members, r.num_bytes, r.layers) for r in sched.reductions] == [
        (("a/0", "b/0"), nbytes, (0, 1)), (("a/0", "b/1"), nbytes, (0, 1)),
        (("a/1", "b/0"), nbytes, (2, 3)), (("a/1", "b/1"), nbytes, (2, 3))]
    alpha, bw = LATENCY_US * 1e-6, INTER_GBS * 1e9
    alone = 2 * alpha + 2 * (nbytes / 2) / bw  # ring of two: 2 steps of half the buffer
    shared = 2 * alpha + 2 * (nbytes / 2) / (bw / 2)  # two rings leave each node at once
    assert sched.start_s[0] == 0.0
    assert sched.end_s[0] == pytest.approx(alone)
    assert sched.start_s[1] == sched.start_s[2] == pytest.approx(alone)
    assert sched.end_s[1] == sched.end_s[2] == pytest.approx(alone + shared)
    assert sched.end_s[3] == pytest.approx(2 * alone + shared)
    assert sched.sync_s == pytest.approx(2 * alone + shared)
    assert sched.device_s["a/0"] == pytest.approx(alone + shared)
    score = cm.score(plan)
    assert score.sync_time_s == pytest.approx(2 * alone + shared)
    assert score.device_sync_s["a/1"] == pytest.approx(2 * alone + shared)


def test_the_sets_are_the_runtimes():
    """The model's sets, as ranks, are the runtime's holder sets (``replica_layout``) in the same order: the units'
    sets, and at tp > 1 the sets of each layer's replicated parameters (every rank holding it), with their bytes."""
    cluster = _cluster()
    replicated = 1000
    workload = WorkloadSpec("flat", tuple(LayerCost(f"block{i}", 1e9, PARAMS, 1e3, 1e3, tp_replicated_params=replicated)
                                          for i in range(4)), 64)
    plan = _plan(cluster, workload, [[(("a/0",), (0, 1)), (("a/1",), (1, 4))], [(("b/0", "b/1"), (0, 4))]])
    layout = replica_layout(plan)
    rank_of = {d: r for r, d in enumerate(("a/0", "a/1", "b/0", "b/1"))}
    reductions = holder_reductions(plan, workload, 4)
    model_sets = [tuple(rank_of[d] for d in r.members) for r in reductions]
    assert model_sets == list(layout.holder_sets)
    whole = {layout.layer_holders(layer) for layer in range(4)}
    for hs, r in zip(model_sets, reductions):
        layers = [layer for layer in range(4) if layout.layer_holders(layer) == hs]
        assert r.num_bytes == (4 * replicated * len(layers) if hs in whole
                               else 4 * (PARAMS - replicated) / 2 * len(r.layers))
    # without replicated parameters only the units' sets remain
    bare = _workload()
    units = sorted({layout.unit_holders(layer, u) for layer in range(4) for u in range(layout.units(layer))})
    assert [tuple(rank_of[d] for d in r.members) for r in holder_reductions(plan, bare, 4)] == units


def test_replicated_parameters_are_what_the_tensor_parallel_plan_leaves_whole():
    """``LayerCost.tp_replicated_params`` of CharGPT's workload counts exactly the parameters its layers'
    ``tensor_parallel_plan()`` does not split (a layer without one: all of them)."""
    from het_strategy.demo.char_gpt import CharGPT
    from het_strategy.tensor_parallel.tp_plan import tensor_parallel_plan_of

    model = CharGPT(num_layers=2, hidden_size=64, num_heads=4, seq_len=16)
    workload = transformer_workload(model.workload_config())
    for layer, spec in zip(model.pipeline_layers(), workload.layers, strict=True):
        tp_plan = tensor_parallel_plan_of(layer)
        split = set(tp_plan.shard_specs()) if tp_plan else set()
        whole = sum(p.numel() for name, p in layer.named_parameters() if name not in split)
        assert spec.tp_replicated_params == whole, spec.name


def test_alike_replicas_give_the_stage_rings():
    """Where replicas share boundaries and tp, the holder sets are the stages' rings, all at once: the schedule
    gives each device the closed form (``CostModel.stage_sync_s`` over its route) when the rings carry equal
    bytes."""
    cluster, workload = _cluster(), _workload()
    plan = _plan(cluster, workload, [[(("a/0",), (0, 2)), (("b/0",), (2, 4))], [(("a/1",), (0, 2)), (("b/1",), (2, 4))]])
    cm = CostModel(cluster, workload, TrainSettings(global_batch_size=4))
    assert not cm.syncs_by_holder_sets(plan)
    closed = cm.score(plan).device_sync_s
    sched = cm.holder_sync_schedule(plan)
    assert sched.device_s == pytest.approx(closed)


def test_tied_matrix_is_one_set_over_first_and_last_holders():
    cluster = _cluster()
    workload = transformer_workload(TransformerConfig("t", 2, 256, 4, 64, 1000, tie_embeddings=True))
    tied = workload.layers[-1].tied_params
    assert tied > 0
    last = workload.num_layers - 1
    plan = _plan(cluster, workload, [[(("a/0",), (0, 2)), (("a/1",), (2, workload.num_layers))],
                                     [(("b/0",), (0, 3)), (("b/1",), (3, workload.num_layers))]])
    reductions = holder_reductions(plan, workload, 4)
    tied_sets = [r for r in reductions if r.layers == (0, last) and len(r.members) == 4]
    assert len(tied_sets) == 1 and tied_sets[0].num_bytes == tied * 4
    dense = sum(r.num_bytes for r in reductions) / 4 - tied
    assert dense == pytest.approx(sum(layer.params for layer in workload.layers) - 2 * tied)


def test_sync_model_is_checked_and_stage_rings_turns_it_off():
    with pytest.raises(ConfigError, match="settings.sync_model"):
        TrainSettings(global_batch_size=4, sync_model="rings")
    cluster, workload = _cluster(), _workload()
    plan = _unlike(cluster, workload)
    cm = CostModel(cluster, workload, TrainSettings(global_batch_size=4, sync_model="stage_rings"))
    assert not cm.syncs_by_holder_sets(plan)


def test_schedule_of_no_sets_is_empty():
    cluster = _cluster()
    sched = schedule([], CostModel(cluster, _workload(), TrainSettings(global_batch_size=4)).network)
    assert sched.sync_s == 0.0 and sched.device_s == {}
