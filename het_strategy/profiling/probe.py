"""The runtime probe behind ``HeteroStrategy(cluster="auto")``: measure the cluster instead of describing it.

At setup every rank measures its own device and, together, the process
group's links; the figures are gathered to all ranks, turned into a
``ClusterSpec`` (the same object a cluster YAML gives), printed as a table on
rank 0 and cached so that a re-run on the same hosts skips the measurement.

How ``probe_cluster`` works, in order (every step is collective over the
default process group):

1. Each rank's host name is gathered, so each rank knows how many ranks share
   its host (a CPU rank's memory share) and which cache files belong to it.
2. Devices: every rank looks for its device cache file; the "have it" flags are
   gathered and the ranks load only when *all* have one, else all measure
   together (concurrent measurement is what training sees on a shared host).
   ``measure_device`` times square matmuls in the training dtype and a large
   copy (memory bandwidth), and reads the device's memory.
3. Links: rank 0 looks for the link cache and broadcasts what it found (or
   nothing), so all ranks take the same branch; otherwise ``measure_links``
   times allreduce and ring send/recv at a few sizes, and rank 0 writes the
   cache.  The collectives of both branches match on every rank.
4. The device figures are gathered to all ranks and ``cluster_from_measurements``
   builds the ``ClusterSpec``: one node per host, device ``rank{i}`` per rank,
   measured TFLOPS with efficiency 1.0 (measured figures are already sustained),
   intra-node bandwidth = the slowest measured pair inside the node, inter-node
   bandwidth = the slowest pair across hosts.

Tuning advice: ``budget_s`` is the timed work per device figure; 0.5 s is
stable on an idle accelerator, raise it on a busy machine.  The link sizes
default to 64 KiB, 1 MiB and 8 MiB; bandwidth figures are read at the largest
size, so add a larger one (e.g. 64 MiB) for fast NVLink/InfiniBand fabrics where
8 MiB does not yet saturate the link.  Pass ``refresh=True`` after hardware or
driver changes; the cache does not notice them.

This is a runtime module: it imports torch (the planning core does not).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import socket
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from het_strategy.core.cluster import DTYPES, ClusterSpec, cluster_from_dict
from het_strategy.core.errors import field_error, require_int, require_number
from het_strategy.core.plan import write_atomic
from het_strategy.profiling.module_profile import catalog_device_name

__all__ = [
    "DEFAULT_LINK_SIZES",
    "DeviceMeasurement",
    "AllreduceTiming",
    "P2PTiming",
    "LinkMeasurement",
    "ProbeResult",
    "measure_device",
    "measure_links",
    "cluster_from_measurements",
    "default_cache_dir",
    "probe_cluster",
]

KiB, MiB, GiB = 2**10, 2**20, 2**30
DEFAULT_LINK_SIZES = (64 * KiB, 1 * MiB, 8 * MiB)
CACHE_FORMAT = 1
"""Bumped when a cache file's content changes meaning; older files are measured anew."""
_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_MATMUL_SIZE = {"cpu": 512, "cuda": 4096}
_COPY_BYTES = {"cpu": 32 * MiB, "cuda": 512 * MiB}
_MIN_TIMED_CALLS = 3
_MAX_TIMED_CALLS = 100_000


# -- measurements -----------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceMeasurement:
    """What one rank measured on its device."""

    host: str
    """``socket.gethostname()`` of the rank."""
    device: str
    """The torch device measured, e.g. ``cpu`` or ``cuda:0``."""
    raw_name: str
    """Name the device reports (``torch.cuda.get_device_name``; the processor for a CPU)."""
    type: str
    """Catalog type name (``catalog_device_name``), or ``raw_name`` when the catalog lacks it."""
    dtype: str
    """Training dtype the matmuls ran in (``fp32``, ``fp16``, ``bf16``)."""
    tflops: float
    """Sustained square-matmul TFLOPS in ``dtype``."""
    memory_gb: float
    """Memory this rank may use, GiB (a CPU rank gets its share of the host's memory)."""
    memory_bandwidth_gbs: float
    """Sustained copy bandwidth (bytes read + written), GB/s."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise field_error("dtype", self.dtype, f"be one of {DTYPES}")
        for name in ("tflops", "memory_gb", "memory_bandwidth_gbs"):
            require_number(getattr(self, name), name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "DeviceMeasurement":
        """Inverse of ``to_dict``; a missing or unknown key raises ``ConfigError``."""
        return cls(**_fields_of(cls, raw, "device measurement"))


@dataclass(frozen=True)
class AllreduceTiming:
    """Median time of one allreduce (sum, float32) of ``size_bytes`` over the whole group."""

    size_bytes: int
    """Bytes of the reduced tensor."""
    seconds: float
    """Median over the repeats."""
    algbw_gbs: float
    """Algorithm bandwidth: size / time, GB/s."""
    busbw_gbs: float
    """Bus bandwidth: size * 2 (n-1)/n / time, GB/s (comparable across group sizes, as nccl-tests)."""


@dataclass(frozen=True)
class P2PTiming:
    """Median time for rank ``src`` to send ``size_bytes`` to rank ``dst`` in the ring exchange."""

    src: int
    """Sending rank."""
    dst: int
    """Receiving rank (``src + 1`` around the ring)."""
    size_bytes: int
    """Bytes sent."""
    seconds: float
    """Median over the repeats of the sender's send + receive exchange."""
    gbs: float
    """size / time, GB/s."""


@dataclass(frozen=True)
class LinkMeasurement:
    """Allreduce and point-to-point figures of a process group."""

    backend: str
    """``gloo`` or ``nccl``."""
    world_size: int
    """Ranks in the group."""
    allreduce: tuple[AllreduceTiming, ...]
    """One timing per size, ascending."""
    p2p: tuple[P2PTiming, ...]
    """One timing per (size, ring pair); empty for a single rank."""

    @property
    def largest_size(self) -> int:
        return max(t.size_bytes for t in self.allreduce)

    @property
    def allreduce_busbw_gbs(self) -> float:
        """Bus bandwidth at the largest size (0 for a single rank: nothing crosses a link)."""
        return next(t.busbw_gbs for t in self.allreduce if t.size_bytes == self.largest_size)

    def pair_gbs(self) -> dict[tuple[int, int], float]:
        """GB/s of each measured (src, dst) pair at the largest size."""
        return {(t.src, t.dst): t.gbs for t in self.p2p if t.size_bytes == self.largest_size}

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "world_size": self.world_size,
                "allreduce": [asdict(t) for t in self.allreduce], "p2p": [asdict(t) for t in self.p2p]}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "LinkMeasurement":
        """Inverse of ``to_dict``; a missing or unknown key raises ``ConfigError``."""
        fields = _fields_of(cls, raw, "link measurement")
        return cls(backend=str(fields["backend"]), world_size=int(fields["world_size"]),
                   allreduce=tuple(AllreduceTiming(**_fields_of(AllreduceTiming, t, "allreduce"))
                                   for t in fields["allreduce"]),
                   p2p=tuple(P2PTiming(**_fields_of(P2PTiming, t, "p2p")) for t in fields["p2p"]))


def _fields_of(cls: type, raw: Any, what: str) -> dict[str, Any]:
    """``raw`` checked to hold exactly the dataclass fields of ``cls``."""
    wanted = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    if not isinstance(raw, Mapping) or set(raw) != wanted:
        got = sorted(raw) if isinstance(raw, Mapping) else type(raw).__name__
        raise field_error(what, got, f"hold exactly the keys {sorted(wanted)}")
    return dict(raw)


# -- one device ---------------------------------------------------------------------------------
def _sync_for(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


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
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if dtype not in _TORCH_DTYPES:
        raise field_error("dtype", dtype, f"be one of {tuple(_TORCH_DTYPES)}")
    require_number(budget_s, "budget_s")
    local = num_local_ranks if num_local_ranks is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    require_int(local, "num_local_ranks", minimum=1)
    side = require_int(matmul_size, "matmul_size", minimum=1) if matmul_size is not None else _MATMUL_SIZE[device.type]
    sync = _sync_for(device)

    with torch.inference_mode():
        a = torch.randn(side, side, device=device).to(_TORCH_DTYPES[dtype])
        b = torch.randn(side, side, device=device).to(_TORCH_DTYPES[dtype])
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


# -- the group's links ------------------------------------------------------------------------------
def _group_device(device: torch.device | None) -> torch.device:
    """The device the default group's tensors live on: CPU for gloo, the rank's GPU for nccl."""
    if dist.get_backend() == "nccl":
        if device is not None and device.type == "cuda" and device.index is not None:
            return device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def measure_links(sizes_bytes: Sequence[int] = DEFAULT_LINK_SIZES, repeats: int = 5,
                  device: torch.device | None = None) -> LinkMeasurement:
    """Time allreduce and ring send/recv at each size; collective over the default group.

    Every rank must call it with the same arguments.  For each size, after one
    warm-up, ``repeats`` rounds are timed, each started by a tiny allreduce so
    the ranks start together; the median is kept.  Point-to-point is a ring:
    rank r sends to r+1 and receives from r-1 in one ``batch_isend_irecv`` (so
    no rank can block on a peer that is itself blocked sending); each rank's
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
    sync = _sync_for(dev)
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
                                         busbw_gbs=nbytes * 2 * (world - 1) / world / seconds / 1e9))
        if world > 1:
            recv = torch.empty_like(buf)

            def ring() -> None:
                ops = [dist.P2POp(dist.isend, buf, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
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


# -- measurements -> ClusterSpec ------------------------------------------------------------------
def cluster_from_measurements(devices: Sequence[DeviceMeasurement], links: LinkMeasurement,
                              name: str = "auto") -> ClusterSpec:
    """The ClusterSpec the measurements describe (no process group needed).

    One node per host, in order of the host's first rank, named after the host;
    device ``rank{i}`` for rank i, with its measured TFLOPS (efficiency 1.0),
    memory and copy bandwidth.  A node's intra-node bandwidth is its slowest
    measured pair; a node with one rank (or no measured pair inside it) takes
    the allreduce bus bandwidth, and with a single rank in the whole group, where
    no link exists, its device's memory bandwidth.  Inter-node bandwidth is the
    slowest pair across hosts (the intra figure when there is one host).
    Ranks of one host should be contiguous (every launcher does this): the
    ClusterSpec lists devices node by node, so interleaved hosts would reorder them.
    """
    if not devices:
        raise field_error("devices", [], "list one measurement per rank")
    if len(devices) != links.world_size:
        raise field_error("devices", len(devices), f"hold one measurement per rank ({links.world_size})")
    hosts = [d.host for d in devices]
    ranks_of: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        ranks_of.setdefault(host, []).append(rank)
    rank_order = [r for ranks in ranks_of.values() for r in ranks]
    if rank_order != list(range(len(devices))):
        warnings.warn(f"ranks of one host are not contiguous (hosts by rank: {hosts}); the probed ClusterSpec lists "
                      "devices host by host, so its device order differs from rank order (names rank{i} keep the rank)",
                      stacklevel=2)
    pairs = links.pair_gbs()
    fallback = links.allreduce_busbw_gbs if links.world_size > 1 else devices[0].memory_bandwidth_gbs
    nodes = []
    for host, ranks in ranks_of.items():
        inside = [gbs for (a, b), gbs in pairs.items() if hosts[a] == host and hosts[b] == host]
        nodes.append({
            "name": host,
            "intra_bandwidth_gbs": min(inside, default=fallback),
            "devices": [{"name": f"rank{r}", "type": devices[r].type, "tflops": {devices[r].dtype: devices[r].tflops},
                         "efficiency": 1.0, "memory_gb": devices[r].memory_gb,
                         "memory_bandwidth_gbs": devices[r].memory_bandwidth_gbs} for r in ranks],
        })
    across = [gbs for (a, b), gbs in pairs.items() if hosts[a] != hosts[b]]
    inter = min(across, default=min(n["intra_bandwidth_gbs"] for n in nodes))
    return cluster_from_dict({"name": name, "nodes": nodes, "inter_node_bandwidth_gbs": inter})


# -- the collective probe ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProbeResult:
    """What ``probe_cluster`` found; equal on every rank."""

    cluster: ClusterSpec
    """The measured cluster, ready for the planner."""
    devices: tuple[DeviceMeasurement, ...]
    """One measurement per rank, in rank order."""
    links: LinkMeasurement
    """The group's allreduce and point-to-point figures."""
    from_cache: bool
    """True when devices and links were all read from cache files (nothing measured)."""

    def table(self) -> str:
        """A fixed-width table: one row per rank, then the link figures and the resulting bandwidths."""
        dtype = self.devices[0].dtype
        header = ["rank", "host", "device", "type", f"{dtype} TFLOPS", "memory GiB", "copy GB/s"]
        rows = [[str(r), d.host, d.raw_name, d.type, f"{d.tflops:.3g}", f"{d.memory_gb:.1f}",
                 f"{d.memory_bandwidth_gbs:.1f}"] for r, d in enumerate(self.devices)]
        source = "cached" if self.from_cache else "measured"
        lines = [f"Probed cluster `{self.cluster.name}` ({source}; {self.links.backend}, "
                 f"{self.links.world_size} ranks)", *_format_table(header, rows, right={0, 4, 5, 6}), ""]
        ar_rows = [[_fmt_bytes(t.size_bytes), "allreduce", f"{t.seconds * 1e6:.0f}", f"{t.algbw_gbs:.2f}",
                    f"{t.busbw_gbs:.2f}"] for t in self.links.allreduce]
        p2p_rows = [[_fmt_bytes(t.size_bytes), f"p2p {t.src}->{t.dst}", f"{t.seconds * 1e6:.0f}", f"{t.gbs:.2f}", ""]
                    for t in self.links.p2p]
        lines += _format_table(["size", "link", "time us", "GB/s", "bus GB/s"], ar_rows + p2p_rows,
                               right={0, 2, 3, 4})
        intra = ", ".join(f"{n.name} {n.intra_bandwidth_gbs:.2f}" for n in self.cluster.nodes)
        lines.append(f"intra-node GB/s: {intra}; inter-node GB/s: {self.cluster.inter_node_bandwidth_gbs:.2f}")
        return "\n".join(lines)


def _format_table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def fmt(r: list[str]) -> str:
        return "  ".join(r[c].rjust(widths[c]) if c in right else r[c].ljust(widths[c])
                         for c in range(len(header))).rstrip()

    return [fmt(header), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)]


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def default_cache_dir() -> Path:
    """``$HET_STRATEGY_CACHE`` if set, else ``~/.cache/het_strategy/probe``."""
    env = os.environ.get("HET_STRATEGY_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "het_strategy" / "probe"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_") or "x"


def _device_cache_path(cache_dir: Path, device: torch.device, dtype: str, local_index: int, num_local: int) -> Path:
    """Per host, device and dtype; a CPU file also names the rank's share (i of n) of the host."""
    host = _slug(socket.gethostname())
    if device.type == "cuda":
        slug = f"{_slug(torch.cuda.get_device_name(device))}-cuda{device.index}"
    else:
        slug = f"{_slug(platform.processor() or 'cpu')}-cpu{local_index}of{num_local}"
    return cache_dir / f"device-{host}-{slug}-{dtype}.json"


def _links_cache_path(cache_dir: Path, hosts: Sequence[str], backend: str, sizes: Sequence[int]) -> Path:
    """Keyed by the host of every rank (in rank order: the ring's pairs depend on it), backend and sizes."""
    key = json.dumps({"hosts": list(hosts), "backend": backend, "sizes": sorted(set(sizes))})
    return cache_dir / f"links-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _read_cache(path: Path, parse: Callable[[Mapping[str, Any]], Any]) -> Any:
    """The parsed cache file, or None when it is missing, stale or corrupt (corrupt: with a warning)."""
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != CACHE_FORMAT:
            return None
        return parse(raw["measurement"])
    except Exception as exc:  # any unreadable file is re-measured, never fatal
        warnings.warn(f"probe cache file {path} is unreadable ({type(exc).__name__}: {exc}); measuring again",
                      stacklevel=3)
        return None


def _write_cache(path: Path, measurement: DeviceMeasurement | LinkMeasurement) -> None:
    write_atomic(path, json.dumps({"format": CACHE_FORMAT, "measurement": measurement.to_dict()}, indent=1))


def probe_cluster(device: torch.device | str, dtype: str = "fp32", cache_dir: str | Path | None = None,
                  name: str = "auto", refresh: bool = False, budget_s: float = 0.5,
                  sizes_bytes: Sequence[int] = DEFAULT_LINK_SIZES, repeats: int = 5,
                  print_table: bool = True) -> ProbeResult:
    """Measure (or load) every rank's device and the group's links; collective over the default group.

    Every rank must call it with the same arguments except ``device`` (its own).
    ``cache_dir`` defaults to ``default_cache_dir()``; ``refresh=True``
    ignores the cache files (and overwrites them).  Rank 0 prints the table with
    ``print`` (to stdout, flushed) unless ``print_table`` is False.  The steps
    are in the module docstring.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("probe_cluster needs an initialised torch.distributed default process group")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    rank, world = dist.get_rank(), dist.get_world_size()

    # 1. hosts of all ranks: the CPU memory share and the cache keys need them
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    same_host = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    device_path = _device_cache_path(cache, device, dtype, same_host.index(rank), len(same_host))

    # 2. devices: load only if every rank can, so that all measure together or none does
    mine = None if refresh else _read_cache(device_path, DeviceMeasurement.from_dict)
    have: list[Any] = [None] * world
    dist.all_gather_object(have, mine is not None)
    devices_cached = all(have)
    if not devices_cached:
        mine = measure_device(device, dtype, budget_s, num_local_ranks=len(same_host))
        _write_cache(device_path, mine)

    # 3. links: rank 0's cache decides for everyone (other hosts do not have its file)
    backend = str(dist.get_backend())
    links_path = _links_cache_path(cache, hosts, backend, sizes_bytes)
    found: list[Any] = [None]
    if rank == 0 and not refresh:
        cached = _read_cache(links_path, LinkMeasurement.from_dict)
        found[0] = None if cached is None else cached.to_dict()
    dist.broadcast_object_list(found, src=0)
    links_cached = found[0] is not None
    if links_cached:
        links = LinkMeasurement.from_dict(found[0])
    else:
        links = measure_links(sizes_bytes, repeats, device)
        if rank == 0:
            _write_cache(links_path, links)

    # 4. everyone gets every rank's figures and builds the same ClusterSpec
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine.to_dict())  # type: ignore[union-attr]
    devices = tuple(DeviceMeasurement.from_dict(d) for d in gathered)
    result = ProbeResult(cluster=cluster_from_measurements(devices, links, name), devices=devices, links=links,
                         from_cache=devices_cached and links_cached)
    if rank == 0 and print_table:
        print(result.table(), flush=True)
    return result
