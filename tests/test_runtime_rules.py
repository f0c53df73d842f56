"""Generated plans: the planner's filter, the DeepSpeed runtime's check and the strategy's construction check
refuse exactly the same ones (the Trainer's precision, checked against the plan's dtype when a Trainer attaches
it, is the strategy's own rule: ``test_ds_strategy_parts``)."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from het_strategy.core.errors import ConfigError
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.core.runtime_rules import (ClippingOwner, Runtime, clipping_owner, has_tensor_parallel,
                                             holds_own_masters, runs_per_replica, runtime_problems)
from het_strategy.planning.runtimes import runnable

pytest.importorskip("torch")
from het_strategy.ds_runtime.ds_config import deepspeed_config, rank_batches  # noqa: E402
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


def _clipped_before(plan: Plan) -> tuple[bool, bool]:
    """(the runtime clips, the ds_config keeps the clipping) as ``ds_runtime`` decided them before the decision
    became ``clipping_owner``: ``engine.py``'s ``own_clipping``, ``replica_engine.py``'s ``own_clip`` and
    ``ds_config.py``'s ``gradient_clipping``, written out."""
    on_grid = not runs_per_replica(plan)
    holder = holds_own_masters(plan)
    if on_grid:
        own = len(plan.pipelines[0].stages) > 1 and plan.zero_stage == 0 and plan.dtype == "fp32"
        return own, True
    mixed = plan.dtype in ("bf16", "fp16") and not holder
    tp = has_tensor_parallel(plan)
    return not mixed or tp, plan.dtype != "fp32" and not holder and not tp


def test_one_rule_says_who_clips_and_the_config_follows_it():
    seen: Counter[str] = Counter()

    @settings(max_examples=EXAMPLES // 2, deadline=None, database=None)
    @given(plans())
    def check(plan: Plan) -> None:
        if not runnable(plan, Runtime.deepspeed):
            return
        owner = clipping_owner(plan)
        runtime_clips, config_clips = _clipped_before(plan)
        assert (owner is ClippingOwner.runtime) == runtime_clips
        settings_ = TrainSettings(global_batch_size=plan.global_batch_size, dtype=plan.dtype,
                                  zero_stage=plan.zero_stage)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the grid's fp32 ZeRO-0 pipeline warns that plain DeepSpeed clips badly
            cfg = deepspeed_config(plan, settings_, gradient_clipping=1.0)
        assert (cfg["gradient_clipping"] == 1.0) == config_clips
        seen[f"{owner}, {'grid' if not runs_per_replica(plan) else 'per replica'}"] += 1

    check()
    assert len(seen) == 4, seen  # both owners, on the grid and per replica (test_who_clips names each case)


@pytest.mark.parametrize("bounds, tp, dtype, zero, owner", [
    ([(0, 3, 6)] * 2, 1, "fp32", 0, "runtime"),     # DeepSpeed 0.19 clips this pipeline by stage 0's norm
    ([(0, 3, 6)] * 2, 1, "fp32", 1, "deepspeed"),
    ([(0, 3, 6)] * 2, 1, "bf16", 0, "deepspeed"),
    ([(0, 6)] * 2, 1, "fp32", 0, "deepspeed"),       # one stage: nothing to clip wrongly
    ([(0, 3, 6), (0, 2, 6)], 1, "bf16", 0, "deepspeed"),  # per replica: the mixed-precision optimizer
    ([(0, 3, 6), (0, 2, 6)], 1, "fp32", 0, "runtime"),
    ([(0, 3, 6), (0, 2, 6)], 1, "bf16", 1, "runtime"),    # the runtime holds the masters
    ([(0, 6)] * 2, 2, "bf16", 0, "runtime"),         # tp: DeepSpeed's norm would count replicated parameters twice
    ([(0, 3, 6)] * 2, 1, "fp16", 0, "deepspeed"),    # fp16 at ZeRO 0 runs per replica
])
def test_who_clips(bounds: list, tp: int, dtype: str, zero: int, owner: str) -> None:
    plan = _plan(bounds, tp, dtype, zero)
    assert runnable(plan, Runtime.deepspeed)
    assert clipping_owner(plan) == owner


def _plan(bounds: list, tp: int, dtype: str, zero: int) -> Plan:
    names = iter(f"d{i}" for i in range(64))
    pipes = tuple(Pipeline(tuple(Stage(tuple(next(names) for _ in range(tp)), (a, b)) for a, b in zip(bs, bs[1:])),
                           micro_batch_size=1, samples=2) for bs in bounds)
    return Plan(cluster="gen", cluster_devices=tuple(f"d{i}" for i in range(64)),
                model={"name": "m", "num_layers": NUM_LAYERS}, global_batch_size=2 * len(pipes), pipelines=pipes,
                zero_stage=zero, dtype=dtype, mode="manual")


def test_a_float64_model_runs_per_replica_at_zero_0_and_1_and_its_config_follows():
    # DeepSpeed's grid reduces no float64 gradient: an fp32 plan of float64 parameters runs per replica
    for bounds, zero in (([(0, 3, 6)] * 2, 0), ([(0, 6)] * 2, 0), ([(0, 3, 6)] * 2, 1)):
        plan = _plan(bounds, 1, "fp32", zero)
        assert runs_per_replica(plan, "float64")
        assert not runs_per_replica(plan) and not runs_per_replica(plan, "float32")
        s = TrainSettings(global_batch_size=plan.global_batch_size, dtype="fp32", zero_stage=zero)
        cfg = deepspeed_config(plan, s, gradient_clipping=1.0, param_dtype="float64")
        assert cfg["train_batch_size"] == 2 and cfg["zero_optimization"]["stage"] == 0  # its replica's own grid (dp 1)
        assert clipping_owner(plan, "float64") is ClippingOwner.runtime and cfg["gradient_clipping"] == 0.0
        assert holds_own_masters(plan, "float64") == (zero == 1)
    assert check_runnable(_plan([(0, 6)] * 2, 1, "fp32", 0), param_dtype="float64").per_replica
    assert not runs_per_replica(_plan([(0, 6)] * 2, 1, "fp32", 2), "float64")  # ZeRO 2: DeepSpeed's (it refuses)
