"""The hybrid search's machinery: bounds never exceed what assembly reaches, pruning loses nothing,
budgets are deterministic, and the vectorised DPs match the plain ones."""

from __future__ import annotations

import copy
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from het_strategy.core.cluster import cluster_from_dict
from het_strategy.core.cost_model import CostModel, pipeline_time_s
from het_strategy.core.plan_score import StageCost
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.shipped import config_file
from het_strategy.core.workload import TransformerConfig, load_workload, transformer_workload
from het_strategy.planning import exhaustive, families, search_plan
from het_strategy.planning import pipeline as pipeline_mod
from het_strategy.planning.bound_cache import BoundCache
from het_strategy.planning.bounds import curve_structure_bound, structure_bound
from het_strategy.planning.hybrid import _tp_options, device_classes
from het_strategy.planning.structure import assemble_plan, structure_routes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from plan_optimality import brute_force_plan, random_case  # noqa: E402


def _mixed_vendors_7() -> dict:
    """The shipped mixed_vendors with the first device entry's count removed: 1 MI250X, 4 A100, 2 L4."""
    raw = copy.deepcopy(yaml.safe_load(config_file("cluster", "mixed_vendors").read_text()))
    raw["name"] = "mixed_vendors_7"
    raw["nodes"][0]["devices"][0].pop("count")
    return raw


def _random_structure(rng: random.Random, names: list[str], max_pipes: int = 3, max_len: int = 3):
    pool = names[:]
    rng.shuffle(pool)
    struct = []
    for _ in range(rng.randint(1, max_pipes)):
        S = rng.randint(1, max_len)
        if len(pool) < S:
            break
        struct.append(tuple((pool.pop(),) for _ in range(S)))
    return struct


@pytest.mark.parametrize("seed", range(6))
def test_bounds_never_exceed_the_assembled_step(seed):
    """Route-free, routed and per-micro-batch bounds are <= assemble_plan's step (both in-flight modes), under the
    stage rings' price the bounds are of (``sync_model=stage_rings``; the default rescores replicas that differ by
    their holder sets after assembly, a price that couples the pipelines' splits)."""
    rng = random.Random(seed)
    cluster = cluster_from_dict(_mixed_vendors_7() if seed % 2 else {
        "name": "four", "inter_node_bandwidth_gbs": 12.5,
        "nodes": [{"name": "a", "devices": [{"type": "H100-SXM", "count": 2}, {"type": "T4", "count": 2}]},
                  {"name": "b", "devices": [{"type": "A100-40GB", "count": 2}, {"type": "V100-16GB", "count": 2}]}]})
    workload = load_workload(["gpt_small", "opt350"][seed % 2])
    settings = TrainSettings(global_batch_size=rng.choice([6, 16, 64]), zero_stage=rng.choice([0, 1, 3]),
                             micro_batch_sizes=(1, 2, 4), sync_model="stage_rings")
    cm = CostModel(cluster, workload, settings)
    names = [d.name for d in cluster.devices]
    B = settings.global_batch_size
    checked = 0
    for _ in range(12):
        struct = _random_structure(rng, names)
        dp = len(struct)
        routes = structure_routes(cm, struct)
        for fixed in (False, True):
            bc = BoundCache(cm, fixed_in_flight=fixed)
            descs = [[bc.slot(s) for s in slots] for slots in struct]
            floor = structure_bound([bc.floor(d, dp) for d in descs], B)
            full = structure_bound([bc.pipeline(d, dp, r) for d, r in zip(descs, routes)], B)
            sharp = curve_structure_bound([bc.refined(slots, dp, r) for slots, r in zip(struct, routes)], B)
            res = assemble_plan(cm, struct, "hybrid", exact_in_flight=not fixed)
            if res is None:
                continue
            checked += 1
            step = cm.score(res.plan).step_time_s
            assert floor <= full * (1 + 1e-9) and full <= step * (1 + 1e-9) and sharp <= step * (1 + 1e-9), \
                (struct, fixed, floor, full, sharp, step)
    assert checked


def test_post_floor_prunes_without_changing_the_result():
    cm = CostModel(cluster_from_dict(_mixed_vendors_7()), load_workload("opt350"), TrainSettings(global_batch_size=64))
    n = [d.name for d in cm.cluster.devices]
    struct = [((n[0],), (n[1],), (n[2],)), ((n[5],), (n[3],)), ((n[6],), (n[4],))]
    plain = assemble_plan(cm, struct, "hybrid")
    routes = structure_routes(cm, struct)
    floor = max(BoundCache(cm).refined(s, 3, r).post for s, r in zip(struct, routes))
    assert 0 < floor
    assert assemble_plan(cm, struct, "hybrid", post_floor=floor).step_time_s == plain.step_time_s


def test_vectorised_min_fill_matches_one_cap_at_a_time():
    rng = np.random.default_rng(3)
    n = 12
    valid = np.arange(n)[:, None] < np.arange(n)[None, :]
    for S in (1, 3, 5):
        bott = [np.where(valid & (rng.random((n, n)) < 0.9), rng.random((n, n)), np.inf) for _ in range(S)]
        fill = [np.where(np.isfinite(b), b + rng.random((n, n)), np.inf) for b in bott]
        bott.append(bott[0])  # a repeated stage reuses its masked costs
        fill.append(fill[0])
        caps = np.unique(np.concatenate([b[np.isfinite(b)] for b in bott]))
        many = pipeline_mod._min_fill_many(bott, fill, caps)
        assert many == [pipeline_mod._min_fill(bott, fill, float(c)) for c in caps]


def test_cached_figures_reproduce_pipeline_time():
    """The oracle's (fill, bottleneck) arithmetic is pipeline_time_s's."""
    rng = random.Random(5)
    for _ in range(200):
        S = rng.randint(1, 5)
        full = [StageCost(rng.random(), rng.random() * 0.3, 0.0) for _ in range(S)]
        tail = [StageCost(c.compute_s * 0.5, c.send_s * 0.5, 0.0) for c in full]
        n = rng.randint(1, 9)
        fill = sum(c.compute_s + c.send_s for c in full)
        bott = max(c.compute_s + c.send_s + (full[s - 1].send_s if s else 0.0) for s, c in enumerate(full))
        fill_l = sum(c.compute_s + c.send_s for c in tail)
        bott_l = max(c.compute_s + c.send_s + (tail[s - 1].send_s if s else 0.0) for s, c in enumerate(tail))
        ours = fill_l if n == 1 else fill + (n - 2) * bott + bott_l
        assert ours == pipeline_time_s(full, tail, n)


def _exhaustive_inputs(cluster_dict: dict, model: str, **settings):
    cm = CostModel(cluster_from_dict(cluster_dict), load_workload(model),
                   TrainSettings(global_batch_size=64, **settings))
    classes = device_classes(cm)
    units = [(c, tp) for c, cls in enumerate(classes) for tp in _tp_options(cm, len(cls.devices))]
    return cm, classes, units


def test_mixed_vendors_variant_is_exact_with_few_assemblies():
    """The 7-device cluster that took ~60-140 s: the whole space, a handful of structures assembled (15 and 13
    since a stage pays the sends at both its boundaries, which the cheaper bounds price alone on each link)."""
    for max_tp in (1, 8):
        cm, classes, units = _exhaustive_inputs(_mixed_vendors_7(), "gpt_small", max_tp=max_tp)
        out = exhaustive.plan_exhaustive(cm, classes, units)
        assert out.exact and not out.block_templates
        assert out.assembled <= 16
        again = exhaustive.plan_exhaustive(*_exhaustive_inputs(_mixed_vendors_7(), "gpt_small", max_tp=max_tp))
        assert again.best.step_time_s == out.best.step_time_s and again.assembled == out.assembled


_THREE = {"name": "three", "inter_node_bandwidth_gbs": 10,
          "nodes": [{"name": "a", "devices": [{"type": "A100-40GB", "count": 2}]},
                    {"name": "b", "devices": ["T4", "V100-16GB"]}]}


@pytest.mark.parametrize("compute_model", ["flops", "roofline"])
def test_exhaustive_pruning_equals_assembling_every_structure(compute_model):
    """On a small space, the best-bound-first search finds the best of assembling every structure, and the
    route-free bound of each structure is at most its assembled step (with the roofline too, where a layer's
    time per sample falls with the micro-batch)."""
    cm, classes, units = _exhaustive_inputs(_THREE, "gpt_small", max_stages=3, compute_model=compute_model)
    out = exhaustive.plan_exhaustive(cm, classes, units)
    space, structs, complete, _ = exhaustive._space(cm, classes, units, BoundCache(cm))
    assert complete and out.exact
    bounds = space.lb0(structs)
    steps = []
    for struct, bound in zip(structs, bounds):
        res = assemble_plan(cm, exhaustive._realise([space.templates[i] for i in struct], classes), "hybrid")
        if res is not None:
            steps.append(res.step_time_s)
            assert bound <= res.step_time_s * (1 + 1e-9), (struct, bound, res.step_time_s)
    assert out.assembled < len(steps)
    assert out.best.step_time_s == pytest.approx(min(steps), rel=1e-12)


def test_the_compute_curves_sharpen_the_route_free_bound_under_the_roofline(monkeypatch):
    """The per-micro-batch compute curves never lower the route-free bound; under the roofline, whose time per
    sample falls with the micro-batch, they raise it where the per-sample figures mix the best of every size
    (one sample's fill with the largest micro-batch's rate); under flops they add little."""
    gains = {}
    for compute_model in ("flops", "roofline"):
        cm, classes, units = _exhaustive_inputs(_THREE, "opt350", max_stages=3, compute_model=compute_model)
        space, structs, _, _ = exhaustive._space(cm, classes, units, BoundCache(cm))
        sharp = np.array(space.lb0(structs))
        with monkeypatch.context() as m:
            m.setattr(exhaustive._Space, "_curve_pipe", lambda self, idx, B: np.zeros(len(idx)))
            plain = np.array(space.lb0(structs))
        finite = np.isfinite(plain)
        assert np.array_equal(np.isfinite(sharp), finite) and (sharp[finite] >= plain[finite]).all()
        gains[compute_model] = float(np.median(sharp[finite] / plain[finite]))
    assert gains["roofline"] > 1.05 and gains["flops"] < gains["roofline"], gains


def test_budget_fallback_keeps_the_better_plan(monkeypatch):
    """Past the work budgets the regime is inexact, the families regime runs too, the better plan wins."""
    cm, classes, units = _exhaustive_inputs(_mixed_vendors_7(), "gpt_small")
    monkeypatch.setattr(exhaustive, "MAX_ASSEMBLIES", 1)
    out = exhaustive.plan_exhaustive(cm, classes, units)
    assert not out.exact and out.assembled == 1
    fam = families.plan_families(cm, lambda count: _tp_options(cm, count))
    planned = search_plan(cm.cluster, cm.workload, cm.settings, mode="hybrid")
    assert cm.score(planned).step_time_s <= min(out.best.step_time_s, fam.step_time_s) * (1 + 1e-9)
    monkeypatch.setattr(exhaustive, "MAX_TEMPLATES", 50)
    monkeypatch.setattr(exhaustive, "MAX_STRUCTURES", 200)
    blocks = exhaustive.plan_exhaustive(cm, classes, units)
    assert blocks.block_templates and not blocks.exact and blocks.structures <= 200


def test_planner_stays_exact_on_random_small_cases():
    rng = random.Random(11)
    for index in range(6):
        case = random_case(rng, index, small=True)
        brute = brute_force_plan(case.cluster, case.workload, case.settings)
        if not math.isfinite(brute.step_time_s):
            continue
        planned = search_plan(case.cluster, case.workload, case.settings, mode="hybrid")
        step = CostModel(case.cluster, case.workload, case.settings).score(planned).step_time_s
        assert step == pytest.approx(brute.step_time_s, rel=1e-9)


def test_families_regime_prunes_options_by_bound():
    """A 64-device cluster: the families regime plans without assembling every (tp, stages) option."""
    spec = {"name": "c64", "inter_node_bandwidth_gbs": 25,
            "nodes": [{"name": f"{t}-n", "count": 2, "devices": [{"type": t, "count": 8}]}
                      for t in ("H100-SXM", "A100-80GB", "V100-32GB", "T4")]}
    workload = transformer_workload(TransformerConfig("g26", num_layers=24, hidden_size=1024, num_heads=16,
                                                      seq_len=1024, vocab_size=50257))
    cm = CostModel(cluster_from_dict(spec), workload, TrainSettings(global_batch_size=256, zero_stage=1, max_tp=8))
    calls = []
    real = families.assemble_plan

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    families.assemble_plan = counting
    try:
        res = families.plan_families(cm, lambda count: _tp_options(cm, count))
    finally:
        families.assemble_plan = real
    options = 4 * sum(len(families._stage_counts(cm, 16 // tp)) for tp in _tp_options(cm, 8))
    assert res is not None and cm.score(res.plan).fits
    assert len(calls) < options


def test_the_route_free_bound_counts_the_sends_at_a_stages_boundaries():
    """Two one-device nodes at 1 Mbit/s: a 2-stage pipeline's per-sample bottleneck bound is at least the least
    per-sample send between them (each stage pays it), and at most what the assembled plan's bottleneck costs
    per sample."""
    dev = {"type": "CPU", "tflops": {"fp32": 0.5}, "efficiency": 1.0, "memory_gb": 16}
    raw = {"name": "two_slow", "inter_node_bandwidth_gbs": 0.000125,
           "nodes": [{"name": f"n{i}", "intra_bandwidth_gbs": 1, "devices": [{"name": f"d{i}", **dev}]}
                     for i in range(2)]}
    cm = CostModel(cluster_from_dict(raw), load_workload("tiny_gpt"),
                   TrainSettings(global_batch_size=8, micro_batch_sizes=(1, 2, 4), max_tp=1))
    bc = BoundCache(cm)
    slots = [bc.slot(("d0",)), bc.slot(("d1",))]
    bound = bc.floor(slots, dp=1)
    L = cm.workload.num_layers
    least_send = min(cm.stage_send_s(m, j, ("d0",), ("d1",)) / m for m in (1, 2, 3, 4) for j in range(L - 1))
    whole_model = cm.stage_compute_s(cm.cluster.device("d0"), 1, 1, 0, L)
    assert least_send > 10 * whole_model  # the link, not the compute, sets the figure here
    assert bound.tau >= least_send
    part = pipeline_mod.plan_pipeline_stages(cm, [("d0",), ("d1",)], 4, 2)
    assert bound.tau <= part.bottleneck_s / 4 + 1e-12
