"""The runtime probe behind ``HeteroStrategy(cluster="auto")``: measure the cluster instead of describing it.

At setup every rank measures its own device and, together, the process
group's links; the figures are gathered to all ranks, turned into a
``ClusterSpec`` (the same object a cluster YAML gives), printed as a table on
rank 0 and cached so that a re-run on the same hosts skips the measurement.
``probe_cluster`` does it (its docstring has the steps and tuning advice) and
returns a ``ProbeResult``; ``cluster_from_measurements`` builds the
``ClusterSpec`` from figures without a process group.

Invariants:

- every step of ``probe_cluster`` is collective over the default process group,
  and every rank takes the same branch (all load from the cache or all measure:
  the "have it" flags are gathered, rank 0's link cache is broadcast), so the
  collectives match on every rank;
- the ranks of one host take turns while they measure, so the figures are each
  rank's *alone* on its host: the planner needs their ratios, which ranks
  measuring at once on an oversubscribed host get wrong.

Where the pieces are: what is measured and snapping, ``measurements.py``; one
device, ``device_probe.py``; the links, ``link_probe.py``; the cache files,
``probe_cache.py``.  This module puts them together.  It is a runtime module: it
imports torch (the planning core does not).
"""

from __future__ import annotations

import socket
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from het_strategy.core.cluster import ClusterSpec, cluster_from_dict
from het_strategy.core.errors import field_error
from het_strategy.core.log import rank_debug, rank_zero_info
from het_strategy.profiling.device_probe import InTurn, measure_device
from het_strategy.profiling.link_probe import DEFAULT_LINK_SIZES, measure_links
from het_strategy.profiling.measurements import (
    DEFAULT_SNAP_TOLERANCE,
    DeviceMeasurement,
    LinkMeasurement,
    SnappedFigures,
    snap_like_devices,
)
from het_strategy.profiling.probe_cache import (
    cache_age,
    default_cache_dir,
    device_cache_path,
    links_cache_path,
    read_cache,
    write_cache,
)
from het_strategy.profiling.torch_device import indexed_device
from het_strategy.report.table import format_table

__all__ = [
    "ProbeResult",
    "cluster_from_measurements",
    "probe_cluster",
]

KiB, MiB = 2**10, 2**20


# -- measurements -> ClusterSpec ------------------------------------------------------------------
def cluster_from_measurements(devices: Sequence[DeviceMeasurement], links: LinkMeasurement,
                              name: str = "auto", snapped: Sequence[SnappedFigures] | None = None) -> ClusterSpec:
    """The ClusterSpec the measurements describe (no process group needed).

    One node per host, in order of the host's first rank, named after the host;
    device ``rank{i}`` for rank i, with its measured TFLOPS (efficiency 1.0),
    memory and copy bandwidth — the ``snapped`` figures where given (one per
    device, from ``snap_like_devices``), else the raw ones.  A node's intra-node bandwidth is its slowest
    measured pair; a node with one rank (or no measured pair inside it) takes
    the allreduce bus bandwidth, and with a single rank in the whole group, where
    no link exists, its device's memory bandwidth.  Inter-node bandwidth is the
    slowest pair across hosts (the intra figure when there is one host).  The
    per-message latency is the alpha of an alpha-beta fit over the point-to-point
    times at every measured size (64 KiB, 1 MiB, 8 MiB by default), so small
    messages cost what they cost here.
    Ranks of one host should be contiguous (every launcher does this): the
    ClusterSpec lists devices node by node, so interleaved hosts would reorder them.
    """
    if not devices:
        raise field_error("devices", [], "list one measurement per rank")
    if len(devices) != links.world_size:
        raise field_error("devices", len(devices), f"hold one measurement per rank ({links.world_size})")
    if snapped is not None and len(snapped) != len(devices):
        raise field_error("snapped", len(snapped), f"hold one entry per device ({len(devices)})")
    figures = (list(snapped) if snapped is not None else
               [SnappedFigures(tflops=d.tflops, memory_bandwidth_gbs=d.memory_bandwidth_gbs) for d in devices])
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
    fallback = links.allreduce_busbw_gbs if links.world_size > 1 else figures[0].memory_bandwidth_gbs
    nodes = []
    for host, ranks in ranks_of.items():
        inside = [gbs for (a, b), gbs in pairs.items() if hosts[a] == host and hosts[b] == host]
        nodes.append({
            "name": host,
            "intra_bandwidth_gbs": min(inside, default=fallback),
            "devices": [{"name": f"rank{r}", "type": devices[r].type, "tflops": {devices[r].dtype: figures[r].tflops},
                         "efficiency": 1.0, "memory_gb": devices[r].memory_gb,
                         "memory_bandwidth_gbs": figures[r].memory_bandwidth_gbs} for r in ranks],
        })
    across = [gbs for (a, b), gbs in pairs.items() if hosts[a] != hosts[b]]
    inter = min(across, default=min(n["intra_bandwidth_gbs"] for n in nodes))
    return cluster_from_dict({"name": name, "nodes": nodes, "inter_node_bandwidth_gbs": inter,
                              "latency_us": links.latency_us()})


# -- the collective probe ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProbeResult:
    """What ``probe_cluster`` found; equal on every rank."""

    cluster: ClusterSpec
    """The measured cluster, ready for the planner (from the snapped figures)."""
    devices: tuple[DeviceMeasurement, ...]
    """One raw measurement per rank, in rank order (with every round's figure)."""
    links: LinkMeasurement
    """The group's allreduce and point-to-point figures."""
    from_cache: bool
    """True when devices and links were all read from cache files (nothing measured)."""
    snapped: tuple[SnappedFigures, ...] | None = None
    """The figures the cluster gives each rank after like devices were read alike (None: the raw ones)."""
    cached: tuple[str, ...] = ()
    """The parts read from cache files: ``devices``, ``links``, both or none."""
    cached_at: float | None = None
    """When the oldest cache file read was written (seconds since the epoch); None when nothing was read."""
    cache_dir: str | None = None
    """The cache folder the probe read and wrote."""

    def cache_note(self) -> str | None:
        """``using measurements cached 3 h ago (2026-12-01 18:04) at <dir>; ...`` (None when all was measured now)."""
        if not self.cached or self.cached_at is None:
            return None
        what, fresh = {("devices", "links"): ("measurements", ""), ("devices",): ("device measurements", " (links "
                       "measured now)"), ("links",): ("link measurements", " (devices measured now)")}[self.cached]
        return (f"using {what} cached {cache_age(self.cached_at)} at {self.cache_dir}{fresh}; probe=\"refresh\" "
                "(probe_cluster(refresh=True)) to measure again")

    def table(self) -> str:
        """A fixed-width table: one row per rank (raw and snapped figures), the link figures, the bandwidths."""
        dtype = self.devices[0].dtype
        snapped = self.snapped or tuple(SnappedFigures(d.tflops, d.memory_bandwidth_gbs) for d in self.devices)
        header = ["rank", "host", "device", "type", f"{dtype} TFLOPS", "noise", "snapped", "memory GiB",
                  "copy GB/s", "noise", "snapped"]
        rows = [[str(r), d.host, d.raw_name, d.type, f"{d.tflops:.3g}", f"{d.tflops_noise:.0%}",
                 f"{snapped[r].tflops:.3g}", f"{d.memory_gb:.1f}", f"{d.memory_bandwidth_gbs:.1f}",
                 f"{d.memory_bandwidth_noise:.0%}", f"{snapped[r].memory_bandwidth_gbs:.1f}"]
                for r, d in enumerate(self.devices)]
        source = "cached" if self.from_cache else "measured"
        rounds = max((len(d.tflops_rounds) for d in self.devices), default=0)
        lines = [f"Probed cluster `{self.cluster.name}` ({source}; {self.links.backend}, "
                 f"{self.links.world_size} ranks)", *format_table(header, rows, right=set(range(4, 11)) | {0})]
        if rounds:
            lines.append(f"device figures: median of the best 3 of {rounds} rounds, the ranks of a host in turn "
                         "(noise: figure vs median round); snapped: devices of one type equal within noise read as one")
        lines.append("")
        ar_rows = [[_fmt_bytes(t.size_bytes), "allreduce", f"{t.seconds * 1e6:.0f}", f"{t.algbw_gbs:.2f}",
                    f"{t.busbw_gbs:.2f}"] for t in self.links.allreduce]
        p2p_rows = [[_fmt_bytes(t.size_bytes), f"p2p {t.src}->{t.dst}", f"{t.seconds * 1e6:.0f}", f"{t.gbs:.2f}", ""]
                    for t in self.links.p2p]
        lines += format_table(["size", "link", "time us", "GB/s", "bus GB/s"], ar_rows + p2p_rows,
                               right={0, 2, 3, 4})
        intra = ", ".join(f"{n.name} {n.intra_bandwidth_gbs:.2f}" for n in self.cluster.nodes)
        lines.append(f"intra-node GB/s: {intra}; inter-node GB/s: {self.cluster.inter_node_bandwidth_gbs:.2f}")
        note = self.cache_note()
        if note:
            lines.append(note)
        return "\n".join(lines)


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _turns_of_host(hosts: Sequence[str], rank: int) -> InTurn:
    """Each round of ``measure_device`` run by the ranks of one host one after another (collective).

    Every rank passes through ``max ranks per host`` barriers per round, the
    rank of local index t doing its round before the t-th; so on each host one
    rank measures at a time, hosts in parallel, and every rank makes the same
    barrier calls in the same order.  With one rank per host nobody waits.
    """
    turns = max(Counter(hosts).values())
    if turns == 1:
        return lambda round_: round_()
    mine = [r for r, h in enumerate(hosts) if h == hosts[rank]].index(rank)

    def in_turn(round_: Any) -> float:
        result = 0.0
        for turn in range(turns):
            if turn == mine:
                result = round_()
            dist.barrier()  # the next rank of each host starts only when this turn's rounds are all done
        return result

    return in_turn


def _hosts(world: int) -> list[Any]:
    """Step 1 of ``probe_cluster``: every rank's host name, gathered (collective), so each rank knows how many
    ranks share its host (a CPU rank's memory share, the turns of step 2) and which cache files belong to it."""
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts


def _device_figures(device: torch.device, dtype: str, device_path: Path, hosts: list[Any], rank: int,
                    refresh: bool, budget_s: float, rounds: int) -> tuple[DeviceMeasurement, Any, bool]:
    """Step 2 of ``probe_cluster``: this rank's device figure, when it was cached (None: measured now), and
    whether every rank's came from the cache (collective).

    Every rank looks for its device cache file; the "have it" flags are
    gathered and the ranks load only when *all* have one, else all measure.
    ``measure_device`` times square matmuls in the training dtype and a large
    copy (memory bandwidth), each figure the median of the best three of
    ``rounds`` short rounds (interference only slows a round down), and reads
    the device's memory.  The ranks of one host take turns round by round
    (rank a's round 1, rank b's round 1, ..., rank a's round 2, ...; a barrier
    between turns), so they never compete for the host's cores while one
    measures, and a load that comes and goes on the machine falls on every
    rank's rounds alike.  Hosts measure at the same time.
    """
    # load only if every rank can, so that all measure (in turns) or none does
    world = len(hosts)
    same_host = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    entry = None if refresh else read_cache(device_path, DeviceMeasurement.from_dict)
    have: list[Any] = [None] * world
    dist.all_gather_object(have, entry is not None)
    devices_cached = all(have)
    if devices_cached:
        return entry.measurement, entry.written_at, True  # type: ignore[union-attr]
    rank_debug(rank, "probe: measuring %s (turn %d of %d on %s)", device, same_host.index(rank) + 1,
               len(same_host), hosts[rank])
    mine = measure_device(device, dtype, budget_s, num_local_ranks=len(same_host), rounds=rounds,
                          in_turn=_turns_of_host(hosts, rank))
    return mine, None, False


def _link_figures(device: torch.device, cache: Path, hosts: list[Any], rank: int, refresh: bool,
                  sizes_bytes: Sequence[int], repeats: int) -> tuple[LinkMeasurement, Any, bool]:
    """Step 3 of ``probe_cluster``: the links' figures, when they were cached (None: measured now), and whether
    they came from the cache (collective).

    Rank 0 looks for the link cache and broadcasts what it found (or nothing),
    so all ranks take the same branch (other hosts do not have its file);
    otherwise ``measure_links`` times allreduce and ring send/recv at a few
    sizes (median of ``repeats``), and rank 0 writes the cache.  The collectives
    of both branches match on every rank.
    """
    backend = str(dist.get_backend())
    links_path = links_cache_path(cache, hosts, backend, sizes_bytes)
    found: list[Any] = [None]
    if rank == 0 and not refresh:
        cached = read_cache(links_path, LinkMeasurement.from_dict)
        found[0] = None if cached is None else (cached.measurement.to_dict(), cached.written_at)
    dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        return LinkMeasurement.from_dict(found[0][0]), found[0][1], True
    links = measure_links(sizes_bytes, repeats, device)
    if rank == 0:
        write_cache(links_path, links)
    return links, None, False


def probe_cluster(device: torch.device | str, dtype: str = "fp32", cache_dir: str | Path | None = None,
                  name: str = "auto", refresh: bool = False, budget_s: float = 0.5,
                  sizes_bytes: Sequence[int] = DEFAULT_LINK_SIZES, repeats: int = 5,
                  print_table: bool = True, rounds: int = 10,
                  snap_tolerance: float = DEFAULT_SNAP_TOLERANCE) -> ProbeResult:
    """Measure (or load) every rank's device and the group's links; collective over the default group.

    Every rank must call it with the same arguments except ``device`` (its own).
    ``cache_dir`` defaults to ``default_cache_dir()``; ``refresh=True``
    ignores the cache files (and overwrites them).  Each device figure is the
    median of the best three of ``rounds`` rounds; each link size's time the median of
    ``repeats``.  ``snap_tolerance`` (0 turns it off) is how far apart devices
    of one type may measure and still be read as equal.  Rank 0 prints the
    table with ``print`` (to stdout, flushed) unless ``print_table`` is False;
    the cache note (age, path, how to refresh) also goes to the
    ``het_strategy`` logger.

    Every step is collective over the default process group:

    1. hosts: each rank's host name is gathered (``_hosts``);
    2. devices: all ranks load their cache files or all measure, in turns per
       host (``_device_figures``);
    3. links: rank 0's cache decides for everyone, else all measure
       (``_link_figures``);
    4. The device figures are gathered to all ranks; devices of one type whose
       figures are equal within noise are read as one figure
       (``snap_like_devices``: within ``snap_tolerance``, default 10%, or the
       figures' own noise); freshly measured figures go to the cache, the raw
       rounds with the snapped figures beside them.  ``cluster_from_measurements``
       builds the ``ClusterSpec`` from the snapped figures (TFLOPS with efficiency
       1.0: measured figures are already sustained).  The table shows raw and snapped figures and, when figures came from the
       cache, how old they are and how to measure again.

    Tuning advice: ``budget_s`` is the timed work per device figure (all
    ``rounds`` together); 0.5 s in 10 rounds is stable on an idle accelerator and
    on a host shared with a busy process; on a heavily loaded one raise
    ``rounds`` (more chances of an undisturbed round) with the budget.  Taking
    turns makes the device step take about ``2 x budget_s x ranks per host``.
    The link sizes default to 64 KiB, 1 MiB and 8 MiB; bandwidth figures are
    read at the largest size, so add a larger one (e.g. 64 MiB) for fast
    NVLink/InfiniBand fabrics where 8 MiB does not yet saturate the link.  Pass
    ``refresh=True`` (``HeteroStrategy(probe="refresh")``) after hardware or
    driver changes, or when the cached figures were measured on a loaded
    machine; the cache does not notice.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("probe_cluster needs an initialised torch.distributed default process group")
    snap_like_devices([], snap_tolerance)  # a bad tolerance fails on every rank before any collective
    device = indexed_device(torch.device(device))
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    rank, world = dist.get_rank(), dist.get_world_size()

    hosts = _hosts(world)
    same_host = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    device_path = device_cache_path(cache, device, dtype, same_host.index(rank), len(same_host))
    mine, mine_at, devices_cached = _device_figures(device, dtype, device_path, hosts, rank, refresh, budget_s,
                                                    rounds)
    links, links_at, links_cached = _link_figures(device, cache, hosts, rank, refresh, sizes_bytes, repeats)

    # 4. everyone gets every rank's figures, snaps them alike and builds the same ClusterSpec
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (mine.to_dict(), mine_at))
    devices = tuple(DeviceMeasurement.from_dict(d) for d, _ in gathered)
    snapped = snap_like_devices(devices, snap_tolerance)
    if not devices_cached:
        write_cache(device_path, mine, notes={"snapped": snapped[rank].to_dict(), "snap_tolerance": snap_tolerance})
    times = [t for _, t in gathered if t is not None] + ([links_at] if links_at is not None else [])
    parts = tuple(part for part, hit in (("devices", devices_cached), ("links", links_cached)) if hit)
    result = ProbeResult(cluster=cluster_from_measurements(devices, links, name, snapped), devices=devices,
                         links=links, from_cache=devices_cached and links_cached, snapped=snapped, cached=parts,
                         cached_at=min(times, default=None), cache_dir=str(cache))
    if rank == 0 and print_table:
        print(result.table(), flush=True)
    note = result.cache_note()
    if note:
        rank_zero_info(rank, "probe: %s", note)
    return result
