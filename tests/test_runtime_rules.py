"""Generated plans: the planner's filter, the DeepSpeed runtime's check and the strategy's construction check
refuse exactly the same ones (the Trainer's precision, checked against the plan's dtype when a Trainer attaches
it, is the strategy's own rule: ``test_ds_strategy_parts``)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from het_strategy.core.errors import ConfigError
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.core.runtime_rules import Runtime, runs_per_replica, runtime_problems
from het_strategy.planning.runtimes import runnable

pytest.importorskip("torch")
from het_strategy.ds_runtime.config import deepspeed_config, rank_batches  # noqa: E402
from het_strategy.ds_runtime.engine import check_runnable  # noqa: E402
from het_strategy.core.train_settings import TrainSettings  # noqa: E402
from het_strategy.core.cluster import load_cluster  # noqa: E402
from het_strategy.strategy.deepspeed_plan import DeepSpeedPlanHolder  # noqa: E402

NUM_LAYERS = 6
EXAMPLES = 400


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    """Plans of 1-3 replicas, each 1-3 stages of 1-3 devices over 6 layers, every ZeRO stage and dtype, per_device
    too (tp 2 beside tp 3 on one layer breaks the tp rule; a tp group of bf16 and fp16 devices the dtype rule).

    Replicas often share boundaries (drawn from a small pool) so aligned and
    asymmetric plans both come up, as do unequal micro-batch counts."""
    pool = [(0, 6), (0, 3, 6), (0, 2, 6), (0, 2, 4, 6)]
    names = iter(f"d{i}" for i in range(64))
    pipes = []
    for _ in range(draw(st.integers(1, 3))):
        bounds = draw(st.sampled_from(pool))
        stages = tuple(Stage(tuple(next(names) for _ in range(draw(st.integers(1, 3), label="tp")
                                                                 if draw(st.booleans()) else 1)), (a, b))
                       for a, b in zip(bounds, bounds[1:]))
        pipes.append(Pipeline(stages, micro_batch_size=draw(st.integers(1, 4)), samples=draw(st.integers(1, 8))))
    dtype = draw(st.sampled_from(["fp32", "bf16", "fp16"] * 2 + ["per_device"] * 3))
    used = [d for pipe in pipes for d in pipe.devices]
    device_dtypes = {d: draw(st.sampled_from(["bf16", "fp16"])) for d in used} if dtype == "per_device" else {}
    return Plan(cluster="gen", cluster_devices=tuple(f"d{i}" for i in range(64)),
                model={"name": "m", "num_layers": NUM_LAYERS}, global_batch_size=sum(p.samples for p in pipes),
                pipelines=tuple(pipes), zero_stage=draw(st.integers(0, 3)), dtype=dtype,
                device_dtypes=device_dtypes, mode="manual")


def _runtime_accepts(plan: Plan, world_size: int | None = None) -> bool:
    try:
        check_runnable(plan, world_size)
    except ConfigError:
        return False
    return True


CLUSTER = load_cluster({"name": "gen", "nodes": [{"name": "n", "devices": [{"name": f"d{i}", "type": "CPU"}
                                                                            for i in range(64)]}]})


def _strategy_accepts(plan: Plan) -> bool:
    try:
        DeepSpeedPlanHolder(CLUSTER, plan)
    except ConfigError:
        return False
    return True


def test_planner_runtime_and_strategy_refuse_the_same_generated_plans():
    seen: Counter[str] = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, database=None)
    @given(plans())
    def check(plan: Plan) -> None:
        planner = runnable(plan, Runtime.deepspeed)
        assert planner == _runtime_accepts(plan), runtime_problems(plan, Runtime.deepspeed)
        seen["runnable" if planner else "refused"] += 1
        assert _strategy_accepts(plan) == planner  # its precision (the plan's dtype) is checked when a Trainer attaches
        assert runnable(plan, Runtime.hetero) == plan.is_pure_dp and runnable(plan, Runtime.any)
        for problem in runtime_problems(plan, Runtime.deepspeed):
            seen[problem.field.rsplit(".", 1)[-1]] += 1  # tp, zero_stage, samples, devices
        if planner:
            # what the runtime accepts it can cut into micro-batches and configure, rank by rank
            for b in rank_batches(plan):
                assert sum(b.micro_batch_sizes) == b.samples and min(b.micro_batch_sizes) >= 1
            cfg = deepspeed_config(plan, TrainSettings(global_batch_size=plan.global_batch_size, dtype=plan.dtype,
                                                       zero_stage=plan.zero_stage), gradient_clipping=0.0)
            # a per-replica plan's ZeRO 1 is the runtime's own (holder_sharding): DeepSpeed runs at ZeRO 0
            assert cfg["zero_optimization"]["stage"] == (0 if runs_per_replica(plan) else plan.zero_stage)
        # the launched world joins the rule only when given: one process per device the plan uses
        used = len(plan.used_devices)
        assert _runtime_accepts(plan, used) == planner
        assert not _runtime_accepts(plan, used + 1)

    check()
    # every outcome and every rule came up often enough for the equality to mean something
    assert seen["runnable"] >= 60 and seen["refused"] >= 60, seen
    for rule in ("tp", "zero_stage", "samples", "devices"):  # devices: a per_device tp group of two dtypes
        assert seen[rule] >= 10, (rule, seen)
