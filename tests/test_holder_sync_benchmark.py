"""benchmarks/holder_sync_two_node.py's premises, planning only (no namespaces, no ranks): its sync plans are the
unaligned shapes it claims and are priced by holder sets, and on its cluster the planner's pick is unaligned and
predicted faster than every aligned candidate."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import holder_sync_two_node as bench  # noqa: E402

from het_strategy.core.cluster import load_cluster  # noqa: E402
from het_strategy.core.cost_model import CostModel  # noqa: E402
from het_strategy.core.workload import TransformerConfig, transformer_workload  # noqa: E402
from het_strategy.planning import search_plan  # noqa: E402


def _setup() -> tuple:
    workload = transformer_workload(TransformerConfig(name="char_gpt", **bench.MODEL), dtype="fp32")
    settings = bench._settings(32, 4)
    cluster = load_cluster(bench.cluster_dict(200.0, 0.5, 113.0, 1.28))
    base = search_plan(cluster, workload, settings, mode="pipeline")
    return workload, settings, cluster, base, CostModel(cluster, workload, settings)


def test_the_sync_plans_are_unaligned_and_priced_by_holder_sets() -> None:
    workload, _, _, base, cm = _setup()
    plans = bench.sync_plans(base, workload.num_layers, 32, 4)
    tp, bounds = plans["tp"], plans["bounds"]
    assert [st.tp for st in tp.pipelines[0].stages] == [1, 1] and [st.tp for st in tp.pipelines[1].stages] == [2]
    assert tp.pipelines[0].boundaries() != tp.pipelines[1].boundaries()
    assert [st.tp for p in bounds.pipelines for st in p.stages] == [1, 1, 1, 1]
    assert bounds.pipelines[0].boundaries()[1] != bounds.pipelines[1].boundaries()[1]
    for plan in plans.values():
        assert not bench.is_aligned(plan)
        assert cm.syncs_by_holder_sets(plan)
        sched = cm.holder_sync_schedule(plan)
        nodes = {d.name: d.node for d in cm.cluster.devices}
        assert all({nodes[m] for m in r.members} == {"A", "B"} for r in sched.reductions)  # every set crosses
        assert sched.sync_s > 0.1  # the link dominates (about 5 MB of gradients at 187 Mbit/s)
    # a tp-1 rank of `tp` holds both units of its layers: two sets, one per tp rank of the tp-2 replica, and the
    # set of its layers' replicated parameters with both ranks of the tp-2 replica
    sets_of_a0 = [r.members for r in cm.holder_sync_schedule(tp).reductions if "a0" in r.members]
    assert sorted(sets_of_a0) == [("a0", "b0"), ("a0", "b0", "b1"), ("a0", "b1")]


def test_the_pick_is_unaligned_and_predicted_faster_than_every_aligned_candidate() -> None:
    workload, settings, cluster, base, cm = _setup()
    pick = search_plan(cluster, workload, settings, mode="hybrid")
    assert not bench.is_aligned(pick) and cm.syncs_by_holder_sets(pick)
    aligned = [p for p in bench.aligned_candidates(base, workload.num_layers, 32, 4) if bench.is_aligned(p)]
    best = min(s.step_time_s for s in map(cm.score, aligned) if s.fits)
    assert cm.score(pick).step_time_s < best
