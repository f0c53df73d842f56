"""Shared pieces of the compression benchmarks: the models, their data, one DDP training step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from het_strategy.compression import CompressionState, compression_hook


def char_gpt(seq_len: int = 64, hidden: int = 128) -> torch.nn.Module:
    """The main job's char GPT (4 blocks, hidden 128 unless ``hidden``), as a plain module."""
    from het_strategy.demo.char_gpt import CharGPT

    return CharGPT(num_layers=4, hidden_size=hidden, num_heads=4, seq_len=seq_len)


def mlp(inputs: int = 64, hidden: int = 512, classes: int = 10, depth: int = 3) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    width = inputs
    for _ in range(depth):
        layers += [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
        width = hidden
    layers.append(torch.nn.Linear(width, classes))
    return torch.nn.Sequential(*layers)


def wrap(module: torch.nn.Module, compression: Any) -> tuple[DDP, CompressionState | None]:
    """DDP around ``module``; ``compression=None`` keeps DDP's own allreduce (no hook at all)."""
    model = DDP(module)
    if compression is None:
        return model, None
    state = CompressionState(model, compression)
    model.register_comm_hook(state, compression_hook)
    return model, state


def lm_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def char_batches(seq_len: int, batch: int, rank: int, world: int, steps: int, seed: int,
                 split: str = "train") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's slices of ``steps`` global batches of ``batch x world`` sequences (same order every run)."""
    from het_strategy.demo.stdlib_text import CharDataset, stdlib_corpus

    corpus = stdlib_corpus(max_bytes=2_000_000, val_fraction=0.1, seed=0)
    data = CharDataset(corpus.train if split == "train" else corpus.val, seq_len)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        idx = torch.randint(len(data), (batch * world,), generator=gen)[rank * batch:(rank + 1) * batch]
        xs, ys = zip(*(data[int(i)] for i in idx))
        out.append((torch.stack(xs), torch.stack(ys)))
    return out


def interleaved_steps(replicas: dict[str, tuple], batches: list) -> dict[str, list[float]]:
    """Train every replica (``label -> (model, state, optimizer)``) one step per batch, alternating their order
    each step so machine noise falls on all alike; each step starts after a barrier and its time is the slowest
    rank's.  Returns the step times per label."""
    import time

    import torch.distributed as dist

    times: dict[str, list[float]] = {k: [] for k in replicas}
    for step, batch in enumerate(batches):
        order = list(replicas) if step % 2 == 0 else list(replicas)[::-1]
        for label in order:
            model, _, opt = replicas[label]
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            lm_loss(model, batch).backward()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank is done
            times[label].append(float(elapsed))
    return times


def run_worker_in_namespace(script: str, shape: Any, worker_args: list[str], out: Path) -> dict:
    """Run ``script --worker --out OUT <worker_args>`` inside a private network namespace (shaped by ``shape``,
    a ``LinkShape``, or unshaped for None); return the JSON it wrote to OUT.  The namespace is always removed."""
    from het_strategy.emulation.netshape import shaped_namespace

    argv = [sys.executable, script, "--worker", "--out", str(out), *worker_args]
    with shaped_namespace(shape) as ns:
        done = ns.run(argv, stdout=sys.stdout, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise SystemExit(f"worker inside {ns.name} failed with exit code {done.returncode}")
        link = "unshaped loopback" if shape is None else shape.describe()
        print(f"  namespace {ns.name} ({link}): {ns.lo_tx_bytes() / 1e6:.1f} MB sent on loopback in all "
              "(rendezvous and DDP's initial broadcast included)", flush=True)
    return json.loads(out.read_text())
