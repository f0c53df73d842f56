"""The device catalog: datasheet figures of accelerator models, from the shipped ``catalog.yaml``.

A cluster file names a device by its type (``A100-40GB``, or an alias such as
Sailor's ``A100-40``); ``lookup_device_type`` finds the entry (datasheet
figures and an approximate on-demand price per device-hour), and
``catalog_device_name`` maps the name a runtime reports
(``torch.cuda.get_device_name()``) to an entry.  Nothing here imports torch.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import yaml

from het_strategy.core.dtypes import ELEMENT_DTYPES, Dtype
from het_strategy.core.errors import ConfigError, field_error

__all__ = ["DTYPES", "DeviceType", "device_catalog", "lookup_device_type", "catalog_device_name"]

DTYPES: tuple[str, ...] = tuple(str(d) for d in ELEMENT_DTYPES)
"""The dtypes a catalog entry (and a device) gives TFLOPS for: ``ELEMENT_DTYPES``."""
_CATALOG_PATH = Path(__file__).with_name("catalog.yaml")
_SIZE_OR_FORM_FACTOR = re.compile(r"\d+GB|SXM\d*|PCIE")


@dataclass(frozen=True)
class DeviceType:
    """One catalog entry: datasheet figures of an accelerator model."""

    name: str
    """Canonical name, e.g. ``A100-40GB``."""
    vendor: str
    """``nvidia``, ``amd`` or ``cpu``."""
    tflops: Mapping[str, float]
    """Peak dense TFLOPS per training dtype; a missing dtype is unsupported."""
    memory_gb: float
    """Device memory in GiB."""
    memory_bandwidth_gbs: float
    """Device memory bandwidth in GB/s."""
    efficiency: float
    """Fraction of peak a transformer layer reaches in training."""
    intra_node_bandwidth_gbs: float
    """Typical device-to-device bandwidth inside one node, GB/s."""
    price_per_hour: float
    """Approximate on-demand list price, USD per device-hour (2024; see ``catalog.yaml``)."""
    aliases: tuple[str, ...] = ()
    """Other names accepted in cluster files (Sailor's ``A100-40``, ...)."""
    compute_units: int | None = None
    """Streaming multiprocessors (NVIDIA) or compute units (AMD): the roofline's wave quantisation
    (``compute_model.py``); None for a device the roofline does not price (the CPU)."""
    tf32_tflops: float | None = None
    """Peak dense TF32 tensor-core TFLOPS, the rate of fp32 matmuls under ``float32_matmul_precision`` high or
    medium; None: no TF32 units (fp32 matmuls run at the fp32 rate)."""
    codec_gbs: float | None = None
    """GB/s of fp32 input one device quantizes and dequantizes, measured by ``benchmarks/gpu_calibration.py``;
    None: not measured (``compressed_sync.codec_bandwidth`` takes a fraction of the memory bandwidth)."""


@functools.lru_cache(maxsize=1)
def device_catalog() -> dict[str, DeviceType]:
    """The shipped catalog, keyed by canonical name."""
    raw = yaml.safe_load(_CATALOG_PATH.read_text())
    return {
        name: DeviceType(
            name=name,
            vendor=e["vendor"],
            tflops=dict(e["tflops"]),
            memory_gb=float(e["memory_gb"]),
            memory_bandwidth_gbs=float(e["memory_bandwidth_gbs"]),
            efficiency=float(e["efficiency"]),
            intra_node_bandwidth_gbs=float(e["intra_node_bandwidth_gbs"]),
            price_per_hour=float(e["price_per_hour"]),
            aliases=tuple(e.get("aliases", ())),
            compute_units=e.get("compute_units"),
            tf32_tflops=e.get("tf32_tflops"),
            codec_gbs=None if e.get("codec_gbs") is None else float(e["codec_gbs"]),
        )
        for name, e in raw.items()
    }


def lookup_device_type(name: str, field_name: str = "type") -> DeviceType:
    """Find a catalog entry by canonical name or alias (case-insensitive)."""
    wanted = str(name).strip().lower()
    for dt in device_catalog().values():
        if wanted == dt.name.lower() or wanted in (a.lower() for a in dt.aliases):
            return dt
    known = ", ".join(device_catalog())
    raise field_error(field_name, name, f"be a device type in the catalog ({known})",
                      "or give explicit figures: tflops, memory_gb, memory_bandwidth_gbs")


def catalog_device_name(raw_name: str, memory_gb: float | None = None) -> str:
    """The catalog name of a device reported as ``raw_name`` (e.g. ``torch.cuda.get_device_name()``).

    ``"NVIDIA A100-SXM4-80GB"`` -> ``A100-80GB``, ``"NVIDIA H100 80GB HBM3"`` -> ``H100-SXM``,
    ``"NVIDIA GeForce RTX 4090"`` -> ``RTX-4090``.  Every word of the catalog name
    (memory size and form factor aside) must appear in ``raw_name``; a memory
    size in the raw name, else ``memory_gb``, picks between entries of one
    model.  An unknown device keeps its raw name.
    """
    try:
        return lookup_device_type(raw_name).name
    except ConfigError:
        pass
    words = set(_words(raw_name))
    raw_mem = next((int(w[:-2]) for w in words if re.fullmatch(r"\d+GB", w)), None)
    wanted_mem = raw_mem if raw_mem is not None else memory_gb
    candidates = []
    for entry in device_catalog().values():
        entry_words = [w for w in _words(entry.name) if not _SIZE_OR_FORM_FACTOR.fullmatch(w)]
        if entry_words and all(w in words for w in entry_words):
            candidates.append(entry)
    if not candidates:
        return raw_name
    if wanted_mem is None or len(candidates) == 1:
        return candidates[0].name
    return min(candidates, key=lambda e: abs(e.memory_gb - wanted_mem)).name


def _words(text: str) -> list[str]:
    return re.split(r"[\s\-_/()]+", text.upper().strip())
