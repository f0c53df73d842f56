"""``planner.runtime``: only plans the runtime runs (the rule table of core.runtime_rules), and what it costs."""

from __future__ import annotations

import pytest

from het_strategy.cli.plan_cli import compose_plan_config, plan_or_score
from het_strategy.core.cluster import load_cluster
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import TransformerConfig, load_workload, transformer_workload
from het_strategy.core.errors import ConfigError
from het_strategy.core.runtime_rules import Problem, Runtime, runtime_problems
from het_strategy.planning import PlanRequest, plan as make_plan
from het_strategy.planning.runtimes import RuntimeChoice


def runnable_problem(plan, runtime):
    """The first problem's message, or None."""
    problems = runtime_problems(plan, runtime)
    return str(problems[0]) if problems else None


def _asym_cluster():
    """benchmarks/pipeline_asymmetric.py's cluster: one fast device holding the model, four slow ones that cannot."""
    devices = [("fast", 1.0, 16.0)] + [(f"slow{i}", 0.4, 0.03) for i in range(4)]
    return load_cluster({"name": "asym", "inter_node_bandwidth_gbs": 1, "nodes": [{
        "name": "local", "intra_bandwidth_gbs": 1, "devices": [
            {"name": n, "type": "CPU", "tflops": {"fp32": 0.004}, "efficiency": 1.0, "emulated_speed": s,
             "memory_gb": m} for n, s, m in devices]}]})


def _workload():
    return transformer_workload(TransformerConfig(name="char_gpt", num_layers=12, hidden_size=128, num_heads=4,
                                                  seq_len=64, vocab_size=256), dtype="fp32")


def _settings(dtype="fp32", **kw):
    # tp 1: these cases are about replica shapes and ZeRO (the slow devices would otherwise pool into tp groups)
    return TrainSettings(global_batch_size=8, dtype=dtype, micro_batch_sizes=(4,), memory_reserve_gb=0.0, max_tp=1,
                         **kw)


def _plan(pipes, zero_stage=0, dtype="fp32"):
    return Plan(cluster="c", cluster_devices=tuple(f"d{i}" for i in range(6)), model={"name": "m", "num_layers": 6},
                global_batch_size=sum(p.samples for p in pipes), dtype=dtype, mode="manual", zero_stage=zero_stage,
                pipelines=tuple(pipes))


def _pipe(devs, bounds, samples=4):
    return Pipeline(tuple(Stage(d if isinstance(d, tuple) else (d,), (a, b)) for d, a, b in
                          zip(devs, bounds, bounds[1:])), micro_batch_size=2, samples=samples)


@pytest.mark.parametrize("plan, fields", [
    (_plan([_pipe(["d0", "d1"], [0, 3, 6]), _pipe(["d2"], [0, 6])]), []),
    (_plan([_pipe(["d0", "d1"], [0, 3, 6]), _pipe(["d2"], [0, 6])], zero_stage=1), []),  # sharded in holder sets
    (_plan([_pipe(["d0", "d1"], [0, 3, 6]), _pipe(["d2"], [0, 6])], zero_stage=1, dtype="bf16"), []),  # + masters
    (_plan([_pipe(["d0", "d1"], [0, 3, 6]), _pipe(["d2"], [0, 6])], dtype="bf16"), []),  # asymmetric bf16 runs
    (_plan([_pipe(["d0", "d1"], [0, 3, 6]), _pipe(["d2"], [0, 6])], dtype="fp16"), []),  # per replica: scaled
    (_plan([_pipe(["d0", "d1"], [0, 3, 6]), _pipe(["d2"], [0, 6])], dtype="fp16", zero_stage=1), []),  # scaled
    (_plan([_pipe([("d0", "d1")], [0, 6]), _pipe(["d2"], [0, 6])], zero_stage=2), ["plan.zero_stage"]),  # tp: ZeRO 1
    (_plan([_pipe(["d0", "d1"], [0, 3, 6]), _pipe(["d2", "d3"], [0, 3, 6])], zero_stage=1), []),
    (_plan([_pipe(["d0", "d1"], [0, 3, 6])], zero_stage=2), ["plan.zero_stage"]),
    (_plan([_pipe(["d0"], [0, 6]), _pipe(["d1"], [0, 6])], zero_stage=3, dtype="bf16"), []),
    (_plan([_pipe(["d0"], [0, 6], samples=4), _pipe(["d1"], [0, 6], samples=1)], zero_stage=2),
     ["plan.pipelines[1].samples"]),  # 2 micro-batches everywhere at ZeRO 2, and 1 sample cannot make 2
    (_plan([_pipe(["d0"], [0, 6]), _pipe([("d1", "d2"), "d3"], [0, 2, 6])], zero_stage=2),  # pipelined, asymmetric
     ["plan.zero_stage", "plan.zero_stage"]),
    (_plan([_pipe([("d0", "d1", "d2")], [0, 6]), _pipe([("d3", "d4")], [0, 6])]),  # tp 2 does not divide tp 3
     ["plan.pipelines[1].stages[0].tp"]),
    (_plan([_pipe([("d0", "d1")], [0, 6]), _pipe(["d2"], [0, 6])]), []),  # mixed tp 2 and 1 runs at ZeRO 0
])
def test_the_deepspeed_rules_name_every_field_that_breaks_one(plan, fields):
    problems = runtime_problems(plan, "deepspeed")
    assert [p.field for p in problems] == fields
    assert all(isinstance(p, Problem) and f"`{p.field}` is" in str(p) and "must" in str(p) for p in problems)
    assert runtime_problems(plan, Runtime.any) == []


def test_the_world_size_rule_only_applies_when_given():
    plan = _plan([_pipe(["d0", "d1"], [0, 3, 6]), _pipe(["d2"], [0, 6])])
    assert runtime_problems(plan, Runtime.deepspeed, world_size=3) == []
    [problem] = runtime_problems(plan, Runtime.deepspeed, world_size=4)
    assert (problem.field, problem.value) == ("WORLD_SIZE", 4) and "device count (3)" in problem.rule


def test_hetero_takes_pure_data_parallel_plans_only():
    assert runtime_problems(_plan([_pipe(["d0"], [0, 6]), _pipe(["d1"], [0, 6])], zero_stage=2), "hetero") == []
    problems = runtime_problems(_plan([_pipe(["d0"], [0, 6]), _pipe(["d1", "d2"], [0, 3, 6]),
                                       _pipe([("d3", "d4")], [0, 6])]), "hetero")
    assert [(p.field, p.value) for p in problems] == [("plan.pipelines[1].stages", 2),
                                                      ("plan.pipelines[2].stages[0].tp", 2)]
    assert "data-parallel" in str(problems[0])


def _runtime_choice(cluster, workload, settings, mode: str, runtime: str) -> RuntimeChoice:
    """``planning.plan``'s runtime search: the runnable best beside the unconstrained best."""
    choice = make_plan(cluster, workload, settings, PlanRequest(mode=mode, runtime=runtime)).runtime
    assert choice is not None
    return choice


def test_an_unknown_runtime_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match="`runtime` is 'torchrun'; it must be one of any, deepspeed, hetero"):
        runtime_problems(_plan([_pipe(["d0"], [0, 6])]), "torchrun")
    with pytest.raises(ConfigError, match="`planner.runtime` is 'ds'"):
        PlanRequest(runtime="ds")


def test_asymmetric_best_is_runnable_at_zero_0_so_nothing_is_lost():
    choice = _runtime_choice(_asym_cluster(), _workload(), _settings(), mode="hybrid", runtime="deepspeed")
    assert len({tuple(p.boundaries()) for p in choice.plan.pipelines}) > 1  # asymmetric
    assert choice.plan is choice.unconstrained and choice.slowdown == 0.0
    assert "0.0% slower" in choice.summary()


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_asymmetric_best_runs_at_zero_1_sharded_within_its_holder_sets(dtype):
    choice = _runtime_choice(_asym_cluster(), _workload(), _settings(dtype, zero_stage=1), mode="auto",
                             runtime="deepspeed")
    assert len({tuple(p.boundaries()) for p in choice.plan.pipelines}) > 1  # asymmetric
    assert choice.plan is choice.unconstrained and choice.slowdown == 0.0


def test_at_zero_2_the_runtime_takes_the_best_data_parallel_plan_and_says_what_it_costs():
    cluster, workload = _asym_cluster(), _workload()
    choice = _runtime_choice(cluster, workload, _settings("bf16", zero_stage=2), mode="auto", runtime="deepspeed")
    assert runnable_problem(choice.unconstrained, "deepspeed") is not None  # the unconstrained best is a pipeline
    assert runnable_problem(choice.plan, "deepspeed") is None
    assert all(len(p.stages) == 1 for p in choice.plan.pipelines)
    assert choice.slowdown > 0.05
    assert f"{choice.slowdown * 100:.1f}% slower" in choice.summary()
    assert "`plan.zero_stage` is 2; it must be 0 or 1 for a plan with a multi-stage pipeline" in choice.summary()


def test_a_runnable_plan_as_fast_as_the_unconstrained_search_found_is_the_unconstrained_best():
    # fp32 at ZeRO 2 on mixed_vendors: the unconstrained search returns a pipeline (refused at ZeRO 2), and the
    # restricted searches find a runnable plan the cost model prices the same; that plan is the best of both, and
    # the summary does not call the best unrunnable
    settings = TrainSettings(global_batch_size=64, zero_stage=2, dtype="fp32")
    choice = _runtime_choice(load_cluster("mixed_vendors"), load_workload("gpt_small", dtype="fp32"), settings,
                             mode="auto", runtime="deepspeed")
    assert choice.unconstrained is choice.plan and choice.slowdown == 0.0
    assert choice.summary() == "runtime deepspeed: the best plan is runnable (0.0% slower than the unconstrained best)"


def test_tensor_parallel_best_runs_on_the_deepspeed_runtime():
    # AMP's V100 + T4 cluster, OPT-350 with tp up to 8: the best plan uses tp; the deepspeed runtime runs it as it is
    args = ["cluster=amp_v100_t4", "model=opt350", "settings.max_tp=8", "settings.dtype=fp32", "output.plan=null"]
    plan, _ = plan_or_score(compose_plan_config(args), echo=False)
    assert any(s.tp > 1 for p in plan.pipelines for s in p.stages)
    plan_ds, _ = plan_or_score(compose_plan_config([*args, "planner.runtime=deepspeed"]), echo=False)
    assert runnable_problem(plan_ds, "deepspeed") is None
    assert any(s.tp > 1 for p in plan_ds.pipelines for s in p.stages)
    assert plan_ds.predicted["step_time_s"] == pytest.approx(plan.predicted["step_time_s"])


def test_runtime_hetero_plans_one_stage_replicas_where_the_best_is_a_pipeline():
    # the asymmetric cluster's best plan pipelines over the slow devices; hetero keeps pure data parallelism
    choice = _runtime_choice(_asym_cluster(), _workload(), _settings(), mode="auto", runtime="hetero")
    assert runtime_problems(choice.unconstrained, "hetero") != []
    assert choice.plan.is_pure_dp and choice.runtime is Runtime.hetero and choice.slowdown > 0


def test_at_zero_2_the_runtime_finds_data_parallel_plans_whose_micro_batch_counts_it_equalises():
    # het-plan's default cluster at ZeRO 2: the fastest dp plan mixes micro-batch counts (ZeRO 2 reduces on every
    # micro-step, so every replica must run the same count); a single micro-batch size finds a runnable plan
    cluster, workload = load_cluster("mixed_a100_v100_t4"), transformer_workload(TransformerConfig(
        name="gpt_small_like", num_layers=12, hidden_size=768, num_heads=12, seq_len=1024, vocab_size=50257))
    choice = _runtime_choice(cluster, workload, TrainSettings(global_batch_size=64, zero_stage=2),
                             mode="auto", runtime="deepspeed")
    assert runtime_problems(choice.plan, "deepspeed") == []
    assert choice.plan.is_pure_dp and choice.slowdown > 0
