"""Rank functions of ``fsdp_unequal_memory.py``: the char GPT sharded by ``het_strategy.fsdp.shard_model`` on forked
gloo ranks (``run_ranks``), one thread each.

Every rank trains its share ``shares[r]`` of each global batch (rows ``sum(shares[:r]) ..``) in micro-batches of
``micro[r]``; every rank runs the same number of micro-steps (the largest), a rank out of samples running empty
ones, as the runtime requires.  The loss is the token-summed cross-entropy x ``world / (N x T)``: the reduce-scatter
sums the ranks' gradients and divides by the world size, so the shards step on the global batch's mean gradient.

- ``train_exact``: steps, the full state dict, a sharded checkpoint, one more step (``resume_one_step`` loads the
  checkpoint in another layout and takes that step);
- ``train_metered``: steps under ``emulation.memory_cap.MemoryMeter`` (capped at the rank's device memory);
- ``train_timed``: steps with each unit's compute padded to its emulated device's time (``UnitPadding``), timed.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.optim  # noqa: F401  (imported before the ranks fork: its lazy imports are not safe in a fork)

from het_strategy.core.workload import TransformerConfig
from het_strategy.demo.char_gpt import CharGPT
from het_strategy.fsdp import shard_model
from het_strategy.fsdp.checkpoint import load_sharded, save_sharded

LR = 3e-3


def _entry(rank: int, world: int, port: int, out: str, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        result: Any = fn(rank, world, *args)
    except Exception:  # noqa: BLE001  (a peer's failure reaches this rank as a gloo error: reported, not raised)
        result = {"raised": traceback.format_exc(limit=3)}
    torch.save(result, Path(out) / f"rank{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 180.0) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` forked gloo ranks; each rank's result, or ``{"raised": traceback}``
    for a rank that raised (a rank that leaves early makes its peers' next collective raise: they are reported,
    not left blocked)."""
    from het_strategy.emulation.local_ranks import free_port

    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="het_fsdp_") as out:
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(r, world, port, out, fn, args)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.1))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) if (Path(out) / f"rank{r}.pt").exists()
                else {"raised": f"rank {r} killed after {timeout_s} s"} for r in range(world)]


def build(cfg: TransformerConfig, dtype: torch.dtype) -> CharGPT:
    """The same initial char GPT in every process."""
    torch.manual_seed(0)
    return CharGPT.from_workload_config(cfg).to(dtype)


def global_batch(cfg: TransformerConfig, step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, cfg.vocab_size, (n, cfg.seq_len), generator=g)
    return x, torch.roll(x, -1, dims=1)


def loss_of(logits: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum") * scale


def reference(cfg: TransformerConfig, n: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """One process, float64, the whole batch: the parameters after each step."""
    model = build(cfg, torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    out = []
    for step in range(steps):
        x, y = global_batch(cfg, step, n)
        opt.zero_grad()
        loss_of(model(x), y, 1.0 / (n * cfg.seq_len)).backward()
        opt.step()
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def _micro_steps(shares: Sequence[int], micro: Sequence[int]) -> int:
    return max(-(-n // m) for n, m in zip(shares, micro))


def _step(sharded: Any, opt: torch.optim.Optimizer, cfg: TransformerConfig, step: int, rank: int, world: int,
          shares: Sequence[int], micro: Sequence[int], meter: Any = None) -> None:
    n = sum(shares)
    x, y = global_batch(cfg, step, n)
    lo = sum(shares[:rank])
    x, y = x[lo:lo + shares[rank]], y[lo:lo + shares[rank]]
    scale = world / (n * cfg.seq_len)
    m = micro[rank]
    opt.zero_grad(set_to_none=True)
    for j in range(_micro_steps(shares, micro)):
        xm, ym = x[j * m:(j + 1) * m].clone(), y[j * m:(j + 1) * m].clone()  # empty past the share
        if meter is not None:
            with meter.track():
                loss = loss_of(sharded(xm), ym, scale)
        else:
            loss = loss_of(sharded(xm), ym, scale)
        loss.backward()
    opt.step()


def _shard(cfg: TransformerConfig, dtype: torch.dtype, fractions: Sequence[float], rank: int, world: int,
           prefetch: bool = True) -> tuple[Any, torch.optim.Optimizer]:
    model = build(cfg, dtype)
    sharded = shard_model(model, list(model.blocks), list(fractions), rank, world, prefetch=prefetch)
    return sharded, torch.optim.Adam(model.parameters(), lr=LR)


def train_exact(rank: int, world: int, cfg: TransformerConfig, fractions: list[float], shares: list[int],
                micro: list[int], steps: int, ckpt: str) -> dict[str, Any]:
    """``steps`` float64 steps; the full state dict; a sharded checkpoint; one more step; the full state again."""
    sharded, opt = _shard(cfg, torch.float64, fractions, rank, world)
    for step in range(steps):
        _step(sharded, opt, cfg, step, rank, world, shares, micro)
    after = sharded.full_state_dict()
    save_sharded(sharded, opt, ckpt, extra={"step": steps})
    _step(sharded, opt, cfg, steps, rank, world, shares, micro)
    return {"after": after, "next": sharded.full_state_dict(),
            "sizes": {u.name: u.sizes for u in sharded.units}}


def resume_one_step(rank: int, world: int, cfg: TransformerConfig, fractions: list[float], shares: list[int],
                    micro: list[int], ckpt: str) -> dict[str, Any]:
    """Another layout (``fractions`` over ``world`` ranks): load the checkpoint, take its next step."""
    sharded, opt = _shard(cfg, torch.float64, fractions, rank, world)
    extra = load_sharded(sharded, opt, ckpt)
    loaded = sharded.full_state_dict()
    _step(sharded, opt, cfg, int(extra["step"]), rank, world, shares, micro)
    return {"loaded": loaded, "next": sharded.full_state_dict(), "sizes": {u.name: u.sizes for u in sharded.units}}


def train_metered(rank: int, world: int, cfg: TransformerConfig, fractions: list[float], shares: list[int],
                  micro: list[int], steps: int, cluster: dict, devices: list[str]) -> dict[str, Any]:
    """``steps`` float32 steps under a MemoryMeter capped at ``devices[rank]``'s memory: its peak by part, or the
    emulated out-of-memory error (the other ranks then fail at their next collective)."""
    from het_strategy.core.cluster import cluster_from_dict
    from het_strategy.emulation.memory_cap import EmulatedOutOfMemoryError, MemoryMeter

    sharded, opt = _shard(cfg, torch.float32, fractions, rank, world)
    meter = MemoryMeter.for_device(cluster_from_dict(cluster), devices[rank], rank, sharded=sharded, optimizer=opt)
    try:
        for step in range(steps):
            _step(sharded, opt, cfg, step, rank, world, shares, micro, meter)
    except EmulatedOutOfMemoryError as exc:
        # the peers wait in a collective this rank will not join: leave at once, the caller reads this file
        return {"error": str(exc), "peak": meter.peak_bytes, "parts": meter.peak_parts}
    return {"error": None, "peak": meter.peak_bytes, "parts": meter.peak_parts}


class _PadBackward(torch.autograd.Function):
    """Identity whose backward sleeps ``holder[0]`` seconds (a unit's emulated backward, set after its forward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, holder: list) -> torch.Tensor:
        ctx.holder = holder
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.holder[0] > 0:
            time.sleep(ctx.holder[0])
        return grad, None


class UnitPadding:
    """Each block's forward and backward padded to its emulated device's time, the root's (embedding and head)
    at the model's end: ``seconds[b]`` per micro-batch size ``b``, one fwd + bwd figure per phase (the root's
    layers before the blocks, each block, the root's after them: ``FsdpCost.phase_compute_s``), forward 1/3.

    A block's forward sleeps, after its real forward, for what of its emulated forward that did not take; its
    backward (an identity at the block's input, run once the block's backward is over) for the emulated backward
    less twice the real forward.  Waits for a gather happen in the runtime's pre-hook, before the block's clock
    starts: the emulated device computes after its parameters arrived, the collectives stay real."""

    def __init__(self, model: CharGPT, seconds: dict[int, list[float]]) -> None:
        self.seconds = seconds
        self.batch = 0
        self._t0 = 0.0
        self._holders: list[list[float]] = []
        for i, block in enumerate(model.blocks):
            block.register_forward_pre_hook(self._start(i + 1))
            block.register_forward_hook(self._end(i + 1))
        model.register_forward_hook(self._root_end)

    def _target(self, unit: int) -> float:
        return self.seconds[self.batch][unit] if self.batch else 0.0

    def _start(self, unit: int):
        def hook(module: torch.nn.Module, args: tuple) -> tuple:
            self._holders.append([0.0])
            self._t0 = time.perf_counter()
            return (_PadBackward.apply(args[0], self._holders[-1]),) + tuple(args[1:])
        return hook

    def _end(self, unit: int):
        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
            real = time.perf_counter() - self._t0
            target = self._target(unit)
            if target / 3 > real:
                time.sleep(target / 3 - real)
            self._holders[-1][0] = max(target * 2 / 3 - 2 * real, 0.0)
        return hook

    def _root_end(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        target = self._target(0) + self._target(-1)
        if target:
            time.sleep(target / 3)
        holder = [target * 2 / 3]
        self._holders = []
        return _PadBackward.apply(output, holder)


def train_timed(rank: int, world: int, cfg: TransformerConfig, fractions: list[float], shares: list[int],
                micro: list[int], seconds: dict[int, list[float]], steps: int, warmup: int,
                prefetch: bool) -> dict[str, Any]:
    """``warmup + steps`` float32 steps with the units padded to the rank's emulated device; per rank the mean
    step time after ``warmup`` and the share of it blocked on communication (``ShardedModel.comm_wait_s``)."""
    sharded, opt = _shard(cfg, torch.float32, fractions, rank, world, prefetch=prefetch)
    padding = UnitPadding(sharded.module, seconds)
    n = sum(shares)
    lo = sum(shares[:rank])
    K = _micro_steps(shares, micro)
    scale = world / (n * cfg.seq_len)
    times, waits = [], []
    dist.barrier()
    for step in range(warmup + steps):
        x, y = global_batch(cfg, step, n)
        x, y = x[lo:lo + shares[rank]], y[lo:lo + shares[rank]]
        sharded.reset_timing()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        m = micro[rank]
        for j in range(K):
            xm, ym = x[j * m:(j + 1) * m], y[j * m:(j + 1) * m]
            padding.batch = xm.shape[0]
            loss_of(sharded(xm), ym, scale).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        waits.append(sharded.comm_wait_s)
    dist.barrier()
    return {"step_s": statistics.fmean(times[warmup:]), "wait_s": statistics.fmean(waits[warmup:]),
            "times": times}
