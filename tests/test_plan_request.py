"""``PlanRequest`` + ``planning.plan`` give the plans the five entry points gave, on the shipped clusters and models.

``tests/data/plan_request_baseline.json`` holds what ``plan``, ``plan_for_runtime``, ``plan_for_objective``,
``plan_jointly`` and ``data_parallel_plan`` returned, through het-plan's branch for each ``planner`` section (the
plan JSON with the price figures het-plan adds, and the line it prints), before they became one request; the script
that wrote it is ``tests/data/capture_plan_baseline.py`` at commit 4ea4300 (its ZeRO-2 ``runtime=deepspeed`` case
on metis_t4_a100 is left out here: the runtime rule table refuses that plan now).  The ``runtime=deepspeed``
case at ``max_tp=2`` was captured again when the deepspeed runtime gained tensor parallelism: its best plan
(tp 2 stages) is now runnable, where the runtime used to fall back to tp 1.  Every case was captured again
(``tests/data/refresh_plan_baseline.py``) when the memory model gained the runtime's buffers, the framework's
overhead and the activations tp does not split (``core/memory.py``): the plans kept their structure, their memory
figures and the "does not fit" reasons changed.  They were captured again when fused attention stopped being
charged the s x s scores (``transformer_workload``): the same plans, lower memory figures.  And again when a
pipeline stage began paying the blocking sends at both its boundaries (``core/cost_model.py``): higher step times,
the same plans except ``runtime=deepspeed`` on mixed_a100_v100_t4 (a 3-stage pipeline per replica in place of a
tp-2 last stage).  The MoE case's ``model`` record gained ``active_params_per_token`` (issue 45), nothing else.  The cost objective's
lines were captured again when the sub-cluster search gained its LP check (``planning/sub_cluster_bound.py``): the
same plans, fewer sub-clusters planned.  And when replicas that differ began to be priced by their holder sets
(``core/holder_sync.py``): the same plans; the idle devices' "with it as one more replica" times and the MoE plan's
step (by 4e-5 s: its sets' latencies) changed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from het_strategy.core.cluster import load_cluster
from het_strategy.core.errors import ConfigError
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import load_workload
from het_strategy.planning import CompressionPlanning, Objective, PlanMode, PlanRequest, plan
from het_strategy.planning.strategy_plans import data_parallel_plan
from het_strategy.reference.sailor_profiles import request_profile

_BASELINE = json.loads((Path(__file__).parent / "data" / "plan_request_baseline.json").read_text())


def _same(got: Any, want: Any, where: str = "plan") -> None:
    """Equal JSON trees, floats to 1e-9 relative."""
    if isinstance(want, float) and isinstance(got, (int, float)):
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15), f"{where}: {got} != {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for key in want:
            _same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got} != {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _case_id(case: dict) -> str:
    return f"{case['cluster']}-{case['model']}-" + ",".join(f"{k}={v}" for k, v in sorted(case["planner"].items()))


@pytest.mark.parametrize("case", _BASELINE["cases"], ids=_case_id)
def test_plan_request_gives_the_entry_points_plan(case: dict) -> None:
    settings = TrainSettings(**{"max_tp": 1, **case["settings"]})  # captured when max_tp defaulted to 1
    cluster, workload = load_cluster(case["cluster"]), load_workload(case["model"], dtype=settings.dtype)
    request = PlanRequest(**case["planner"])
    result = plan(cluster, workload, settings, request, request_profile(request, workload))
    _same(result.plan.to_dict(), case["plan"])
    line, want = result.summary(), case["line"]
    if want is not None and "cannot run: " in want:  # the reason is the runtime rule table's wording, not the plan's
        line, want = line.partition("cannot run: ")[0], want.partition("cannot run: ")[0]
    assert line == want
    assert result.plan.predicted["step_time_s"] == pytest.approx(result.score.step_time_s)


@pytest.mark.parametrize("case", _BASELINE["data_parallel"], ids=lambda c: f"{c['cluster']}-{c['model']}")
def test_data_parallel_plan_is_the_dp_request(case: dict) -> None:
    cluster, workload = load_cluster(case["cluster"]), load_workload(case["model"], dtype=case["dtype"])
    got = data_parallel_plan(cluster, workload, case["global_batch_size"], case["dtype"]).to_dict()
    for price in ("dollars_per_hour", "dollars_per_iteration", "num_used"):  # figures plan() adds to predicted
        got["predicted"].pop(price, None)
    _same(got, case["plan"])


def test_the_result_carries_what_the_table_prints_beside_the_plan() -> None:
    # ZeRO 2: pipelines and tensor-parallel plans run at ZeRO 0 and 1 only (core.runtime_rules), so the runtime
    # keeps pure data parallelism
    settings = TrainSettings(global_batch_size=64, max_tp=2, zero_stage=2, dtype="fp16")
    cluster, workload = load_cluster("amp_v100_t4"), load_workload("gpt2_amp", dtype=settings.dtype)
    result = plan(cluster, workload, settings, PlanRequest(runtime="deepspeed"))
    assert result.unconstrained is not None and result.unconstrained is not result.plan
    assert result.runtime_slowdown == pytest.approx(result.plan.predicted["step_time_s"]
                                                    / result.unconstrained.predicted["step_time_s"] - 1)
    assert result.runtime_slowdown > 0.005 and result.blind is None and result.objective is None

    amp = TrainSettings(global_batch_size=32)
    joint = plan(load_cluster("amp_v100_t4"), load_workload("gpt2_amp", dtype="bf16"), amp,
                 PlanRequest(compression="joint"))
    assert joint.plan.compression == {"inter_node": "q4"} and joint.blind is not None
    assert joint.brought_back and set(joint.brought_back) <= set(joint.plan.used_devices)
    assert not set(joint.brought_back) & set(joint.blind.used_devices)
    assert set(joint.idle) == set(d.name for d in load_cluster("amp_v100_t4").devices) - set(joint.plan.used_devices)


def test_the_request_converts_strings_to_its_enums() -> None:
    request = PlanRequest(mode="dp", objective="cost", compression="joint", budget_per_hour=3)
    assert request.mode is PlanMode.dp and request.objective is Objective.cost
    assert request.compression is CompressionPlanning.joint and request.searches_sub_clusters
    assert not PlanRequest().searches_sub_clusters


@pytest.mark.parametrize("kw, field, shown", [
    ({"mode": "fast"}, "planner.mode", "fast"),
    ({"runtime": "torch"}, "planner.runtime", "torch"),
    ({"objective": "speed"}, "planner.objective", "speed"),
    ({"compression": "zip"}, "planner.compression", "zip"),
    ({"profile": "mine"}, "planner.profile", "mine"),
    ({"budget_per_hour": 0}, "planner.budget_per_hour", "0"),
    ({"min_throughput": float("nan")}, "planner.min_throughput", "nan"),
    ({"budget_per_hour": True}, "planner.budget_per_hour", "True"),
    ({"compression": "joint", "mode": "pipeline"}, "planner.compression", "joint"),
    ({"compression": "joint", "runtime": "deepspeed"}, "planner.compression", "joint"),
])
def test_a_bad_request_names_the_planner_field(kw: dict, field: str, shown: str) -> None:
    with pytest.raises(ConfigError) as info:
        PlanRequest(**kw)
    assert info.value.field == field and shown in str(info.value)


def test_a_sailor_profile_and_a_given_profile_are_refused_together() -> None:
    from het_strategy.reference.sailor_profiles import load_sailor_profile, request_profile

    settings = TrainSettings(global_batch_size=256)
    workload = load_workload("opt350", dtype="bf16")
    with pytest.raises(ConfigError, match="planner.profile"):
        request_profile(PlanRequest(mode="dp", profile="sailor"), workload, load_sailor_profile(workload=workload))
    with pytest.raises(ConfigError, match="no Sailor profile"):
        request_profile(PlanRequest(profile="sailor"), load_workload("gpt_small"))


def test_a_request_naming_a_profile_comes_with_it() -> None:
    """The planning core reads no reference data: the caller loads the profile ``planner.profile`` names."""
    with pytest.raises(ConfigError, match="`planner.profile` is 'sailor'; it must come with its profile"):
        plan(load_cluster("sailor_a100_v100_32_96"), load_workload("opt350", dtype="bf16"),
             TrainSettings(global_batch_size=256), PlanRequest(mode="dp", profile="sailor"))


def test_het_train_reads_the_same_request_and_refuses_what_it_does_not_run(tmp_path: Path) -> None:
    """het-train's ``planner`` section is a PlanRequest: its mode is used, every other field stays default."""
    from het_strategy.cli.train_cli import compose_train_config
    from het_strategy.cli.train_job import TrainJob

    cfg, auto = compose_train_config(["cluster=local_cpu2_pipeline", "strategy=hetero_deepspeed",
                                      "planner.mode=pipeline", f"output.dir={tmp_path}"])
    job = TrainJob(cfg, auto)
    assert isinstance(job.planner, PlanRequest) and job.planner.mode is PlanMode.pipeline
    for override, field in (("planner.objective=cost", "planner.objective"),
                            ("planner.compression=joint", "planner.compression")):
        cfg, auto = compose_train_config(["cluster=local_cpu2", override, f"output.dir={tmp_path}"])
        with pytest.raises(ConfigError, match=f"`{field}` is '(cost|joint)'; it must stay (time|none) with het-train"):
            TrainJob(cfg, auto)
    with pytest.raises(ConfigError, match="`planner.mode` is 'fast'; it must be one of auto, dp, pipeline, hybrid"):
        compose_train_config(["cluster=local_cpu2", "planner.mode=fast", f"output.dir={tmp_path}"])
