"""Ranks of the sharded-checkpoint tests (``test_fsdp_checkpoint.py``), started by ``run_spawned_ranks``.

``flat_save`` / ``flat_load`` run on ``FlatModel``, an object with exactly the ``ShardedModel`` attributes the
checkpoint reads (``units``, each with ``name``, ``numel``, ``sizes``, ``offsets`` and a 1-D ``shard``): Adam
steps on gradients that are a function of the global element index only, so every layout takes the same steps.
Each rank writes ``rank{r}.json``: its sizes and offsets, its shards and optimizer state at the save (or just
after the load) and after one more step.
"""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from het_strategy.core.shard_sizes import shard_offsets, shard_sizes
from het_strategy.fsdp.checkpoint import export_full, load_sharded, save_sharded

TIMEOUT_S = 60
UNITS = {"blocks.0": 23, "blocks.1": 23, "root": 2}
"""Unit name -> flat element count (``root``'s 2 elements leave a rank with none under 4:2:1)."""
SAVED_STEPS = 3
LRS = {"blocks": 0.01, "root": 0.003}
"""Adam's learning rate per parameter group: the blocks, and the root unit."""
EXTRA = {"loop": {"global_step": SAVED_STEPS, "epoch": 0}, "plan": {"mode": "fsdp", "shards": [4 / 7, 2 / 7, 1 / 7]}}


class FlatUnit:
    """One unit as ``het_strategy.fsdp`` describes it: this rank's contiguous piece of a flat parameter."""

    def __init__(self, name: str, full: torch.Tensor, fractions: list[float], rank: int) -> None:
        self.name = name
        self.param_names = [f"{name}.weight"]
        self.shapes = [full.shape]
        self.numel = full.numel()
        self.sizes = shard_sizes(self.numel, fractions)
        self.offsets = shard_offsets(self.sizes)
        start = self.offsets[rank]
        self.shard = torch.nn.Parameter(full[start:start + self.sizes[rank]].clone())


class FlatModel:
    """The units of a sharded model, nothing else."""

    def __init__(self, fractions: list[float], rank: int, fill: float | None = None) -> None:
        self.units = [FlatUnit(name, _initial(i, n) if fill is None else torch.full((n,), fill, dtype=torch.float64),
                               fractions, rank) for i, (name, n) in enumerate(UNITS.items())]


def _initial(unit: int, numel: int) -> torch.Tensor:
    return torch.sin(torch.arange(numel, dtype=torch.float64) * 0.7 + unit)


def _gradient(unit: int, numel: int, step: int) -> torch.Tensor:
    return torch.cos(torch.arange(numel, dtype=torch.float64) * 0.37 + 1.3 * step + unit) * (1 + step)


def optimizer_for(name: str, model: FlatModel, lrs: dict[str, float]) -> torch.optim.Optimizer:
    """``adam`` (moments and a step count per shard) or ``sgd`` (a momentum buffer), one parameter group for the
    blocks and one for the root unit, at ``lrs``."""
    blocks = [u.shard for u in model.units if u.name != "root"]
    root = [u.shard for u in model.units if u.name == "root"]
    groups = [{"params": blocks, "lr": lrs["blocks"]}, {"params": root, "lr": lrs["root"]}]
    if name == "sgd":
        return torch.optim.SGD(groups, momentum=0.9, weight_decay=0.01)
    return torch.optim.Adam(groups, weight_decay=0.01, foreach=False)


def _step(model: FlatModel, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    for i, unit in enumerate(model.units):
        start = unit.offsets[rank]
        unit.shard.grad = _gradient(i, unit.numel, step)[start:start + unit.sizes[rank]].clone()
    opt.step()


def _record(model: FlatModel, opt: torch.optim.Optimizer, rank: int) -> dict[str, Any]:
    out = {}
    for unit in model.units:
        state = {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in opt.state.get(unit.shard, {}).items()}
        out[unit.name] = {"offset": unit.offsets[rank], "shard": unit.shard.detach().tolist(), "state": state}
    return out


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))


def _run(body, rank: int, world: int, port: int, out_dir: str) -> None:
    out = Path(out_dir)
    try:
        _init(rank, world, port)
        result = body(rank)
        result["rank"] = rank
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def flat_save(fractions: list[float], optimizer: str, ckpt: str, async_save: bool, rank: int, port: int,
              cache_dir: str, out_dir: str) -> None:
    """``SAVED_STEPS`` Adam steps, save; the next step (at once when ``async_save``: while the files are
    written, the state changing under the save); record the state at the save and after the next step."""

    def body(rank: int) -> dict[str, Any]:
        model = FlatModel(fractions, rank)
        opt = optimizer_for(optimizer, model, LRS)
        for step in range(SAVED_STEPS):
            _step(model, opt, step, rank)
        saved = _record(model, opt, rank)
        future = save_sharded(model, opt, ckpt, async_save=async_save, extra=EXTRA)
        _step(model, opt, SAVED_STEPS, rank)
        if future is not None:
            future.result()
        return {"saved": saved, "after": _record(model, opt, rank), "future": future is not None}

    _run(body, rank, len(fractions), port, out_dir)


def flat_load(fractions: list[float], optimizer: str, ckpt: str, rank: int, port: int, cache_dir: str,
              out_dir: str) -> None:
    """A model filled with zeros and an Adam with other learning rates, load, record; one more step, record."""

    def body(rank: int) -> dict[str, Any]:
        model = FlatModel(fractions, rank, fill=0.0)
        opt = optimizer_for(optimizer, model, {"blocks": 1.0, "root": 1.0})  # the checkpoint's lrs replace these
        extra = load_sharded(model, opt, ckpt)
        loaded = _record(model, opt, rank)
        _step(model, opt, SAVED_STEPS, rank)
        return {"loaded": loaded, "after": _record(model, opt, rank), "extra": extra,
                "lrs": [g["lr"] for g in opt.param_groups]}

    _run(body, rank, len(fractions), port, out_dir)


# -- a model sharded by het_strategy.fsdp.shard_model ---------------------------------------------------------
WIDTH = 6
ROWS = 12
"""The global batch's rows, split among the ranks by their shares."""


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class _Net(torch.nn.Module):
    """Root parameters (``inp``, ``head``) around two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, WIDTH)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(2))
        self.head = torch.nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _sharded_net(seed: int, fractions: list[float], rank: int) -> tuple[Any, torch.nn.Module]:
    from het_strategy.fsdp.sharded_model import shard_model

    torch.manual_seed(seed)
    net = _Net().double()
    return shard_model(net, list(net.blocks), fractions, rank, len(fractions)), net


def _train_step(sharded: Any, opt: torch.optim.Optimizer, step: int, rank: int, shares: list[int]) -> None:
    """One step on this rank's rows of the global batch, its loss weighted by ``n_r * world / N`` (the reduced
    gradient is then the whole batch's mean)."""
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(ROWS, 4, generator=g, dtype=torch.float64), torch.randn(ROWS, 3, generator=g, dtype=torch.float64)
    start, rows = sum(shares[:rank]), shares[rank]
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(sharded(x[start:start + rows]), y[start:start + rows])
    (loss * (rows * len(shares) / ROWS)).backward()
    opt.step()


def _full_state(sharded: Any) -> dict[str, list[float]]:
    return {k: v.flatten().tolist() for k, v in sharded.full_state_dict(rank0_only=False).items()}


def model_save(fractions: list[float], shares: list[int], steps: int, ckpt: str, rank: int, port: int,
               cache_dir: str, out_dir: str) -> None:
    """``steps`` Adam steps of the sharded ``_Net``, save (and export the full state dict to ``<ckpt>.pt``), one
    more step; the full state at the save and after."""

    def body(rank: int) -> dict[str, Any]:
        sharded, net = _sharded_net(0, fractions, rank)
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        for step in range(steps):
            _train_step(sharded, opt, step, rank, shares)
        save_sharded(sharded, opt, ckpt, extra={"global_step": steps})
        export_full(sharded, ckpt + ".pt")
        saved = _full_state(sharded)
        _train_step(sharded, opt, steps, rank, shares)
        return {"saved": saved, "after": _full_state(sharded)}

    _run(body, rank, len(fractions), port, out_dir)


def model_load(fractions: list[float], shares: list[int], ckpt: str, rank: int, port: int, cache_dir: str,
               out_dir: str) -> None:
    """Another initial ``_Net`` (seed 1) sharded by ``fractions``, an Adam with another learning rate, load, one
    step; the full state after the load and after the step."""

    def body(rank: int) -> dict[str, Any]:
        sharded, net = _sharded_net(1, fractions, rank)
        opt = torch.optim.Adam(net.parameters(), lr=0.5)
        extra = load_sharded(sharded, opt, ckpt)
        loaded = _full_state(sharded)
        _train_step(sharded, opt, extra["global_step"], rank, shares)
        return {"loaded": loaded, "after": _full_state(sharded), "extra": extra,
                "sizes": {u.name: u.sizes for u in sharded.units}}

    _run(body, rank, len(fractions), port, out_dir)
