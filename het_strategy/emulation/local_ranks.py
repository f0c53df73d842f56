"""Run a function on a few gloo ranks forked on this machine (tests, benchmarks, examples).

``run_local_ranks(fn, world, *args)`` forks ``world`` processes, joins them into a
gloo process group over loopback, calls ``fn(rank, world, *args)`` on each and
returns every rank's (picklable) result, in rank order.  A rank that fails
fails the call with its traceback; ranks that do not finish within
``timeout_s`` are killed, so a collective mismatch cannot hang the caller.

``run_script_ranks(cmd, world, log_dir)`` does the same for a script (each rank
its own process with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* set, as
``deepspeed.init_distributed`` reads them) and returns the exit codes.
"""

from __future__ import annotations

import datetime
import os
import random
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from het_strategy.core.errors import field_error

if TYPE_CHECKING:
    from het_strategy.emulation.node_network import EmulatedNodes

__all__ = ["run_local_ranks", "run_script_ranks", "free_port"]


_PORTS = (20000, 32768)
"""Where ``free_port`` draws from: below Linux's ephemeral range (32768-60999), which the outgoing connections of
running jobs (gloo's, the stores' clients) take from, so a port found free is not taken by one of them before
the job binds it."""


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (for MASTER_PORT), drawn at random from ``_PORTS``."""
    draw = random.Random()  # seeded from the OS: concurrent callers draw independently
    for _ in range(200):
        port = draw.randrange(*_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that range is full: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world: int, port: int, out_dir: str, threads: int, args: tuple) -> None:
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_local_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 120.0,
                    threads: int = 1) -> list[Any]:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each run on its own forked gloo rank."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(fn, world, free_port(), out_dir, threads, args), nprocs=world,
                                 join=False, start_method="fork")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world} local ranks did not finish within {timeout_s} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def run_script_ranks(cmd: list[str], world: int, log_dir: Path, timeout_s: float,
                     env: dict[str, str] | None = None, *, nodes: "EmulatedNodes | None" = None,
                     rank_nodes: Sequence[int] | None = None) -> list[int]:
    """Start ``cmd`` once per rank (output to ``log_dir/log{r}.txt``); their exit codes.

    When one rank fails the others are killed (they would stay blocked in a
    collective), and so are ranks still running after ``timeout_s``
    (negative codes).  ``env`` is added to each rank's environment.  With
    ``nodes`` (``node_network.emulated_nodes``) rank r runs on node
    ``rank_nodes[r]`` (default: the world split evenly, rank r on node
    ``r // (world / nodes)``), started in that node's namespace (``LOCAL_RANK``,
    ``NODE_RANK``, ``LOCAL_WORLD_SIZE`` set).
    """
    import subprocess

    if nodes is None:
        rank_nodes = [0] * world
    elif rank_nodes is None:
        if world % len(nodes.nodes):
            raise field_error("world", world, f"be a multiple of the emulated nodes ({len(nodes.nodes)})")
        rank_nodes = [rank // (world // len(nodes.nodes)) for rank in range(world)]
    elif (len(rank_nodes) != world or not all(0 <= n < len(nodes.nodes) for n in rank_nodes)
          or rank_nodes[0] != 0):
        raise field_error("rank_nodes", list(rank_nodes), f"name one of the {len(nodes.nodes)} emulated nodes for "
                          f"each of the {world} ranks, rank 0 (the rendezvous, at MASTER_ADDR) on node 0")
    rank_nodes = list(rank_nodes)
    port = free_port()
    procs = []
    for rank in range(world):
        node = rank_nodes[rank]
        rank_env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                        WORLD_SIZE=str(world), LOCAL_RANK=str(rank_nodes[:rank].count(node)), NODE_RANK=str(node),
                        LOCAL_WORLD_SIZE=str(rank_nodes.count(node)), OMP_NUM_THREADS="1", **(env or {}))
        argv = cmd
        if nodes is not None:
            rank_env.update(nodes.rank_env(node))
            argv = nodes.command(node, cmd)
        with open(Path(log_dir) / f"log{rank}.txt", "w") as log:
            procs.append(subprocess.Popen(argv, env=rank_env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
    return [p.returncode for p in procs]
