"""What the runtime probe measured: one rank's device, and the process group's links.

Plain frozen dataclasses with a JSON form (``to_dict`` / ``from_dict``): they
travel between ranks as dicts, sit in the probe's cache files, and become a
``ClusterSpec`` in ``probe.cluster_from_measurements``.  Measuring them is
``device_probe.py`` and ``link_probe.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

from het_strategy.core.catalog import DTYPES
from het_strategy.core.errors import field_error, require_number

__all__ = ["DeviceMeasurement", "AllreduceTiming", "P2PTiming", "LinkMeasurement"]


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
