"""``strategy="hetero_fsdp"`` (``HeteroFSDPStrategy``): its construction checks, and on forked CPU ranks the exact
update of uneven shards and shares, on both Lightning packages, and a checkpoint resumed on another world size."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

from het_strategy.core.errors import ConfigError  # noqa: E402


def _reference(steps: list[list[int]]) -> dict[str, list[float]]:
    """One process, float64: the same SGD with momentum on each step's samples over all ranks."""
    from tests._strategy_worker import IndexedData, make_net
    from tests._fsdp_strategy_worker import N

    data, net = IndexedData(N), make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for indices in steps:
        opt.zero_grad()
        (net(data.x[indices]).squeeze(-1) - data.y[indices]).pow(2).mean().backward()
        opt.step()
    return {f"net.{k}": v.flatten().tolist() for k, v in net.state_dict().items()}


def _steps(ranks: list[dict]) -> list[list[int]]:
    merged: dict[int, list[int]] = {}
    for record in ranks:
        for row in record["rows"]:
            merged.setdefault(row["step"], []).extend(row["indices"])
    return [sorted(merged[s]) for s in sorted(merged)]


def test_it_needs_a_global_batch_and_refuses_what_it_cannot_run() -> None:
    import het_strategy

    with pytest.raises(ConfigError, match="`global_batch_size` is null; it must be given for hetero_fsdp"):
        het_strategy.HeteroFSDPStrategy(cluster="auto")
    with pytest.raises(ConfigError, match="`compression` is 'q4'; it must be left out for hetero_fsdp"):
        het_strategy.HeteroFSDPStrategy(cluster="auto", global_batch_size=8, compression="q4")
    with pytest.raises(ConfigError, match="`units` is 'net'; it must be a list"):
        het_strategy.HeteroFSDPStrategy(cluster="auto", global_batch_size=8, units="net")


def test_fp16_and_per_device_precision_are_refused_when_the_trainer_is_built() -> None:
    import het_strategy
    import lightning.pytorch as pl

    for precision in ("16-true", het_strategy.PerDevicePrecision()):  # (16-mixed is bf16-mixed on a CPU)
        strategy = het_strategy.HeteroFSDPStrategy(cluster="auto", global_batch_size=8)
        kwargs = {"plugins": [precision]} if not isinstance(precision, str) else {"precision": precision}
        with pytest.raises(ConfigError, match="`Trainer.precision` is '(16-true|per_device)'; it must be one of"):
            pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, **kwargs)


def test_the_name_is_registered_on_both_packages() -> None:
    import het_strategy  # noqa: F401
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["hetero_fsdp"]["strategy"].__name__ == "HeteroFSDPStrategy"
    pl = pytest.importorskip("pytorch_lightning")
    assert pl.strategies.StrategyRegistry["hetero_fsdp"]["strategy"].__name__ == "HeteroFSDPStrategyPL"


@pytest.mark.multiprocess
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (Lightning's fork launcher)")
@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_uneven_shards_and_shares_train_the_single_process_update(package, tmp_path, fresh_master_port) -> None:
    """Memories 4 : 2 : 1, speeds 1 : 1 : 0.5: each rank holds 4/7, 2/7, 1/7 of every unit and trains 4, 4, 2
    samples a step; after 5 steps the gathered model equals one process's to 1e-10."""
    if package == "pytorch_lightning":
        pytest.importorskip("pytorch_lightning")
    from tests._fsdp_strategy_worker import fit

    ranks = fit(tmp_path, package)
    assert ranks[0]["shares"] == [4, 4, 2]
    assert [round(ranks[0]["shards"][d] * 7, 6) for d in ("big", "mid", "small")] == [4, 2, 1]
    assert [r["own_elements"] for r in ranks] == [23 + 5, 11 + 3, 6 + 1]  # units of 40 and 9 elements, each 4:2:1
    assert len(_steps(ranks)) == 5
    reference = _reference(_steps(ranks))
    for name, values in ranks[0]["full"].items():
        assert values == pytest.approx(reference[name], abs=1e-10), name
    for name, values in ranks[0]["main_state"].items():  # the whole trained module, handed back after fit
        assert values == pytest.approx(reference[name], abs=1e-10), name


@pytest.mark.multiprocess
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (Lightning's fork launcher)")
def test_a_checkpoint_of_three_ranks_resumes_on_two_with_the_same_next_update(tmp_path, monkeypatch,
                                                                             fresh_master_port) -> None:
    from het_strategy.emulation.local_ranks import free_port
    from tests._fsdp_strategy_worker import TWO_CLUSTER, fit

    first = fit(tmp_path / "three", max_steps=3, save_to=tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / ".metadata").is_file()
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    resumed = fit(tmp_path / "two", cluster=TWO_CLUSTER, max_steps=4, resume_from=tmp_path / "ckpt")
    steps = _steps(first) + _steps(resumed)
    assert len(steps) == 4 and steps[3] not in steps[:3]  # the resumed run trained the epoch's next batch
    reference = _reference(steps)
    for name, values in resumed[0]["full"].items():
        assert values == pytest.approx(reference[name], abs=1e-10), name

    # trainer.validate(ckpt_path=) on 2 ranks: the 3-step checkpoint read into a whole module (over the 4-step
    # values it held) evaluates as the 3-step model does in one process
    from tests._fsdp_strategy_worker import validate
    from tests._strategy_worker import IndexedData, make_net

    three = _reference(steps[:3])
    net, data = make_net(), IndexedData(12, seed=3)
    net.load_state_dict({k.removeprefix("net."): torch.tensor(v, dtype=torch.float64).view_as(p)
                         for (k, v), p in zip(three.items(), net.state_dict().values())})
    with torch.no_grad():
        expected = (net(data.x).squeeze(-1) - data.y).pow(2).mean().item()  # 2 ranks x 3 batches of 2: all 12
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    got = validate(tmp_path / "validate", resumed[0]["main_state"], cluster=TWO_CLUSTER, ckpt_path=tmp_path / "ckpt")
    assert got == pytest.approx(expected, rel=1e-10)


def test_a_call_of_the_module_inside_its_own_call_is_part_of_the_outer_one() -> None:
    """A LightningModule's ``training_step`` that calls ``self(x)``: the inner call neither frees nor gathers again
    (one rank, one unit of the whole model: the root stays gathered until the backward)."""
    import torch.distributed as dist
    from torch import nn

    from het_strategy.emulation.local_ranks import free_port
    from het_strategy.fsdp import shard_model

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 1).double()

        def forward(self, x: torch.Tensor, nested: bool = False) -> torch.Tensor:
            return self(x) if nested else self.lin(x)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        module, plain = Outer(), Outer()
        plain.load_state_dict(module.state_dict())
        sharded = shard_model(module, [], [1.0], 0, 1)
        x = torch.randn(4, 3, dtype=torch.float64)
        module(x, nested=True).sum().backward()
        plain(x).sum().backward()
        assert sharded.num_gathers == 1
        assert torch.equal(sharded.units[0].shard.grad, torch.cat([p.grad.flatten() for p in plain.parameters()]))
    finally:
        dist.destroy_process_group()


def _two_devices(memory_gb: float) -> object:
    from het_strategy.core.cluster import load_cluster

    return load_cluster({"name": "two", "nodes": [{"name": "n", "devices": [
        {"name": "fast", "type": "CPU", "tflops": {"fp32": 2.0}, "memory_gb": 4 * memory_gb},
        {"name": "slow", "type": "CPU", "tflops": {"fp32": 1.0}, "memory_gb": memory_gb}]}]})


def test_the_strategy_plans_whole_shares_and_says_how_to_run_micro_steps() -> None:
    """The Lightning strategy runs a rank's share in one forward: its plan has one micro-batch per rank, and where
    that does not fit the planner's refusal (naming the device and its need) adds Lightning's accumulation."""
    from het_strategy.core.workload import load_workload
    from het_strategy.strategy.fsdp_run import FSDPExtension

    workload = load_workload("tiny_gpt", "fp32")
    plan = FSDPExtension(None, True, False).make_plan(_two_devices(1.0), workload, 64, "fp32", None, None)
    assert [p.samples for p in plan.pipelines] == [43, 21]  # speeds 2 : 1
    assert all(p.micro_batch_size >= p.samples for p in plan.pipelines)
    assert plan.shards["fast"] == pytest.approx(4 * plan.shards["slow"], rel=0.2)  # memories 4 : 1, less activations
    with pytest.raises(ConfigError, match=r"`plan.shards.fast` is .*device fast \(rank 0\).*accumulate_grad_batches"):
        FSDPExtension(None, True, False).make_plan(_two_devices(0.05), workload, 64, "fp32", None, None)
