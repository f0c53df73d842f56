"""The hetero strategy without a process group: registration, construction, run-time planning, emulation."""

from __future__ import annotations

import importlib
import time

import pytest

pytest.importorskip("lightning")
import lightning.pytorch as lp  # noqa: E402

import het_strategy  # noqa: E402
from het_strategy.core.cluster import load_cluster  # noqa: E402
from het_strategy.emulation.speeds import EmulatedCompute, emulated_seconds_per_sample  # noqa: E402
from het_strategy.core.errors import ConfigError  # noqa: E402
from het_strategy.core.plan import Pipeline, Plan, Stage  # noqa: E402
from het_strategy.core.dtypes import precision_dtype  # noqa: E402
from het_strategy.planning.strategy_plans import data_parallel_plan, shares_in_rank_order  # noqa: E402
from het_strategy.core.workload import load_workload  # noqa: E402


def test_hetero_is_registered_in_lightning_and_builds_our_strategy() -> None:
    assert "hetero" in lp.strategies.StrategyRegistry
    trainer = lp.Trainer(strategy="hetero", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, het_strategy.HeteroStrategy)
    assert isinstance(trainer.strategy, lp.strategies.DDPStrategy)


def test_hetero_is_registered_in_pytorch_lightning_on_its_own_class_tree() -> None:
    pl_pkg = pytest.importorskip("pytorch_lightning")
    assert "hetero" in pl_pkg.strategies.StrategyRegistry
    trainer = pl_pkg.Trainer(strategy="hetero", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, het_strategy.HeteroStrategyPL)
    assert isinstance(trainer.strategy, pl_pkg.strategies.DDPStrategy)
    assert not isinstance(trainer.strategy, lp.strategies.DDPStrategy)


def test_importing_twice_is_harmless() -> None:
    from het_strategy.strategy import registry

    importlib.reload(het_strategy)  # registers again: must not raise
    registry.register_entries(lp.strategies.StrategyRegistry, het_strategy.HeteroStrategy)
    assert lp.strategies.StrategyRegistry["hetero"]["strategy"] is het_strategy.HeteroStrategy


def test_hydra_target_instantiates_the_strategy() -> None:
    from hydra.utils import instantiate

    s = instantiate({"_target_": "het_strategy.HeteroStrategy", "cluster": "local_cpu2", "global_batch_size": 8})
    assert isinstance(s, lp.strategies.DDPStrategy) and s.run.plans.cluster_source.name == "local_cpu2"


@pytest.mark.parametrize("kwargs, field", [({"global_batch_size": 0}, "global_batch_size"),
                                           ({"compression": "fast"}, "compression"),
                                           ({"emulation": "yes"}, "emulation"),
                                           ({"plan": 3}, "plan"),
                                           ({"cluster": "nope"}, "`cluster` is 'nope'.*shipped cluster name"),
                                           ({"cluster": 42}, "`cluster` is 42"),
                                           ({"cluster": {"nodes": "x"}}, "nodes` is .x.; it must be a non-empty list"),
                                           ({"plan": "/nonexistent.json"}, "`plan` is '/nonexistent.json'"),
                                           ({"cluster": "local_cpu2", "profile_input": lambda b: b},
                                            "`profile_input`.*go with cluster=\"auto\""),
                                           ({"probe": "always"}, "`probe` is 'always'"),
                                           ({"cluster": "local_cpu2", "probe": "refresh"}, "`probe`.*cluster=\"auto\""),
                                           ({"telemetry": "on"}, "`telemetry`")])
def test_bad_constructor_arguments_name_the_field(kwargs: dict, field: str) -> None:
    """Raised at construction, in the user's script, before Lightning launches a rank."""
    with pytest.raises(ConfigError, match=field):
        het_strategy.HeteroStrategy(**kwargs)


def test_a_plan_file_is_read_at_construction(tmp_path) -> None:
    bad = tmp_path / "plan.json"
    bad.write_text('{"schema_version": 1, "typo": 1}')
    with pytest.raises(ConfigError, match="plan.typo"):
        het_strategy.HeteroStrategy(cluster="local_cpu2", plan=bad)


def test_precision_names() -> None:
    assert precision_dtype("32-true") == "fp32" and precision_dtype("bf16-mixed") == "bf16"
    with pytest.raises(ConfigError, match="precision"):
        precision_dtype("8-bit")


# -- run-time planning ----------------------------------------------------------------------------

def _plan_for(cluster_name: str, batch: int) -> Plan:
    return data_parallel_plan(load_cluster(cluster_name), load_workload("tiny_gpt", "fp32"), batch, "fp32")


def test_mixed_cluster_shares_follow_the_emulated_speeds() -> None:
    cluster = load_cluster("local_cpu4_mixed")
    shares = shares_in_rank_order(_plan_for("local_cpu4_mixed", 1024), cluster)
    assert sum(shares) == 1024
    # speeds 1, 1, 0.5, 0.25: shares within a sample or two of 4 : 4 : 2 : 1
    for s, ideal in zip(shares, [1024 * w / 11 for w in (4, 4, 2, 1)]):
        assert abs(s - ideal) <= 2


def test_given_plan_is_checked_against_cluster_model_and_batch() -> None:
    cluster, workload = load_cluster("local_cpu2"), load_workload("tiny_gpt", "fp32")
    good = _plan_for("local_cpu2", 16)
    assert data_parallel_plan(cluster, workload, 16, "fp32", given=good) is good
    with pytest.raises(ConfigError, match="global_batch_size"):
        data_parallel_plan(cluster, workload, 32, "fp32", given=good)
    with pytest.raises(ConfigError, match="cluster"):
        data_parallel_plan(load_cluster("local_cpu4_equal"), workload, 16, "fp32", given=good)
    with pytest.raises(ConfigError, match="num_layers"):
        data_parallel_plan(cluster, load_workload("gpt_small", "fp32"), 16, "fp32", given=good)
    pipeline = Plan(cluster="local_cpu2", cluster_devices=("rank0", "rank1"), model=dict(good.model),
                    global_batch_size=16, pipelines=(Pipeline((Stage(("rank0",), (0, 3)), Stage(("rank1",), (3, 6))),
                                                              1, 16),), dtype="fp32", mode="pipeline")
    with pytest.raises(ConfigError, match="data-parallel"):
        data_parallel_plan(cluster, workload, 16, "fp32", given=pipeline)


def test_a_global_batch_smaller_than_the_world_is_refused() -> None:
    with pytest.raises(ConfigError, match="global_batch_size"):
        _plan_for("local_cpu4_mixed", 3)


def test_emulated_speed_must_be_positive() -> None:
    raw = load_cluster("local_cpu2").to_dict()
    raw["nodes"][0]["devices"][1]["emulated_speed"] = 0
    with pytest.raises(ConfigError, match="emulated_speed"):
        load_cluster(raw)


# -- emulation --------------------------------------------------------------------------------------

def test_emulated_time_scales_inversely_with_speed() -> None:
    cluster, workload = load_cluster("local_cpu4_mixed"), load_workload("tiny_gpt", "fp32")
    t = [emulated_seconds_per_sample(cluster, d.name, workload, "fp32") for d in cluster.devices]
    assert t[1] == pytest.approx(t[0]) and t[2] == pytest.approx(2 * t[0]) and t[3] == pytest.approx(4 * t[0])
    # 3 x forward FLOPs at the declared 0.008 TFLOPS
    flops = sum(layer.flops_per_sample for layer in workload.layers)
    assert t[0] == pytest.approx(3 * flops / 0.008e12, rel=1e-9)


def test_emulated_compute_pads_to_the_target() -> None:
    emu = EmulatedCompute(seconds_per_sample=0.02, backward_ratio=2.0)
    emu.begin()
    time.sleep(0.005)  # "forward"
    estimate = emu.estimate_with_backward()
    assert 0.015 <= estimate < 0.015 + 0.03
    start = time.perf_counter()
    pad = emu.pad(samples=3, factor=1.0, computed_s=estimate)
    assert pad == pytest.approx(0.06 - estimate) and time.perf_counter() - start >= pad
    assert emu.pad(samples=1, factor=2.0, computed_s=0.01) == pytest.approx(0.03)  # a 2x slowdown
    assert emu.pad(samples=0, factor=1.0, computed_s=0.001) == 0.0  # a filler costs nothing
    assert emu.pad(samples=1, factor=1.0, computed_s=0.5) == 0.0  # slower than emulated: no padding
    with pytest.raises(ConfigError, match="seconds_per_sample"):
        EmulatedCompute(seconds_per_sample=0)
