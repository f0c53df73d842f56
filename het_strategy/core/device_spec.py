"""One device of a cluster: ``DeviceSpec``, and the cluster YAML's device entry that builds it.

A device entry names a catalog type (``{type: A100-40GB, count: 2}``) and may
override any of its figures (``tflops:``, ``memory_gb:``, ``efficiency:``,
``price_per_hour:``, ``codec_gbs:``, ...), or describe a custom device by its own figures.
``device_from_dict`` resolves the catalog entry and the overrides; every
figure is checked, and a bad one raises ``ConfigError`` naming the dotted field
(``nodes[1].devices[0].price_per_hour``), the value and the rule.
``cluster.py`` groups the devices into nodes.  Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from het_strategy.core.catalog import DTYPES, DeviceType, lookup_device_type
from het_strategy.core.dtypes import Dtype, Float32MatmulPrecision, fast_dtype
from het_strategy.core.cluster_limits import bounded_figure as _figure, check_figure
from het_strategy.core.errors import ConfigError, field_error, is_positive, require_number

__all__ = ["DEVICE_KEYS", "MAX_PRICE_PER_HOUR", "DeviceSpec", "resolve_device_type", "device_from_dict",
           "check_price", "check_codec_gbs"]

DEVICE_KEYS = {"name", "type", "count", "tflops", "memory_gb", "memory_bandwidth_gbs", "efficiency",
               "emulated_speed", "price_per_hour", "codec_gbs"}
"""Keys a device entry of a cluster YAML may have."""
MAX_PRICE_PER_HOUR = 1e4
"""Highest price per device-hour accepted (USD): far beyond any rented accelerator, far from float overflow."""


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator in the cluster, its datasheet figures resolved and overridden."""

    name: str
    """Unique device name, ``<node>/<index>`` unless given."""
    type: str
    """Device type name (catalog name or a custom one)."""
    node: str
    """Name of the node that holds it."""
    tflops: Mapping[str, float]
    """Peak dense TFLOPS per dtype (measured figures replace datasheet ones)."""
    memory_gb: float
    """Usable memory, GiB."""
    memory_bandwidth_gbs: float
    """Memory bandwidth, GB/s."""
    efficiency: float
    """Fraction of peak reached in training; 1.0 when ``tflops`` was measured."""
    emulated_speed: float | None = None
    """Relative speed when a local process emulates this device (tests, benchmarks)."""
    price_per_hour: float | None = None
    """USD per device-hour (the catalog's list price unless overridden); None: unknown (a custom device)."""
    compute_units: int | None = None
    """The catalog's streaming multiprocessors / compute units, for the roofline (``compute_model.py``); None
    where the device's own figures price it instead: a custom or CPU device, measured ``tflops`` or an
    ``efficiency`` given in the cluster file, or an emulated device."""
    tf32_tflops: float | None = None
    """The catalog's dense TF32 rate, the rate of fp32 matmuls under ``float32_matmul_precision`` high or medium
    (``matmul_rate``); None without TF32 units, for a custom device, and where the cluster file gives measured
    ``tflops`` or an emulated speed (those figures price the device as they are)."""
    codec_gbs: float | None = None
    """GB/s of fp32 input this device quantizes and dequantizes (the catalog's measured figure unless overridden);
    None: not measured (``compressed_sync.codec_bandwidth`` takes a fraction of the memory bandwidth)."""

    def __post_init__(self) -> None:
        where = f"device `{self.name}`"
        if not self.tflops or any(not is_positive(v) for v in self.tflops.values()):
            raise field_error(f"{where}.tflops", dict(self.tflops), "hold positive numbers (TFLOPS)")
        for key in self.tflops:
            if key not in DTYPES:
                raise field_error(f"{where}.tflops", key, f"name a dtype in {DTYPES}")
        if not is_positive(self.memory_gb):
            raise field_error(f"{where}.memory_gb", self.memory_gb, "be > 0 (GiB of device memory)")
        for key, value in [*((f"tflops.{k}", v) for k, v in self.tflops.items()), ("memory_gb", self.memory_gb)]:
            check_figure(value, f"{where}.{key}", key.split(".")[0])  # huge figures overflow the cost model
        if not is_positive(self.memory_bandwidth_gbs):
            raise field_error(f"{where}.memory_bandwidth_gbs", self.memory_bandwidth_gbs, "be > 0 (GB/s)")
        if not (is_positive(self.efficiency) and self.efficiency <= 1):
            raise field_error(f"{where}.efficiency", self.efficiency, "be in (0, 1]")
        if self.emulated_speed is not None and not is_positive(self.emulated_speed):
            raise field_error(f"{where}.emulated_speed", self.emulated_speed, "be > 0 (relative speed)")
        if self.price_per_hour is not None:
            check_price(self.price_per_hour, f"{where}.price_per_hour")
        if self.codec_gbs is not None:
            check_codec_gbs(self.codec_gbs, f"{where}.codec_gbs")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 2**30

    def compute_dtype(self, dtype: str) -> Dtype:
        """The dtype this device computes a ``dtype`` run in: ``per_device`` is its fast 16-bit dtype
        (``dtypes.fast_dtype``), any other dtype itself."""
        return fast_dtype(self.tflops) if dtype == Dtype.per_device else Dtype(dtype)

    def matmul_rate(self, dtype: str, float32_matmul: Float32MatmulPrecision | str = Float32MatmulPrecision.highest
                    ) -> tuple[str, float]:
        """(the unit, its peak dense TFLOPS) the matmuls of a ``dtype`` run compute at (``per_device``: this
        device's ``compute_dtype``): the dtype's own rate; fp32 at the TF32 tensor-core rate (``tf32``) where
        ``float32_matmul`` is ``high`` or ``medium`` and the device has TF32 units (``tf32_tflops``), as torch
        runs it, else at the fp32 rate; a dtype without a rate here at the fp32 rate (``fp32``)."""
        dtype = self.compute_dtype(dtype)
        if dtype in self.tflops and dtype != Dtype.fp32:
            return str(dtype), self.tflops[dtype]
        if (dtype == Dtype.fp32 and self.tf32_tflops
                and Float32MatmulPrecision(float32_matmul) != Float32MatmulPrecision.highest):
            return "tf32", self.tf32_tflops
        return str(Dtype.fp32), self.tflops.get(Dtype.fp32, min(self.tflops.values()))

    def flops_per_second(self, dtype: str,
                         float32_matmul: Float32MatmulPrecision | str = Float32MatmulPrecision.highest) -> float:
        """Sustained FLOP/s for ``dtype``: the peak of ``matmul_rate`` x ``efficiency`` x the emulated speed, if
        any (``float32_matmul``: ``settings.float32_matmul_precision``, which only fp32 reads)."""
        peak = self.matmul_rate(dtype, float32_matmul)[1]
        return peak * 1e12 * self.efficiency * (self.emulated_speed or 1.0)


def check_price(value: Any, field: str) -> float:
    """A price per device-hour: a finite number in (0, ``MAX_PRICE_PER_HOUR``] USD (bools are not numbers)."""
    rule = f"be a number > 0 and <= {MAX_PRICE_PER_HOUR:g} (USD per device-hour)"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise field_error(field, value, rule, "e.g. price_per_hour: 3.67")
    if not 0 < value <= MAX_PRICE_PER_HOUR:
        raise field_error(field, value, rule, "e.g. price_per_hour: 3.67")
    return float(value)


def check_codec_gbs(value: Any, field: str) -> float:
    """A codec throughput: a finite number > 0 GB/s within the memory bandwidth's plausible range (bools are not
    numbers)."""
    if not is_positive(value):
        raise field_error(field, value, "be a finite number > 0 (GB/s of fp32 input quantized and dequantized)",
                          "e.g. codec_gbs: 40, as benchmarks/gpu_calibration.py measures it")
    return check_figure(float(value), field, "memory_bandwidth_gbs")


def resolve_device_type(dev_raw: Mapping[str, Any], where: str) -> DeviceType | None:
    """The catalog entry a device entry names; None for a custom device described by its own figures."""
    type_name = dev_raw.get("type")
    if not isinstance(type_name, str) or not type_name:
        raise field_error(f"{where}.type", type_name, "be a device type name (string)")
    explicit = all(k in dev_raw for k in ("tflops", "memory_gb", "memory_bandwidth_gbs"))
    try:
        return lookup_device_type(type_name, f"{where}.type")
    except ConfigError:
        if explicit:
            return None  # a custom device described by its own figures
        raise


def device_from_dict(dev_raw: Mapping[str, Any], name: str, node: str, dt: DeviceType | None,
                     where: str) -> DeviceSpec:
    """The DeviceSpec of one device entry (``where`` is its dotted path, e.g. ``nodes[1].devices[0]``)."""
    tflops_raw = dev_raw.get("tflops")
    if tflops_raw is None:
        tflops = dict(dt.tflops)  # type: ignore[union-attr]
    elif isinstance(tflops_raw, (int, float)) and not isinstance(tflops_raw, bool):
        # one measured figure: applies to every dtype the device supports
        base = dt.tflops if dt else {"fp32": 1.0}
        tflops = {k: check_figure(float(tflops_raw), f"{where}.tflops", "tflops") for k in base}
    elif isinstance(tflops_raw, Mapping):
        tflops = {str(k): _figure(v, f"{where}.tflops.{k}", "tflops") for k, v in tflops_raw.items()}
    else:
        raise field_error(f"{where}.tflops", tflops_raw, "be a number or a mapping dtype -> TFLOPS")
    measured = tflops_raw is not None
    # the catalog's roofline prices a catalog GPU; a throughput the user gave, or an emulated speed, is used as is
    datasheet = dt is not None and not measured and "efficiency" not in dev_raw and "emulated_speed" not in dev_raw
    eff_default = 1.0 if (measured and "efficiency" not in dev_raw) else (dt.efficiency if dt else 1.0)
    speed = dev_raw.get("emulated_speed")
    if "price_per_hour" in dev_raw:
        price: float | None = check_price(dev_raw["price_per_hour"], f"{where}.price_per_hour")
    else:
        price = dt.price_per_hour if dt else None
    if "codec_gbs" in dev_raw:
        codec_gbs: float | None = check_codec_gbs(dev_raw["codec_gbs"], f"{where}.codec_gbs")
    else:
        codec_gbs = dt.codec_gbs if dt else None
    return DeviceSpec(
        name=name,
        type=dt.name if dt else str(dev_raw["type"]),
        node=node,
        tflops=tflops,
        memory_gb=_figure(dev_raw.get("memory_gb", dt.memory_gb if dt else None), f"{where}.memory_gb", "memory_gb"),
        memory_bandwidth_gbs=_figure(dev_raw.get("memory_bandwidth_gbs", dt.memory_bandwidth_gbs if dt else None),
                                     f"{where}.memory_bandwidth_gbs", "memory_bandwidth_gbs"),
        efficiency=require_number(dev_raw.get("efficiency", eff_default), f"{where}.efficiency"),
        emulated_speed=None if speed is None else _figure(speed, f"{where}.emulated_speed", "emulated_speed"),
        price_per_hour=price,
        compute_units=dt.compute_units if datasheet else None,  # type: ignore[union-attr]
        # an efficiency given in the file keeps the TF32 units; measured tflops or an emulated speed price as given
        tf32_tflops=dt.tf32_tflops if dt is not None and not measured and speed is None else None,
        codec_gbs=codec_gbs,
    )
