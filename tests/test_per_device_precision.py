"""Per-device precision: the planning side (catalog dtypes, cost model, plan file, table, rules, bad input), the
plugin's parts, and a 2-rank ``hetero`` run with one bf16 and one fp16 rank against the fp32 reference."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from het_strategy.core.cluster import load_cluster
from het_strategy.core.cost_model import CostModel
from het_strategy.core.dtypes import Dtype, fast_dtype
from het_strategy.core.errors import ConfigError
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.core.runtime_rules import Runtime, holds_own_masters, runs_per_replica, runtime_problems
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import load_workload
from het_strategy.planning import PlanRequest, plan
from het_strategy.planning.structure import device_dtypes
from het_strategy.report.table import plan_table

A100_V100 = {"name": "a100_v100", "nodes": [{"name": "n", "devices": [{"type": "A100-40GB", "count": 2},
                                                                     {"type": "V100-16GB", "count": 2}]}]}


def test_each_catalog_type_computes_in_its_fast_16_bit_dtype() -> None:
    assert fast_dtype({"fp32": 19.5, "fp16": 312, "bf16": 312}) == Dtype.bf16  # a tie keeps bf16's range
    assert fast_dtype({"fp32": 15.7, "fp16": 125}) == Dtype.fp16  # V100, T4: no bf16 units
    assert fast_dtype({"fp32": 1.0}) == Dtype.fp32
    cluster = load_cluster(A100_V100)
    assert {d.type: d.compute_dtype("per_device") for d in cluster.devices} == {"A100-40GB": "bf16",
                                                                                "V100-16GB": "fp16"}
    v100 = cluster.devices[2]
    # uniform bf16 runs a V100 at its fp32 rate; per_device at its fp16 rate
    assert v100.flops_per_second("per_device") == v100.flops_per_second("fp16")
    assert v100.flops_per_second("per_device") / v100.flops_per_second("bf16") == pytest.approx(125 / 15.7)


def test_the_planner_prices_each_device_in_its_dtype_and_the_plan_records_it(tmp_path: Path) -> None:
    cluster, workload = load_cluster(A100_V100), load_workload("gpt_small", dtype="bf16")
    chosen = {}
    for dtype in ("bf16", "per_device"):
        result = plan(cluster, workload, TrainSettings(global_batch_size=32, dtype=dtype, idle_devices=False),
                      PlanRequest(mode="dp"))
        chosen[dtype] = result
    per_device = chosen["per_device"].plan
    assert per_device.device_dtypes == {"n/0": "bf16", "n/1": "bf16", "n/2": "fp16", "n/3": "fp16"}
    assert per_device.compute_dtype("n/2") == Dtype.fp16 and chosen["bf16"].plan.device_dtypes == {}
    # the V100s take a larger share once they compute at their fp16 rate, and the step is faster
    shares = {dtype: chosen[dtype].plan.rank_shares() for dtype in chosen}
    assert shares["per_device"]["n/2"] > shares["bf16"]["n/2"]
    assert chosen["per_device"].score.step_time_s < chosen["bf16"].score.step_time_s
    # the plan file carries the dtypes and reads back equal
    path = per_device.save(tmp_path / "plan.json")
    assert json.loads(path.read_text())["device_dtypes"]["n/3"] == "fp16"
    assert Plan.load(path).device_dtypes == per_device.device_dtypes
    table = plan_table(per_device, chosen["per_device"].score, cluster)
    assert "A100-40GB bf16" in table and "V100-16GB fp16" in table


def test_device_dtypes_override_a_type_and_the_cost_model_follows() -> None:
    cluster, workload = load_cluster(A100_V100), load_workload("gpt_small", dtype="bf16")
    settings = TrainSettings(global_batch_size=32, dtype="per_device", device_dtypes={"V100": "fp32"})
    assert settings.device_dtypes == {"V100-16GB": "fp32"}  # an alias becomes the catalog name
    cm = CostModel(cluster, workload, settings)
    assert device_dtypes(cm)["n/2"] == "fp32" and device_dtypes(cm)["n/0"] == "bf16"


@pytest.mark.parametrize(("make", "message"), [
    (lambda: TrainSettings(8, dtype="per_device", device_dtypes={"X100": "bf16"}),
     "`settings.device_dtypes` is 'X100'; it must name device types of the catalog"),
    (lambda: TrainSettings(8, dtype="per_device", device_dtypes={"CPU": "fp16"}),
     "`settings.device_dtypes.CPU` is 'fp16'; it must be a dtype CPU has a rate for (fp32, bf16)"),
    (lambda: TrainSettings(8, dtype="per_device", device_dtypes={"T4": "per_device"}),
     "`settings.device_dtypes.T4` is 'per_device'; it must be one of fp32, fp16, bf16"),
    (lambda: TrainSettings(8, dtype="bf16", device_dtypes={"T4": "fp16"}),
     "`settings.device_dtypes` is {'T4': 'fp16'}; it must be empty unless settings.dtype is per_device"),
    (lambda: Plan("c", ("a", "b"), {"num_layers": 1}, 2, (Pipeline((Stage(("a",), (0, 1)),), 1, 1),
                                                         Pipeline((Stage(("b",), (0, 1)),), 1, 1)),
                  dtype="per_device", device_dtypes={"a": "bf16"}),
     "`plan.device_dtypes` is {'a': 'bf16'}; it must name the dtype of every used device"),
])
def test_bad_per_device_input_names_the_field(make, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as err:
        make()
    assert str(err.value).startswith(message)


def test_hetero_deepspeed_runs_a_per_device_pipeline_but_not_a_tp_group_of_two_dtypes() -> None:
    # a pipeline from a bf16 stage to an fp16 one runs per replica, over the runtime's own fp32 masters
    p = Plan("c", ("a", "b", "c"), {"num_layers": 2}, 2, (Pipeline((Stage(("a",), (0, 1)), Stage(("b",), (1, 2))),
                                                                  1, 2),),
             dtype="per_device", device_dtypes={"a": "bf16", "b": "fp16"})
    assert runtime_problems(p, Runtime.deepspeed) == [] and runs_per_replica(p) and holds_own_masters(p)
    assert runtime_problems(dataclasses.replace(p, zero_stage=1), Runtime.deepspeed) == []
    assert {pr.field for pr in runtime_problems(dataclasses.replace(p, zero_stage=2), Runtime.deepspeed)} == \
        {"plan.zero_stage"}  # a per-replica plan's sharding splits the optimizer state only
    # a tensor-parallel stage all-reduces one dtype: refused in one rule naming the stage's devices
    tp = dataclasses.replace(p, pipelines=(Pipeline((Stage(("a", "b"), (0, 2)),), 1, 2),))
    (problem,) = runtime_problems(tp, Runtime.deepspeed)
    assert problem.field == "plan.pipelines[0].stages[0].devices" and "compute in bf16, fp16" in str(problem)


# -- the plugin's parts --------------------------------------------------------------------------------------------
def test_the_plugin_unscales_an_fp16_bucket_and_keeps_a_restored_scale() -> None:
    from het_strategy.strategy.per_device_scaling import PerDeviceScaling

    with pytest.raises(ConfigError, match="PerDevicePrecision.init_scale"):
        PerDeviceScaling(init_scale=1000.0)
    plugin = PerDeviceScaling(init_scale=2.0**10)
    plugin.use("fp16", torch.device("cpu"))
    assert plugin.scale == 1024.0
    bucket = torch.tensor([1024.0, -2048.0])
    plugin.prepare_bucket(bucket)
    assert bucket.tolist() == [1.0, -2.0] and not plugin._overflow_anywhere()
    plugin.prepare_bucket(torch.tensor([float("inf")]))
    assert plugin._overflow_anywhere() and not plugin._overflow_anywhere()  # noted once, then reset
    bf16 = PerDeviceScaling()
    bf16.use("bf16", torch.device("cpu"))
    assert bf16.scale == 1.0
    # a checkpoint's scale survives the strategy telling the rank its dtype after the restore ...
    restored = PerDeviceScaling()
    restored.load_state_dict({"dtype": "fp16", "scale": 256.0, "clean_steps": 7})
    restored.use("fp16", torch.device("cpu"))
    assert (restored.scale, restored.clean_steps) == (256.0, 7)
    # ... but not a new plan that makes the rank bf16
    moved = PerDeviceScaling()
    moved.load_state_dict({"dtype": "fp16", "scale": 256.0, "clean_steps": 7})
    moved.use("bf16", torch.device("cpu"))
    assert moved.scale == 1.0


# -- two ranks, one bf16 and one fp16 --------------------------------------------------------------------------------
pl = pytest.importorskip("lightning.pytorch")

# Two CPU devices: one with only bf16 units, one with only fp16 units, at equal rates (shares 4 / 4 of 8).
MIXED_UNITS = {"name": "bf16_and_fp16", "inter_node_bandwidth_gbs": 10, "nodes": [{"name": "local", "devices": [
    {"name": "bf", "type": "CPU", "tflops": {"fp32": 1.0, "bf16": 4.0}},
    {"name": "hf", "type": "CPU", "tflops": {"fp32": 1.0, "fp16": 4.0}}]}]}


def _run(tmp: Path, inject_at: int | None) -> list[dict]:
    """Fit 4 steps of global batch 8 on the two ranks; rank files hold each rank's rows, dtype, scale, weights."""
    from het_strategy import HeteroStrategy, PerDevicePrecision
    from tests._strategy_worker import IndexedData, Recorder

    class Injecting(Recorder):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            loss = super().training_step(batch, batch_idx)
            if inject_at == batch_idx and self.global_rank == 1:
                loss = loss * float("inf")  # this rank's gradients overflow
            return loss

        def on_train_end(self) -> None:
            super().on_train_end()
            plugin = self.trainer.strategy.precision_plugin.scaling
            (Path(self.out_dir) / f"state{self.global_rank}.json").write_text(json.dumps({
                "dtype": str(plugin.dtype), "scale": plugin.scale, "skipped": plugin.skipped_steps,
                "params": [p.detach().flatten().tolist() for p in self.net.parameters()]}))

    torch.set_num_threads(1)
    out = tmp / "rows"
    out.mkdir()
    model = Injecting(str(out), dtype=torch.float32)
    strategy = HeteroStrategy(cluster=MIXED_UNITS, global_batch_size=8, start_method="fork", verbose=False,
                              timeout=__import__("datetime").timedelta(seconds=120))
    trainer = pl.Trainer(default_root_dir=str(tmp), accelerator="cpu", devices=2, strategy=strategy,
                         plugins=[PerDevicePrecision(init_scale=2.0**10)], max_steps=4, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0)
    trainer.fit(model, torch.utils.data.DataLoader(IndexedData(32), batch_size=4, shuffle=True))
    return [{"rows": json.loads((out / f"rank{r}.json").read_text()),
             **json.loads((out / f"state{r}.json").read_text())} for r in range(2)]


def _reference(ranks: list[dict], skip: int | None) -> list[torch.Tensor]:
    """fp32 single process on the same global batches (step ``skip`` not taken)."""
    from tests._strategy_worker import IndexedData, make_net

    data = IndexedData(32)
    net = make_net().float()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        if step == skip:
            continue
        idx = [i for r in ranks for i in r["rows"][step]["indices"][: r["rows"][step]["counted"]]]
        opt.zero_grad()
        x, y = data.x[idx].float(), data.y[idx].float()
        (net(x).squeeze(-1) - y).pow(2).mean().backward()
        opt.step()
    return [p.detach().flatten() for p in net.parameters()]


@pytest.mark.multiprocess
@pytest.mark.usefixtures("fresh_master_port")
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (Lightning's fork launcher)")
@pytest.mark.parametrize("inject_at", [None, 1])
def test_a_bf16_rank_and_an_fp16_rank_make_one_update_that_tracks_fp32(tmp_path: Path, inject_at: int | None) -> None:
    """Rank 0 computes in bf16, rank 1 in fp16 with a loss scale of 2**10 that it removes before the fp32
    all-reduce: both ranks end with the same weights, within 16-bit rounding of the fp32 single-process update
    (without the unscaling rank 1's gradient would weigh 1024x).  An inf on rank 1 skips that step on both ranks
    and halves rank 1's scale."""
    ranks = _run(tmp_path, inject_at)
    assert [r["dtype"] for r in ranks] == ["bf16", "fp16"]
    assert [r["rows"][0]["counted"] for r in ranks] == [4, 4]
    assert ranks[0]["params"] == ranks[1]["params"]  # one update on every rank
    assert [r["skipped"] for r in ranks] == ([0, 0] if inject_at is None else [1, 1])
    assert ranks[1]["scale"] == (1024.0 if inject_at is None else 512.0) and ranks[0]["scale"] == 1.0
    ref = _reference(ranks, inject_at)
    for got, want in zip(ranks[0]["params"], ref):
        torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=3e-2)
    if inject_at is not None:  # and it is not the update of a run that took the step
        taken = _reference(ranks, None)
        assert max((torch.tensor(g) - w).abs().max().item() for g, w in zip(ranks[0]["params"], taken)) > 3e-2
