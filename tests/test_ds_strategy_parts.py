"""The collaborators of ``HeteroDeepSpeedStrategy``, each on its own: the plan holder and the global-batch loaders."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from het_strategy.core.cluster import load_cluster  # noqa: E402
from het_strategy.core.errors import ConfigError  # noqa: E402
from het_strategy.core.plan import Pipeline, Plan, Stage  # noqa: E402
from het_strategy.core.runtime_rules import Runtime, runtime_problems  # noqa: E402
from het_strategy.strategy.deepspeed_plan import DeepSpeedPlanHolder  # noqa: E402
from het_strategy.strategy.global_batches import GlobalBatches, batch_pair  # noqa: E402
from het_strategy.strategy.loaders import is_split  # noqa: E402


def _cluster(n=4, emulated=False):
    devices = [{"name": f"cpu{i}", "type": "CPU", **({"emulated_speed": 1.0 / (i + 1)} if emulated else {})}
               for i in range(n)]
    return load_cluster({"name": "local", "nodes": [{"name": "local", "devices": devices}]})


def _plan(pipes, zero_stage=0, dtype="fp32"):
    return Plan(cluster="local", cluster_devices=tuple(f"cpu{i}" for i in range(4)),
                model={"name": "tiny_gpt", "num_layers": 6}, global_batch_size=sum(p.samples for p in pipes),
                dtype=dtype, mode="manual", zero_stage=zero_stage, pipelines=tuple(pipes))


def _pipe(devs, bounds, micro=2, samples=4):
    return Pipeline(tuple(Stage((d,), (a, b)) for d, a, b in zip(devs, bounds, bounds[1:])), micro, samples)


PIPE = _plan([_pipe(["cpu0", "cpu1"], [0, 3, 6]), _pipe(["cpu2", "cpu3"], [0, 3, 6])])


# -- DeepSpeedPlanHolder ----------------------------------------------------------------------------

def test_a_given_plan_is_held_with_its_zero_override_and_checked_against_the_world():
    holder = DeepSpeedPlanHolder(_cluster(), PIPE, zero_stage=1)
    assert holder.plan.zero_stage == 1 and PIPE.zero_stage == 0 and holder.settings is None
    assert holder.ensure(rank=0, world_size=4) is holder.plan and holder.plan_summary is None
    with pytest.raises(ConfigError) as err:
        holder.ensure(rank=0, world_size=3)
    assert err.value.field == "WORLD_SIZE" and "device count (4)" in str(err.value)


@pytest.mark.parametrize("plan, field", [
    (_plan([Pipeline((Stage(("cpu0", "cpu1"), (0, 6)),), 2, 4)], zero_stage=2), "plan.zero_stage"),
    (_plan([_pipe(["cpu0"], [0, 6]), _pipe(["gpu9"], [0, 6])]), "plan.pipelines[1].stages[0].devices[0]"),
])
def test_the_construction_check_refuses_what_the_runtime_cannot_run(plan, field):
    with pytest.raises(ConfigError) as err:
        DeepSpeedPlanHolder(_cluster(), plan)
    assert err.value.field == field


@pytest.mark.parametrize("precision, dtype", [("32-true", "fp32"), ("bf16-mixed", "bf16"), ("16-mixed", "fp16")])
def test_the_trainers_precision_sets_the_dtype_a_given_plan_must_have(precision, dtype):
    bf16 = _plan([_pipe(["cpu0", "cpu1"], [0, 3, 6]), _pipe(["cpu2"], [0, 6])], dtype="bf16")  # asymmetric
    holder = DeepSpeedPlanHolder(_cluster(), bf16)  # the precision is not known before a Trainer attaches it
    if dtype == "bf16":
        holder.use_precision(precision)
        assert holder.dtype == "bf16" and holder.ensure(rank=0, world_size=3) is holder.plan
        return
    with pytest.raises(ConfigError) as err:
        holder.use_precision(precision)
    assert err.value.field == "plan.dtype" and f"be {dtype}, the dtype of Trainer(precision='{precision}')" \
        in str(err.value)
    with pytest.raises(ConfigError, match="`plan.dtype` is 'bf16'; it must be fp32"):
        holder.ensure(rank=0, world_size=3)  # no precision attached: the run is fp32


def test_without_a_plan_rank_zero_plans_in_the_trainers_dtype():
    holder = DeepSpeedPlanHolder(_cluster(), None, workload="tiny_gpt", global_batch_size=8, planner_mode="pipeline")
    holder.use_precision("bf16-mixed")
    assert holder.settings.dtype == "bf16"
    with pytest.raises(ConfigError, match="WORLD_SIZE"):
        holder.ensure(rank=0, world_size=1)
    assert holder.plan.dtype == "bf16"
    with pytest.raises(ConfigError) as err:
        holder.use_precision("bf16-true")
    assert err.value.field == "Trainer.precision" and "32-true, bf16-mixed, 16-mixed" in str(err.value)


def test_a_trainer_in_another_precision_than_the_plan_is_refused_at_its_construction():
    pl = pytest.importorskip("lightning.pytorch")
    from het_strategy import HeteroDeepSpeedStrategy

    strategy = HeteroDeepSpeedStrategy(cluster=_cluster(), plan=PIPE)  # fp32
    with pytest.raises(ConfigError, match="`plan.dtype` is 'fp32'; it must be bf16"):
        pl.Trainer(strategy=strategy, accelerator="cpu", devices=4, precision="bf16-mixed", logger=False)


def test_without_a_plan_rank_zero_plans_one_the_runtime_runs():
    holder = DeepSpeedPlanHolder(_cluster(), None, workload="tiny_gpt", global_batch_size=8, planner_mode="pipeline")
    assert holder.plan is None and holder.settings.global_batch_size == 8
    with pytest.raises(ConfigError, match="WORLD_SIZE"):
        holder.ensure(rank=0, world_size=1)  # a world of one (no broadcast): the planned plan uses 4 devices
    plan = holder.plan
    assert plan is not None and plan.global_batch_size == 8 and plan.num_pipelines == 1
    assert len(plan.pipelines[0].stages) == 4 and runtime_problems(plan, Runtime.deepspeed, 4) == []
    assert holder.plan_summary.startswith("runtime deepspeed:")


@pytest.mark.parametrize("kwargs, field", [
    (dict(), "workload"),
    (dict(workload="tiny_gpt"), "global_batch_size"),
    (dict(workload="tiny_gpt", global_batch_size=8, planner_mode="fast"), "planner_mode"),
    (dict(workload="tiny_gpt", global_batch_size=8, zero_stage=True), "zero_stage"),
    (dict(workload="tiny_gpt", global_batch_size=8, max_tp=3), "max_tp"),
])
def test_planning_inputs_are_checked_at_construction(kwargs, field):
    with pytest.raises(ConfigError) as err:
        DeepSpeedPlanHolder(_cluster(), None, **kwargs)
    assert err.value.field == field


def test_a_model_without_tensor_parallel_plans_is_planned_at_tp_1():
    from het_strategy.demo.char_gpt import CharGPT

    class Plain(torch.nn.Module):
        def pipeline_layers(self):
            return [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]

    holder = DeepSpeedPlanHolder(_cluster(), None, workload="tiny_gpt", global_batch_size=8, max_tp=2)
    assert holder.limit_tp_to(CharGPT(num_layers=1, hidden_size=16, num_heads=2, seq_len=8)) is None
    assert holder.settings.max_tp == 2
    why = holder.limit_tp_to(Plain())
    assert "max_tp=2 is not used" in why and "tensor_parallel_plan()" in why and holder.settings.max_tp == 1


def test_stage_padding_follows_the_emulation_switch():
    emulated = _cluster(emulated=True)
    on = DeepSpeedPlanHolder(emulated, PIPE, workload="tiny_gpt")
    cluster, workload = on.stage_padding(object())
    assert cluster is emulated and workload.name == on.workload.name
    with pytest.raises(ConfigError, match="workload_config"):
        DeepSpeedPlanHolder(emulated, PIPE).stage_padding(object())  # nothing prices the stages
    off = DeepSpeedPlanHolder(emulated, PIPE, emulation=False)
    assert off.stage_padding(object()) == (None, None)
    assert all(d.emulated_speed is None for d in off.cluster.devices)  # planned at the real speeds too
    assert DeepSpeedPlanHolder(_cluster(), PIPE).stage_padding(object()) == (None, None)


# -- GlobalBatches ----------------------------------------------------------------------------------

def _data(n=12):
    return TensorDataset(torch.arange(n, dtype=torch.float32).reshape(n, 1), torch.zeros(n))


def test_the_training_loader_yields_whole_global_batches_and_saves_its_position():
    batches = GlobalBatches()
    loader = batches.process(DataLoader(_data(), batch_size=4), global_batch=4, training=True)
    assert is_split(loader)
    got = [x.flatten().tolist() for x, _ in loader]
    assert got == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]]
    batches.record((None, 1), {})  # training_step(batch, batch_idx=1): the next position is 2
    assert batches.batch_idx == 1 and loader.state_dict()
    assert batches.process(loader, 4, True) is loader


def test_a_dataloader_subclass_keeps_its_class_and_a_custom_batch_sampler_is_refused_in_one_line():
    from tests._data_compat_cases import LengthBuckets, TaggedLoader

    loader = GlobalBatches().process(TaggedLoader(_data(), tag="mine", batch_size=4), global_batch=4, training=True)
    assert type(loader) is TaggedLoader and loader.describe() == "tagged:mine" and is_split(loader)
    data = _data()
    bucketed = DataLoader(data, batch_sampler=LengthBuckets(torch.utils.data.SequentialSampler(data), 4, False))
    with pytest.raises(ConfigError, match="DataLoader.batch_sampler.*whole global batch"):
        GlobalBatches().process(bucketed, global_batch=4, training=True)


def test_loaders_of_another_batch_or_with_a_short_last_batch_are_refused():
    batches = GlobalBatches()
    with pytest.raises(ConfigError) as err:
        batches.process(DataLoader(_data(), batch_size=3), global_batch=4, training=False)
    assert err.value.field == "DataLoader.batch_size"
    with pytest.raises(ConfigError) as err:
        batches.process(DataLoader(_data(10), batch_size=4), global_batch=4, training=True)
    assert err.value.field == "DataLoader.drop_last"
    val = DataLoader(_data(10), batch_size=4)
    assert batches.process(val, global_batch=4, training=False) is val  # evaluation loaders are used as given


def test_a_batch_is_a_pair():
    assert batch_pair((1, 2), "training batch") == (1, 2)
    with pytest.raises(ConfigError, match="`training batch` is 'dict'"):
        batch_pair({"x": 1}, "training batch")
