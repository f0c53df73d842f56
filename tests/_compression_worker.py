"""Helpers for the compression tests: fork a few gloo ranks, run a function on each, collect results."""

import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world: int, port: int, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=60))
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, *args: Any, timeout_s: float = 90.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` forked gloo ranks; return each rank's result."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(fn, world, _free_port(), out_dir, args), nprocs=world,
                                 join=False, start_method="fork")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{world} ranks did not finish in {timeout_s} s")
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


class MixedNet(torch.nn.Module):
    """Two large 2-D layers (eligible), a small one and 1-D parameters (never compressed)."""

    def __init__(self, width: int = 96) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(32, width)
        self.fc2 = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.fc2(torch.relu(self.fc1(x))))))
