"""The DeepSpeed form of a Plan, checked in one process against DeepSpeed's own validators."""

from __future__ import annotations

import json
import math
import os
import sys
import types

import pytest

from het_strategy.core.cluster import cluster_from_dict
from het_strategy.core.cost_model import CostModel
from het_strategy.core.train_settings import TrainSettings
from het_strategy.ds_runtime.ds_config import (
    deepspeed_config,
    expert_map,
    per_rank_configs,
    pipeline_parts,
    rank_batches,
    rank_layout,
    write_deepspeed_files,
)
from het_strategy.core.errors import ConfigError
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.core.workload import TransformerConfig, transformer_workload

GiB = 2**30
DS_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
           "zero_optimization", "bf16", "fp16", "steps_per_print", "wall_clock_breakdown"}
DS_KEYS_HALF = DS_KEYS | {"communication_data_type"}  # half-precision plans: the priced gradient dtype


def _workload(num_blocks: int = 4, hidden: int = 64):
    return transformer_workload(TransformerConfig(name="tiny", num_layers=num_blocks, hidden_size=hidden, num_heads=4,
                                                  seq_len=32, vocab_size=128))


def _cluster(num: int = 4, memory_gb: float | None = None):
    dev: dict = {"type": "A100-40GB", "count": num}
    if memory_gb is not None:
        dev["memory_gb"] = memory_gb
    return cluster_from_dict({"name": "test", "nodes": [{"name": "n0", "devices": [dev]}]})


def _dp_plan(samples: list[int], mbs: list[int], dtype: str = "bf16", zero: int = 0, num_layers: int = 6,
             experts: dict | None = None) -> Plan:
    wl = _workload(num_layers - 2)
    pipes = [Pipeline((Stage((f"n0/{i}",), (0, num_layers)),), micro_batch_size=m, samples=s)
             for i, (s, m) in enumerate(zip(samples, mbs))]
    return Plan(cluster="test", cluster_devices=tuple(f"n0/{i}" for i in range(4)), model=wl.fingerprint(),
                global_batch_size=sum(samples), pipelines=tuple(pipes), zero_stage=zero, dtype=dtype, mode="manual",
                experts=experts or {})


def _pp_plan(bounds: list[list[int]], samples: list[int], mbs: int = 2, zero: int = 0) -> Plan:
    wl = _workload(4)
    pipes, dev = [], 0
    for b, s in zip(bounds, samples):
        stages = []
        for a, c in zip(b, b[1:]):
            stages.append(Stage((f"n0/{dev}",), (a, c)))
            dev += 1
        pipes.append(Pipeline(tuple(stages), micro_batch_size=mbs, samples=s))
    return Plan(cluster="test", cluster_devices=tuple(f"n0/{i}" for i in range(dev)), model=wl.fingerprint(),
                global_batch_size=sum(samples), pipelines=tuple(pipes), zero_stage=zero, mode="manual")


def _settings(plan: Plan, **kw) -> TrainSettings:
    return TrainSettings(global_batch_size=plan.global_batch_size, dtype=plan.dtype, zero_stage=plan.zero_stage, **kw)


def _validate(cfg: dict, dp_world: int, monkeypatch) -> object:
    """Run DeepSpeed's own config parser and batch assertion as a rank of a ``dp_world`` data-parallel group.

    DeepSpeedConfig asks deepspeed.comm for the rank (and falls back to world
    size 1 without a process group); given an mpu it takes the data-parallel
    world size from it, as the engine does for a PipelineModule's grid.
    """
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    import deepspeed.comm

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)
    mpu = types.SimpleNamespace(get_data_parallel_world_size=lambda: dp_world)
    return ds_config.DeepSpeedConfig(dict(cfg), mpu=mpu)


@pytest.fixture(autouse=True)
def _cpu_accelerator(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def test_planning_core_runs_without_torch_or_deepspeed():
    """With torch and deepspeed unimportable, `import het_strategy` still works and the planning core plans and
    writes a DeepSpeed config; with them installed, deepspeed is not imported."""
    blocked = ("import sys; sys.modules['torch'] = None; sys.modules['deepspeed'] = None; "
               "import het_strategy; "
               "from het_strategy.core.cluster import load_cluster; from het_strategy.core.workload import load_workload; "
               "from het_strategy.core.train_settings import TrainSettings; from het_strategy.planning import search_plan; "
               "from het_strategy.ds_runtime.ds_config import deepspeed_config; "
               "p = search_plan(load_cluster('local_cpu2'), load_workload('tiny_gpt', 'fp32'), "
               "TrainSettings(global_batch_size=8, dtype='fp32'), mode='dp'); "
               "assert p.rank_shares()")
    plain = ("import sys, het_strategy.ds_runtime.ds_config as m; m.deepspeed_config; "
             "assert 'deepspeed' not in sys.modules, sorted(k for k in sys.modules if k.startswith('deepspeed'))[:5]")
    import subprocess

    for code in (blocked, plain):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr


def test_uneven_dp_per_rank_configs_validate_and_weights_give_global_mean(monkeypatch):
    plan = _dp_plan(samples=[5, 2, 1], mbs=[2, 2, 1])
    cfgs = per_rank_configs(plan, _settings(plan))
    assert len(cfgs) == 3
    gas = [c["gradient_accumulation_steps"] for c in cfgs]
    assert gas == [math.ceil(5 / 2), math.ceil(2 / 2), 1] == [3, 1, 1]
    assert [c["train_micro_batch_size_per_gpu"] for c in cfgs] == [2, 2, 1]
    for c in cfgs:
        assert set(c) == DS_KEYS_HALF  # only keys DeepSpeed knows; no loss weights or samples
        assert c["communication_data_type"] == "fp32"  # what the cost model priced (settings.grad_dtype unset)
        parsed = _validate(c, dp_world=3, monkeypatch=monkeypatch)
        assert parsed.train_batch_size == c["train_micro_batch_size_per_gpu"] * c["gradient_accumulation_steps"] * 3
        assert parsed.zero_optimization_stage == 0 and parsed.bfloat16_config.enabled and not parsed.float16_config.enabled
        assert parsed.gradient_clipping == 1.0
    assert deepspeed_config(plan, _settings(plan)) == cfgs[0]

    # the weights: DeepSpeed averages ranks equally and divides by gas; weighted, the result is the global mean
    batches = rank_batches(plan)
    assert [b.micro_batch_sizes for b in batches] == [(2, 2, 1), (2,), (1,)]
    assert [b.loss_weight for b in batches] == pytest.approx([3 * 5 / 8, 3 * 2 / 8, 3 * 1 / 8])
    per_sample = {0: [1.0, 2.0, 3.0, 4.0, 5.0], 1: [6.0, 7.0], 2: [8.0]}  # a per-sample "gradient"
    reduced = 0.0
    for b in batches:
        xs, k, rank_sum = per_sample[b.rank], 0, 0.0
        for m, w in zip(b.micro_batch_sizes, b.micro_loss_weights):
            rank_sum += w * (sum(xs[k:k + m]) / m) / b.gradient_accumulation_steps  # engine.backward's 1/gas
            k += m
        reduced += rank_sum / 3  # allreduce mean over dp ranks
    assert reduced == pytest.approx(sum(sum(v) for v in per_sample.values()) / 8)


def test_even_plan_has_one_config_and_unit_weights(tmp_path, monkeypatch):
    plan = _dp_plan(samples=[4, 4], mbs=[2, 2], dtype="fp16", zero=2)
    cfgs = per_rank_configs(plan, _settings(plan))
    assert cfgs[0] == cfgs[1]
    assert cfgs[0]["fp16"]["enabled"] and not cfgs[0]["bf16"]["enabled"]
    parsed = _validate(cfgs[0], dp_world=2, monkeypatch=monkeypatch)
    assert parsed.float16_config.enabled and parsed.zero_optimization_stage == 2 and parsed.train_batch_size == 8
    assert [b.loss_weight for b in rank_batches(plan)] == [1.0, 1.0]
    files = write_deepspeed_files(plan, _settings(plan), None, tmp_path)
    assert sorted(p.name for p in files) == ["ds_config.json", "ds_plan_parts.json"]


def test_fp32_plan_disables_both_half_precisions(monkeypatch):
    plan = _dp_plan(samples=[2], mbs=[2], dtype="fp32")
    cfg = deepspeed_config(plan, _settings(plan), gradient_clipping=0.5)
    parsed = _validate(cfg, 1, monkeypatch)
    assert not parsed.float16_config.enabled and not parsed.bfloat16_config.enabled and parsed.gradient_clipping == 0.5


def test_zero2_uneven_dp_equalises_micro_batch_counts(monkeypatch):
    # ZeRO-2 reduces every micro-step, so ranks must agree on the count; no micro-batch grows past the plan's
    plan = _dp_plan(samples=[6, 3], mbs=[2, 3], zero=2)
    batches = rank_batches(plan)
    assert [b.micro_batch_sizes for b in batches] == [(2, 2, 2), (1, 1, 1)]
    for b, pipe in zip(batches, plan.pipelines):
        assert max(b.micro_batch_sizes) <= pipe.micro_batch_size and sum(b.micro_batch_sizes) == pipe.samples
    for c in per_rank_configs(plan, _settings(plan)):
        assert c["gradient_accumulation_steps"] == 3
        _validate(c, 2, monkeypatch)
    with pytest.raises(ConfigError, match=r"plan\.pipelines\[1\]\.samples.*be >= 3 under ZeRO 2"):
        rank_batches(_dp_plan(samples=[6, 1], mbs=[2, 1], zero=2))


def test_settings_must_match_plan():
    plan = _dp_plan(samples=[2, 2], mbs=[1, 1])
    with pytest.raises(ConfigError, match="settings.dtype"):
        deepspeed_config(plan, TrainSettings(global_batch_size=4, dtype="fp32"))
    with pytest.raises(ConfigError, match="settings.global_batch_size"):
        deepspeed_config(plan, TrainSettings(global_batch_size=8))


# -- offload ------------------------------------------------------------------------------------

def _memory_case(memory_gb: float, zero: int = 0):
    wl = _workload(4, hidden=256)
    plan = Plan(cluster="test", cluster_devices=("n0/0", "n0/1"), model=wl.fingerprint(), global_batch_size=4,
                pipelines=(Pipeline((Stage(("n0/0",), (0, 3)), Stage(("n0/1",), (3, 6))), 2, 4),),
                zero_stage=zero, mode="manual")
    settings = TrainSettings(global_batch_size=4, zero_stage=zero, memory_reserve_gb=0)
    cm = CostModel(_cluster(2, memory_gb), wl, settings)
    return plan, settings, cm, cm.score(plan)


def test_offload_exactly_when_optimizer_state_does_not_fit(monkeypatch):
    plan, settings, cm, roomy = _memory_case(40)
    assert roomy.fits
    # reference breakdown: Adam under bf16 keeps 12 bytes per parameter; stage 0 holds layers 0..2
    params0 = sum(layer.total_params for layer in cm.workload.layers[0:3])
    need0 = roomy.memory_bytes["n0/0"]
    optim0 = 12 * params0
    assert optim0 < need0
    # capacity between "all of it" and "all but the optimizer state": offload is what makes it fit
    cap = (need0 - optim0 / 2) / GiB
    plan, settings, cm, tight = _memory_case(cap)
    assert not tight.fits
    cfg = deepspeed_config(plan, settings, tight)
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "offload_param" not in cfg["zero_optimization"]
    assert cfg["zero_optimization"]["stage"] == 1  # DeepSpeed offloads only through ZeRO
    assert _validate(cfg, 1, monkeypatch).zero_config.offload_optimizer.device == "cpu"
    assert deepspeed_config(plan, settings, tight, cost_model=cm) == cfg
    assert "offload_optimizer" not in deepspeed_config(plan, settings, tight, offload=False)["zero_optimization"]
    # enough memory: no offload, unless forced
    plan, settings, cm, roomy = _memory_case(40)
    assert "offload_optimizer" not in deepspeed_config(plan, settings, roomy)["zero_optimization"]
    assert "offload_optimizer" not in deepspeed_config(plan, settings, None)["zero_optimization"]
    forced = deepspeed_config(plan, settings, roomy, offload=True)
    assert forced["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_zero3_offloads_params_only_when_optimizer_offload_is_not_enough(monkeypatch):
    wl = _workload(4, hidden=256)

    def case(memory_gb):
        plan = _dp_plan(samples=[2, 2], mbs=[2, 2], zero=3)
        plan.model = wl.fingerprint()
        settings = TrainSettings(global_batch_size=4, zero_stage=3, memory_reserve_gb=0)
        cm = CostModel(_cluster(4, memory_gb), wl, settings)
        return plan, settings, cm, cm.score(plan)

    plan, settings, cm, roomy = case(40)
    params = sum(layer.total_params for layer in wl.layers)
    need, optim, weights = roomy.memory_bytes["n0/0"], 12 * params / 2, 2 * params / 2
    plan, settings, cm, s1 = case((need - optim / 2) / GiB)
    z = deepspeed_config(plan, settings, s1, cost_model=cm)["zero_optimization"]
    assert "offload_optimizer" in z and "offload_param" not in z
    plan, settings, cm, s2 = case((need - optim - weights / 2) / GiB)
    z = deepspeed_config(plan, settings, s2, cost_model=cm)["zero_optimization"]
    assert z["offload_optimizer"]["device"] == "cpu" and z["offload_param"]["device"] == "cpu"
    _validate(deepspeed_config(plan, settings, s2, cost_model=cm), 2, monkeypatch)


# -- pipelines ----------------------------------------------------------------------------------

def test_layout_matches_pipe_data_parallel_topology():
    topology = pytest.importorskip("deepspeed.runtime.pipe.topology")
    plan = _pp_plan([[0, 2, 6], [0, 2, 6], [0, 2, 6]], samples=[4, 4, 4])
    layout = rank_layout(plan)
    topo = topology.PipeDataParallelTopology(num_pp=2, num_dp=3)
    assert [ra.rank for ra in layout] == list(range(6))
    for ra in layout:
        coord = topo.get_coord(ra.rank)
        assert (coord.pipe, coord.data) == (ra.stage, ra.pipeline)
        assert ra.device == plan.pipelines[ra.pipeline].stages[ra.stage].devices[0]
    assert [ra.device for ra in layout] == ["n0/0", "n0/2", "n0/4", "n0/1", "n0/3", "n0/5"]
    assert pipeline_parts(plan) == [0, 2, 6]


def test_pure_dp_layout_is_plan_order():
    plan = _dp_plan(samples=[3, 1], mbs=[1, 1])
    assert [(ra.rank, ra.device, ra.pipeline, ra.stage) for ra in rank_layout(plan)] == [
        (0, "n0/0", 0, 0), (1, "n0/1", 1, 0)]


def test_asymmetric_boundaries_are_refused_with_names():
    plan = _pp_plan([[0, 2, 6], [0, 4, 6]], samples=[2, 2])
    with pytest.raises(ConfigError) as err:
        pipeline_parts(plan)
    msg = str(err.value)
    assert "plan.pipelines[1]" in msg and "[0, 2, 6]" in msg and "[0, 4, 6]" in msg


def test_pipeline_plan_with_zero2_is_refused():
    plan = _pp_plan([[0, 4, 6]], samples=[4], zero=2)
    with pytest.raises(ConfigError, match="`plan.zero_stage` is 2; it must be 0 or 1 .*pipeline engine"):
        deepspeed_config(plan, _settings(plan))


def test_pipeline_plan_config_validates(monkeypatch, tmp_path):
    plan = _pp_plan([[0, 4, 6], [0, 4, 6]], samples=[6, 2], mbs=2, zero=1)
    cfgs = per_rank_configs(plan, _settings(plan))
    # stages of one pipeline share its micro-batches; pipelines differ
    assert [c["gradient_accumulation_steps"] for c in cfgs] == [3, 1, 3, 1]
    for c in cfgs:
        _validate(c, 2, monkeypatch)
    files = write_deepspeed_files(plan, _settings(plan), None, tmp_path)
    assert sorted(p.name for p in files) == ["ds_config.json", "ds_config.rank0.json", "ds_config.rank1.json",
                                              "ds_config.rank2.json", "ds_config.rank3.json", "ds_plan_parts.json"]
    side = json.loads((tmp_path / "ds_plan_parts.json").read_text())
    assert side["parts"] == [0, 4, 6]
    assert [r["device"] for r in side["ranks"]] == ["n0/0", "n0/2", "n0/1", "n0/3"]
    assert side["loss_weights"]["1"]["loss_weight"] == pytest.approx(2 * 2 / 8)
    assert json.loads((tmp_path / "ds_config.rank1.json").read_text()) == cfgs[1]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_hetero_pipeline_module_is_lazy_and_checks_parts():
    import het_strategy.ds_runtime.ds_config as m

    with pytest.raises(ConfigError, match="num_stages"):
        m.hetero_pipeline_module([object()] * 6, [0, 4, 6], num_stages=3)
    with pytest.raises(ConfigError, match="end at the number of layers"):
        m._check_parts([0, 4, 5], 6, 2)
    with pytest.raises(ConfigError, match="increase strictly"):
        m._check_parts([0, 4, 4, 6], 6, 3)
    pytest.importorskip("deepspeed")
    from deepspeed.pipe import PipelineModule

    assert issubclass(m.HeteroPipelineModule, PipelineModule)


# -- experts ------------------------------------------------------------------------------------

def test_expert_map_by_rank():
    plan = _dp_plan(samples=[2, 2], mbs=[1, 1], experts={1: {"n0/1": [3, 2], "n0/0": [0, 1]}, 3: {"n0/0": [0, 1, 2, 3]}})
    assert expert_map(plan) == {0: {1: [0, 1], 3: [0, 1, 2, 3]}, 1: {1: [2, 3]}}
    bad = _dp_plan(samples=[2, 2], mbs=[1, 1], experts={1: {"n0/3": [0]}})
    with pytest.raises(ConfigError, match="n0/3"):
        expert_map(bad)


def test_fp32_zero0_pipeline_with_clipping_warns():
    plan = _pp_plan([[0, 4, 6]], samples=[4])
    plan.dtype = "fp32"
    with pytest.warns(UserWarning, match="first stage's norm"):
        deepspeed_config(plan, _settings(plan))
    plan.zero_stage = 1
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        deepspeed_config(plan, _settings(plan))
