"""The probe's cache: one JSON file per (host, device, dtype) and one per set of hosts, backend and sizes.

A re-run on the same hosts loads the figures instead of measuring them.  The
cache does not notice hardware or driver changes, nor a machine that was busy
when it measured: ``probe_cluster(refresh=True)`` (``HeteroStrategy(probe="refresh")``)
measures anew and overwrites the files, and every file records when it was
written (``written_at``), so the probe's message can say how old the figures
are (``cache_age``).  A file of another ``CACHE_FORMAT`` is stale; a corrupt
one is measured anew with a warning, never fatal.  Files are written
atomically, so ranks reading while another writes see the old or the new file,
never half of one.  Besides the measurement a file may hold notes for a reader
(the device files: the snapped figures the probe gave the rank), which reading
ignores.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from het_strategy.core.atomic_file import write_atomic
from het_strategy.core.files import read_json_file
from het_strategy.profiling.measurements import DeviceMeasurement, LinkMeasurement

__all__ = ["CACHE_FORMAT", "CachedMeasurement", "cache_age", "default_cache_dir", "device_cache_path",
           "links_cache_path", "read_cache", "write_cache"]

CACHE_FORMAT = 2
"""Bumped when a cache file's content changes meaning; older files are measured anew.
2: device figures are medians of rounds measured in turn (1: one concurrent run); files carry ``written_at``."""


@dataclass(frozen=True)
class CachedMeasurement:
    """A measurement read from a cache file, with when it was written."""

    measurement: Any
    """The parsed measurement (``DeviceMeasurement`` or ``LinkMeasurement``)."""
    written_at: float
    """Seconds since the epoch when the file was written."""


def default_cache_dir() -> Path:
    """``$HET_STRATEGY_CACHE`` if set, else ``~/.cache/het_strategy/probe``."""
    env = os.environ.get("HET_STRATEGY_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "het_strategy" / "probe"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_") or "x"


def device_cache_path(cache_dir: Path, device: torch.device, dtype: str, local_index: int, num_local: int) -> Path:
    """Per host, device and dtype; a CPU file also names the rank's share (i of n) of the host."""
    host = _slug(socket.gethostname())
    if device.type == "cuda":
        slug = f"{_slug(torch.cuda.get_device_name(device))}-cuda{device.index}"
    else:
        slug = f"{_slug(platform.processor() or 'cpu')}-cpu{local_index}of{num_local}"
    return cache_dir / f"device-{host}-{slug}-{dtype}.json"


def links_cache_path(cache_dir: Path, hosts: Sequence[str], backend: str, sizes: Sequence[int]) -> Path:
    """Keyed by the host of every rank (in rank order: the ring's pairs depend on it), backend and sizes."""
    key = json.dumps({"hosts": list(hosts), "backend": backend, "sizes": sorted(set(sizes))})
    return cache_dir / f"links-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def read_cache(path: Path, parse: Callable[[Mapping[str, Any]], Any]) -> CachedMeasurement | None:
    """The parsed cache file and its time, or None when it is missing, stale or corrupt (corrupt: with a warning)."""
    if not path.exists():
        return None
    try:
        raw = read_json_file(path, "probe_cache_dir", "probe cache file")[1]  # a pipe or folder: refused, not read
        if raw.get("format") != CACHE_FORMAT:
            return None
        return CachedMeasurement(measurement=parse(raw["measurement"]), written_at=float(raw["written_at"]))
    except Exception as exc:  # any unreadable file is re-measured, never fatal
        warnings.warn(f"probe cache file {path} is unreadable ({type(exc).__name__}: {exc}); measuring again",
                      stacklevel=3)
        return None


def write_cache(path: Path, measurement: DeviceMeasurement | LinkMeasurement,
                notes: Mapping[str, Any] | None = None) -> None:
    """Write ``measurement`` to ``path`` (atomically), tagged with ``CACHE_FORMAT`` and the time; ``notes`` ride
    along for a reader of the file."""
    content = {"format": CACHE_FORMAT, "written_at": time.time(), "measurement": measurement.to_dict()}
    write_atomic(path, json.dumps(dict(notes or {}) | content, indent=1))


def cache_age(written_at: float, now: float | None = None) -> str:
    """How long ago ``written_at`` was, and when: ``3 h ago (2026-12-01 18:04)`` (local time)."""
    seconds = max(0.0, (time.time() if now is None else now) - written_at)
    if seconds < 60:
        ago = f"{seconds:.0f} s"
    elif seconds < 3600:
        ago = f"{seconds / 60:.0f} min"
    elif seconds < 2 * 86400:
        ago = f"{seconds / 3600:.0f} h"
    else:
        ago = f"{seconds / 86400:.0f} days"
    return f"{ago} ago ({time.strftime('%Y-%m-%d %H:%M', time.localtime(written_at))})"
