"""Measuring the process group's links: allreduce and ring send/recv times at a few message sizes.

``measure_links`` is collective over the default process group; every rank
gets the same ``LinkMeasurement`` (rank 0's allreduce figures, every rank's
point-to-point figures).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from het_strategy.core.errors import field_error, require_int
from het_strategy.core.network import ring_steps
from het_strategy.profiling.measurements import AllreduceTiming, LinkMeasurement, P2PTiming
from het_strategy.profiling.torch_device import indexed_device, synchronizer

__all__ = ["DEFAULT_LINK_SIZES", "measure_links"]

KiB, MiB = 2**10, 2**20
DEFAULT_LINK_SIZES = (64 * KiB, 1 * MiB, 8 * MiB)
"""Message sizes timed by default; bandwidth figures are read at the largest."""


def measure_links(sizes_bytes: Sequence[int] = DEFAULT_LINK_SIZES, repeats: int = 5,
                  device: torch.device | None = None) -> LinkMeasurement:
    """Time allreduce and ring send/recv at each size; collective over the default group.

    Every rank must call it with the same arguments.  For each size, after one
    warm-up, ``repeats`` rounds are timed, each started by a tiny allreduce so
    the ranks start together; the median is kept.  Point-to-point is a ring:
    rank r sends to r+1 and receives from r-1 in one ``batch_isend_irecv`` (so
    no rank can block on a peer that is itself blocked sending), the receive
    posted first (on gloo a receive posted after a send would follow it over
    the link, and two ranks would take turns: ``compression/duplex.py``); each rank's
    round time is filed under its outgoing pair (r, r+1).  Tensors are float32
    on the group's device (``device`` for nccl, CPU for gloo).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("measure_links needs an initialised torch.distributed default process group")
    require_int(repeats, "repeats", minimum=1)
    if isinstance(sizes_bytes, (str, bytes)) or not sizes_bytes:
        raise field_error("sizes_bytes", sizes_bytes, "be a non-empty list of message sizes in bytes")
    for i, size in enumerate(sizes_bytes):
        require_int(size, f"sizes_bytes[{i}]", minimum=4)
    dev = _group_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = synchronizer(dev)
    flag = torch.zeros(1, device=dev)

    def start_together() -> None:
        dist.all_reduce(flag)
        sync()

    def timed(op: Callable[[], None]) -> float:
        op()  # warm-up: connection set-up, buffer allocation
        sync()
        times = []
        for _ in range(repeats):
            start_together()
            start = time.perf_counter()
            op()
            sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    allreduce, my_p2p = [], []
    for size in sorted(set(sizes_bytes)):
        buf = torch.ones(size // 4, dtype=torch.float32, device=dev)
        nbytes = buf.numel() * 4
        seconds = timed(lambda: dist.all_reduce(buf))
        allreduce.append(AllreduceTiming(size_bytes=nbytes, seconds=seconds, algbw_gbs=nbytes / seconds / 1e9,
                                         busbw_gbs=nbytes * ring_steps(world) / world / seconds / 1e9))
        if world > 1:
            recv = torch.empty_like(buf)

            def ring() -> None:
                ops = [dist.P2POp(dist.irecv, recv, (rank - 1) % world),
                       dist.P2POp(dist.isend, buf, (rank + 1) % world)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

            my_p2p.append((nbytes, timed(ring)))
    # allreduce times differ slightly between ranks; rank 0's are the group's figures on every rank
    shared: list[Any] = [allreduce]
    dist.broadcast_object_list(shared, src=0)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, my_p2p)
    p2p = [P2PTiming(src=r, dst=(r + 1) % world, size_bytes=nbytes, seconds=s, gbs=nbytes / s / 1e9)
           for r, timings in enumerate(gathered) for nbytes, s in timings]
    p2p.sort(key=lambda t: (t.size_bytes, t.src))
    return LinkMeasurement(backend=str(dist.get_backend()), world_size=world, allreduce=tuple(shared[0]),
                           p2p=tuple(p2p))


def _group_device(device: torch.device | None) -> torch.device:
    """The device the default group's tensors live on: CPU for gloo, the rank's GPU for nccl."""
    if dist.get_backend() == "nccl":
        return indexed_device(device if device is not None and device.type == "cuda" else torch.device("cuda"))
    return torch.device("cpu")
