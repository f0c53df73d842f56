"""Measuring one device: sustained matmul TFLOPS in the training dtype, memory, copy bandwidth.

``measure_device`` is what every rank of ``probe_cluster`` runs on its own
device; ``round_clock`` says how one round is timed; ``InTurn`` is the
caller's scheduler of rounds.  Each figure is the median of the best three of
``rounds`` short timed rounds (``measurements.best_rounds_figure``;
``measure_device``'s docstring says why the best), and every round's figure is
kept in the measurement: how far the median round falls short of the figure
(``DeviceMeasurement.tflops_noise``) tells how well the figure is known.

Invariants:

- a figure is what the device does when it runs, not how much of the host a
  rank got while measuring: on a CPU a round leaves out the time the measuring
  thread waited for a core, and it is never timed shorter than it ran, so the
  figure stays on the safe side (never above the undisturbed speed); a load
  that lasts into training is the straggler callback's to see;
- not collective by itself: ``in_turn`` lets the caller schedule each round,
  and it is called equally often on every rank (``probe_cluster`` makes the
  ranks of one host take turns, so that they do not compete for the same cores).
"""

from __future__ import annotations

import math
import os
import platform
import socket
import time
from typing import Callable

import torch

from het_strategy.core.catalog import catalog_device_name
from het_strategy.core.errors import field_error, require_int, require_number
from het_strategy.profiling.measurements import DeviceMeasurement, best_rounds_figure
from het_strategy.profiling.torch_device import TORCH_DTYPES, indexed_device, synchronizer

__all__ = ["measure_device", "round_clock", "InTurn"]

KiB, MiB, GiB = 2**10, 2**20, 2**30
_MATMUL_SIZE = {"cpu": 512, "cuda": 4096}
_COPY_BYTES = {"cpu": 32 * MiB, "cuda": 512 * MiB}
_MAX_TIMED_CALLS = 100_000
"""The most calls one round times (a no-op stand-in matmul would otherwise loop for ever)."""

InTurn = Callable[[Callable[[], float]], float]
"""Runs a round when it is this rank's turn and returns its result (every rank calls it equally often)."""


_SCHEDSTAT = "/proc/thread-self/schedstat"


def _now(round_: Callable[[], float]) -> float:
    return round_()


def _runqueue_wait_s() -> float:
    """Seconds this thread has spent runnable but waiting for a core (2nd field of its schedstat, ns)."""
    with open(_SCHEDSTAT) as fh:
        return int(fh.read().split()[1]) / 1e9


def round_clock(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """How a round is timed: ``clock(work) -> seconds``.  On a CPU, wall time less this thread's run-queue
    waits (when Linux tells them); elsewhere (a GPU computes while its host thread waits) wall time.

    A process that took the core away for part of a round does not count against the device.  Exact for a
    single-threaded rank; for a multi-threaded one only the main thread's waits are left out, so the figure stays
    on the safe side.  Where ``/proc/thread-self/schedstat`` is missing the wall time is used.

    The reads are ordered so that a preemption between two of them can only lengthen the time (the wait read
    after the wall clock at the start, before it at the end): a round is never timed shorter than it ran.
    """
    if device.type == "cpu":
        try:
            _runqueue_wait_s()
        except (OSError, ValueError, IndexError):
            pass
        else:
            def on_cpu(work: Callable[[], None]) -> float:
                start, waited = time.perf_counter(), _runqueue_wait_s()
                work()
                waited = _runqueue_wait_s() - waited
                return time.perf_counter() - start - waited

            return on_cpu

    def wall(work: Callable[[], None]) -> float:
        start = time.perf_counter()
        work()
        return time.perf_counter() - start

    return wall


def measure_device(device: torch.device | str, dtype: str = "fp32", budget_s: float = 0.5,
                   num_local_ranks: int | None = None, matmul_size: int | None = None, rounds: int = 10,
                   in_turn: InTurn | None = None) -> DeviceMeasurement:
    """Measure one device: matmul TFLOPS in ``dtype``, memory, copy bandwidth.

    ``budget_s`` is the timed work of each of the two figures (matmul, copy),
    split into ``rounds`` rounds (``best_rounds_figure`` of them is the figure).  ``in_turn(round)``
    runs each sizing call and each round (default: at once); it is called the
    same number of times on every rank, ``2 x (rounds + 1)``, so a collective
    scheduler can use it.

    Each figure is the median of the best three of ``rounds`` timed rounds of
    identical calls (about ``budget_s`` of timed work in all, after a warm-up
    call and a sizing call), with the device synchronised around each round.
    The best rounds, not the mean nor the median of all: on a shared machine
    other processes take the core away for part of most rounds, and
    interference only ever slows a round down, so the fastest rounds are the
    least disturbed (the reason ``timeit`` reports the minimum time); three of
    them, so that one lucky round does not set the figure.  Short rounds, many
    of them, give more chances of an undisturbed one: 10 rounds of 50 ms by
    default.

    The matmuls run under the current ``torch.backends`` settings (e.g. TF32
    for fp32 on NVIDIA GPUs), so set those as training will before probing.
    ``num_local_ranks`` ranks share a CPU host's memory (default:
    ``$LOCAL_WORLD_SIZE``, else 1).  ``matmul_size`` overrides the square
    matmul's side (512 on CPU, 4096 on CUDA).  Not collective.
    """
    device = torch.device(device)
    if device.type not in _MATMUL_SIZE:
        raise field_error("device", str(device), "be a cpu or cuda device")
    device = indexed_device(device)
    if dtype not in TORCH_DTYPES:
        raise field_error("dtype", dtype, f"be one of {tuple(TORCH_DTYPES)}")
    require_number(budget_s, "budget_s")
    require_int(rounds, "rounds", minimum=1)
    turn = in_turn if in_turn is not None else _now
    local = num_local_ranks if num_local_ranks is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    require_int(local, "num_local_ranks", minimum=1)
    side = require_int(matmul_size, "matmul_size", minimum=1) if matmul_size is not None else _MATMUL_SIZE[device.type]
    sync = synchronizer(device)
    clock = round_clock(device)

    with torch.inference_mode():
        a = torch.randn(side, side, device=device).to(TORCH_DTYPES[dtype])
        b = torch.randn(side, side, device=device).to(TORCH_DTYPES[dtype])
        c = torch.empty_like(a)
        flops = _timed_rounds(lambda: torch.mm(a, b, out=c), 2.0 * side**3, budget_s, rounds, sync, turn, clock)
        del a, b, c
        src = torch.empty(_COPY_BYTES[device.type], dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        copy_bps = _timed_rounds(lambda: dst.copy_(src), 2.0 * src.numel(), budget_s, rounds, sync, turn, clock)
        del src, dst

    if device.type == "cuda":
        raw_name = torch.cuda.get_device_name(device)
        memory_gb = torch.cuda.mem_get_info(device)[1] / GiB
        type_name = catalog_device_name(raw_name, memory_gb)
    else:
        raw_name = platform.processor() or "cpu"
        memory_gb = _host_memory_bytes() / local / GiB
        type_name = "CPU"  # every host CPU is the catalog's CPU type; the measured figures tell them apart
    return DeviceMeasurement(host=socket.gethostname(), device=str(device), raw_name=raw_name, type=type_name,
                             dtype=dtype, tflops=best_rounds_figure(flops) / 1e12, memory_gb=memory_gb,
                             memory_bandwidth_gbs=best_rounds_figure(copy_bps) / 1e9,
                             tflops_rounds=tuple(f / 1e12 for f in flops),
                             memory_bandwidth_rounds_gbs=tuple(b / 1e9 for b in copy_bps))


def _timed_rounds(step: Callable[[], None], work: float, budget_s: float, rounds: int, sync: Callable[[], None],
                  turn: InTurn, clock: Callable[[Callable[[], None]], float]) -> list[float]:
    """``work`` units per second of ``step`` in each of ``rounds`` rounds of ~budget_s / rounds timed work.

    The first turn warms up (one call) and sizes the rounds (one call, by the
    wall clock: it bounds how long a round takes); every round then times the
    same number of calls, at least one, with ``clock``.
    """

    def size() -> float:
        step()
        sync()
        start = time.perf_counter()
        step()
        sync()
        return time.perf_counter() - start

    first = turn(size)
    calls = min(_MAX_TIMED_CALLS, max(1, math.ceil(budget_s / rounds / max(first, 1e-9))))

    def run_calls() -> None:
        for _ in range(calls):
            step()
        sync()

    def timed_round() -> float:
        return work * calls / max(clock(run_calls), 1e-9)

    return [turn(timed_round) for _ in range(rounds)]


def _host_memory_bytes() -> int:
    """Physical memory of this host, from sysconf or /proc/meminfo."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * KiB
    raise RuntimeError("cannot read this host's physical memory (no sysconf, no MemTotal in /proc/meminfo)")
