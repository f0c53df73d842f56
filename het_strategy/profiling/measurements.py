"""What the runtime probe measured: one rank's device, and the process group's links; like devices read alike.

Plain frozen dataclasses with a JSON form (``to_dict`` / ``from_dict``): they
travel between ranks as dicts, sit in the probe's cache files, and become a
``ClusterSpec`` in ``probe.cluster_from_measurements``.  Measuring them is
``device_probe.py`` and ``link_probe.py``.

``snap_like_devices`` reads the raw figures of devices of one type as one
figure when they differ by no more than measurement noise (see its docstring):
on a busy host three identical CPU ranks never measure exactly alike, and
planning from the raw figures would hand them needlessly unequal shares.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from het_strategy.core.catalog import DTYPES
from het_strategy.core.errors import field_error, require_number

__all__ = ["DeviceMeasurement", "AllreduceTiming", "P2PTiming", "LinkMeasurement", "SnappedFigures",
           "snap_like_devices", "peak_noise", "best_rounds_figure", "DEFAULT_SNAP_TOLERANCE"]

DEFAULT_SNAP_TOLERANCE = 0.1
"""Devices of one type whose figures differ by at most this fraction (or their own noise) are read as equal."""
_BEST_ROUNDS = 3
"""A figure is the median of this many best rounds."""
_MAX_NOISE = 0.25
"""The most a figure's own noise may widen the snapping tolerance."""


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
    """Sustained square-matmul TFLOPS in ``dtype``: ``best_rounds_figure(tflops_rounds)`` (when there are rounds)."""
    memory_gb: float
    """Memory this rank may use, GiB (a CPU rank gets its share of the host's memory)."""
    memory_bandwidth_gbs: float
    """Sustained copy bandwidth (bytes read + written), GB/s: the same figure of its rounds."""
    tflops_rounds: tuple[float, ...] = ()
    """TFLOPS of each timed round, in the order they ran (empty for figures given by hand)."""
    memory_bandwidth_rounds_gbs: tuple[float, ...] = ()
    """Copy GB/s of each timed round."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise field_error("dtype", self.dtype, f"be one of {DTYPES}")
        for name in ("tflops", "memory_gb", "memory_bandwidth_gbs"):
            require_number(getattr(self, name), name)
        for name in ("tflops_rounds", "memory_bandwidth_rounds_gbs"):
            rounds = tuple(getattr(self, name))
            for i, value in enumerate(rounds):
                require_number(value, f"{name}[{i}]")
            object.__setattr__(self, name, tuple(float(v) for v in rounds))

    @property
    def tflops_noise(self) -> float:
        """How well the figure is known: ``peak_noise(tflops_rounds)``."""
        return peak_noise(self.tflops_rounds)

    @property
    def memory_bandwidth_noise(self) -> float:
        """``peak_noise`` of the copy rounds."""
        return peak_noise(self.memory_bandwidth_rounds_gbs)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["tflops_rounds"] = list(self.tflops_rounds)
        out["memory_bandwidth_rounds_gbs"] = list(self.memory_bandwidth_rounds_gbs)
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "DeviceMeasurement":
        """Inverse of ``to_dict``; a missing or unknown key raises ``ConfigError`` (the rounds may be left out)."""
        if isinstance(raw, Mapping):
            raw = {"tflops_rounds": (), "memory_bandwidth_rounds_gbs": (), **raw}
        return cls(**_fields_of(cls, raw, "device measurement"))


def best_rounds_figure(values: Sequence[float]) -> float:
    """The figure of a set of timed rounds: the median of the best three (of all, with fewer).

    Interference only slows a round down, so the fastest rounds are the least
    disturbed; the median of three of them rather than the single best, so
    that one lucky round does not set the figure (on a loaded host the best
    of ten rounds differed by up to 13% between identical ranks, the median of
    the best three by about half that).
    """
    if not values:
        raise field_error("rounds", [], "hold at least one timed round")
    return statistics.median(sorted(values, reverse=True)[:_BEST_ROUNDS])


def peak_noise(values: Sequence[float]) -> float:
    """(figure - median) / figure of ``values``, the figure being ``best_rounds_figure``: how far a typical round
    falls short of the figure, i.e. how well it is known (0 with fewer than two values)."""
    if len(values) < 2:
        return 0.0
    top = best_rounds_figure(values)
    return max(0.0, (top - statistics.median(values)) / top) if top > 0 else 0.0


@dataclass(frozen=True)
class SnappedFigures:
    """The figures the probed cluster gives one rank, after like devices were read alike."""

    tflops: float
    """TFLOPS in the measured dtype: the median of the rank's snap group (its raw figure when alone)."""
    memory_bandwidth_gbs: float
    """Copy GB/s, snapped the same way (its own groups: the two figures are snapped independently)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def snap_like_devices(devices: Sequence[DeviceMeasurement],
                      tolerance: float = DEFAULT_SNAP_TOLERANCE) -> tuple[SnappedFigures, ...]:
    """One ``SnappedFigures`` per device: devices of one type measured alike get one figure.

    1. Devices are grouped by what they are: the same ``type``, ``raw_name``,
       ``dtype`` and kind of torch device (``cpu``, ``cuda``).
    2. Within a group, each figure (TFLOPS; copy bandwidth) is sorted; starting
       from the smallest, the devices within ``anchor x (1 + tol)`` form one
       snap group, where ``tol`` is the larger of ``tolerance`` and the two
       devices' noise added up (``tflops_noise``: how far each one's median
       round falls short of its figure; two such figures can differ by about
       both), the noise counting up to 25% at most.  The
       rest repeat step 2.
    3. Every device of a snap group gets the group's median.

    So a 5% difference between two identical CPUs on a busy host is read as
    none, while a GPU throttled to 80% of its twin's speed keeps its own figure
    (unless their rounds scatter by 20% or more: then the measurement cannot
    tell them apart).  ``tolerance=0`` turns snapping off (the raw figures are kept).
    Pure Python: no process group.
    """
    if not (isinstance(tolerance, (int, float)) and 0 <= tolerance < 1):
        raise field_error("snap_tolerance", tolerance, "be a fraction in [0, 1) (0 turns snapping off)")
    keys = [(d.type, d.raw_name, d.dtype, d.device.split(":")[0]) for d in devices]
    tflops = _snap([d.tflops for d in devices], [d.tflops_noise for d in devices], keys, tolerance)
    copy = _snap([d.memory_bandwidth_gbs for d in devices], [d.memory_bandwidth_noise for d in devices], keys,
                 tolerance)
    return tuple(SnappedFigures(tflops=t, memory_bandwidth_gbs=c) for t, c in zip(tflops, copy))


def _snap(values: list[float], spreads: list[float], keys: list[tuple], tolerance: float) -> list[float]:
    """``values`` with each snap group replaced by its median (steps 2-3 of ``snap_like_devices``)."""
    out = list(values)
    if tolerance == 0:
        return out
    for key in dict.fromkeys(keys):
        left = sorted((i for i, k in enumerate(keys) if k == key), key=lambda i: values[i])
        while left:
            anchor = left[0]
            limit = [values[anchor] * (1 + _tolerance(tolerance, spreads[anchor], spreads[i])) for i in left]
            group = [i for i, most in zip(left, limit) if values[i] <= most]
            median = statistics.median(values[i] for i in group)
            for i in group:
                out[i] = median
            left = [i for i in left if i not in group]
    return out


def _tolerance(tolerance: float, spread_a: float, spread_b: float) -> float:
    """The snapping tolerance of a pair: ``tolerance``, widened to the pair's noise (at most ``_MAX_NOISE``)."""
    return max(tolerance, min(_MAX_NOISE, spread_a + spread_b))


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

    def latency_us(self) -> float:
        """Per-message latency (alpha) of an alpha-beta fit ``t = alpha + bytes / beta`` to every measured
        point-to-point time (least squares over all pairs and sizes), microseconds, >= 0; 0 without sizes
        to fit (one rank, or one size)."""
        points = [(t.size_bytes, t.seconds) for t in self.p2p]
        if len({b for b, _ in points}) < 2:
            return 0.0
        n = len(points)
        mx = sum(b for b, _ in points) / n
        my = sum(t for _, t in points) / n
        sxx = sum((b - mx) ** 2 for b, _ in points)
        slope = sum((b - mx) * (t - my) for b, t in points) / sxx
        return max(0.0, (my - slope * mx) * 1e6)

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
