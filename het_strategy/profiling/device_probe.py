"""Measuring one device: sustained matmul TFLOPS in the training dtype, memory, copy bandwidth.

``measure_device`` is what every rank of ``probe_cluster`` runs on its own
device (not collective).  Each figure is a loop of identical calls timed for
about ``budget_s`` after a warm-up call and a sizing call, with the device
synchronised around the timed region.
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
from het_strategy.profiling.measurements import DeviceMeasurement
from het_strategy.profiling.torch_device import TORCH_DTYPES, indexed_device, synchronizer

__all__ = ["measure_device"]

KiB, MiB, GiB = 2**10, 2**20, 2**30
_MATMUL_SIZE = {"cpu": 512, "cuda": 4096}
_COPY_BYTES = {"cpu": 32 * MiB, "cuda": 512 * MiB}
_MIN_TIMED_CALLS = 3
_MAX_TIMED_CALLS = 100_000


def measure_device(device: torch.device | str, dtype: str = "fp32", budget_s: float = 0.5,
                   num_local_ranks: int | None = None, matmul_size: int | None = None) -> DeviceMeasurement:
    """Measure one device: matmul TFLOPS in ``dtype``, memory, copy bandwidth.

    ``budget_s`` is the timed work of each of the two figures (matmul, copy).
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
    local = num_local_ranks if num_local_ranks is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    require_int(local, "num_local_ranks", minimum=1)
    side = require_int(matmul_size, "matmul_size", minimum=1) if matmul_size is not None else _MATMUL_SIZE[device.type]
    sync = synchronizer(device)

    with torch.inference_mode():
        a = torch.randn(side, side, device=device).to(TORCH_DTYPES[dtype])
        b = torch.randn(side, side, device=device).to(TORCH_DTYPES[dtype])
        c = torch.empty_like(a)
        flops = _sustained_rate(lambda: torch.mm(a, b, out=c), 2.0 * side**3, budget_s, sync)
        del a, b, c
        src = torch.empty(_COPY_BYTES[device.type], dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        copy_bps = _sustained_rate(lambda: dst.copy_(src), 2.0 * src.numel(), budget_s, sync)
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
                             dtype=dtype, tflops=flops / 1e12, memory_gb=memory_gb,
                             memory_bandwidth_gbs=copy_bps / 1e9)


def _sustained_rate(step: Callable[[], None], work: float, budget_s: float, sync: Callable[[], None]) -> float:
    """``work`` units per second of ``step``: one warm-up call, one call to size the loop, then ~budget_s timed."""
    step()
    sync()
    start = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - start
    calls = min(_MAX_TIMED_CALLS, max(_MIN_TIMED_CALLS, math.ceil(budget_s / max(first, 1e-9))))
    start = time.perf_counter()
    for _ in range(calls):
        step()
    sync()
    return work * calls / (time.perf_counter() - start)


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
