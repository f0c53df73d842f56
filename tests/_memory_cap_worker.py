"""Rank function of ``test_memory_cap.py``'s two-rank case (run by ``run_local_ranks``): a small sharded model's
counted parts after its forward, with uneven shards (a prefetched gather's padded buffers in flight)."""

from __future__ import annotations

import torch
from torch import nn

from het_strategy.emulation.memory_cap import MemoryMeter
from het_strategy.fsdp import shard_model


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def counted_after_forward(rank: int, world: int, fractions: list[float]) -> dict:
    torch.manual_seed(0)
    model = Net().double()
    sharded = shard_model(model, list(model.blocks), fractions, rank, world)
    meter = MemoryMeter(rank=rank, sharded=sharded)
    with meter.track():
        loss = sharded(torch.randn(5, 4, dtype=torch.float64)).pow(2).sum()
    after_forward = meter.parts()
    loss.backward()
    return {"after_forward": after_forward, "after_backward": meter.parts(),
            "sizes": {u.name: u.sizes for u in sharded.units}}
