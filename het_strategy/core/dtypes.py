"""The dtype names of the package: one table each, one spelling per dtype.

* ``Dtype`` — a training dtype, what the cost model prices a model in and a
  plan records (``settings.dtype``, ``settings.grad_dtype``, ``plan.dtype``,
  a workload's activation dtype); ``DTYPE_BYTES`` is each one's element size.
  ``Dtype.per_device`` is a 16-bit run where each device computes in the
  16-bit dtype it is fast at (``fast_dtype``); ``ELEMENT_DTYPES`` are the
  others, the ones a tensor, a datasheet rate or a gradient has.
* ``InputDtype`` — the tensor dtype of a sample input het-plan builds for a
  model given as a Python path (``model_input.dtype``), named as torch names it.
* ``PRECISION_DTYPES`` — Lightning's ``precision`` strings and the ``Dtype``
  each trains in (``precision_dtype``; het-train's ``train.precision`` too).
* ``Float32MatmulPrecision`` — torch's ``set_float32_matmul_precision`` setting,
  the unit fp32 matmuls run on (``settings.float32_matmul_precision``).

The enums are ``StrEnum``s whose member names are the config spellings (Hydra
matches an enum value by name), so a member compares equal to, hashes as and
serialises as its string: ``Dtype.bf16 == "bf16"`` and JSON writes ``"bf16"``.
``as_dtype`` turns a string into a member or raises ``ConfigError`` naming the
field, the value and the allowed names.  Pure Python: no torch.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Mapping

from het_strategy.core.errors import field_error, require_option

__all__ = ["Dtype", "ELEMENT_DTYPES", "DTYPE_BYTES", "as_dtype", "as_element_dtype", "fast_dtype", "InputDtype",
           "PRECISION_DTYPES", "precision_dtype", "Float32MatmulPrecision"]


class Dtype(StrEnum):
    """A training dtype (member names are the config spellings)."""

    fp32 = "fp32"
    """IEEE single precision."""
    fp16 = "fp16"
    """IEEE half precision (mixed precision with loss scaling)."""
    bf16 = "bf16"
    """bfloat16 (mixed precision)."""
    per_device = "per_device"
    """Mixed precision in each device's own fast 16-bit dtype: bf16 where the device runs bf16 at least as
    fast as fp16 (A100, H100, L4, MI250X, ...), fp16 with loss scaling where it has no fast bf16 (V100, T4);
    fp32 master weights and an fp32 gradient reduction."""

    @property
    def bytes(self) -> int:
        """Bytes of one element."""
        return DTYPE_BYTES[self]


ELEMENT_DTYPES: tuple[Dtype, ...] = (Dtype.fp32, Dtype.fp16, Dtype.bf16)
"""The dtypes a tensor, a datasheet rate or a gradient on the wire has (every ``Dtype`` but ``per_device``)."""

DTYPE_BYTES: dict[Dtype, int] = {Dtype.fp32: 4, Dtype.fp16: 2, Dtype.bf16: 2, Dtype.per_device: 2}
"""Bytes of one element of each training dtype (a key also matches its plain string: ``DTYPE_BYTES["fp32"]``);
``per_device`` activations are 16-bit on every device."""


def as_dtype(value: Any, field: str) -> Dtype:
    """``value`` (a ``Dtype`` or its name) as a ``Dtype``; ConfigError naming ``field`` and the dtypes otherwise."""
    return require_option(Dtype, value, field)


def as_element_dtype(value: Any, field: str) -> Dtype:
    """``value`` as one of ``ELEMENT_DTYPES`` (not ``per_device``); ConfigError naming ``field`` otherwise."""
    dtype = as_dtype(value, field)
    if dtype not in ELEMENT_DTYPES:
        raise field_error(field, str(value), f"be one of {', '.join(ELEMENT_DTYPES)} (a tensor's dtype)")
    return dtype


PRECISION_DTYPES: dict[str, Dtype] = {
    "32": Dtype.fp32, "32-true": Dtype.fp32, "64": Dtype.fp32, "64-true": Dtype.fp32,
    "transformer-engine": Dtype.bf16, "bf16": Dtype.bf16, "bf16-mixed": Dtype.bf16, "bf16-true": Dtype.bf16,
    "16": Dtype.fp16, "16-mixed": Dtype.fp16, "16-true": Dtype.fp16, "per_device": Dtype.per_device}
"""Lightning's ``precision`` strings and the dtype the cost model prices each in; ``per_device`` is the
``hetero`` strategy's ``PerDevicePrecision`` plugin."""


def precision_dtype(precision: Any) -> Dtype:
    """The cost model's dtype for a Lightning precision setting (``"32-true"`` -> ``fp32``)."""
    key = str(precision)
    if key not in PRECISION_DTYPES:
        raise field_error("Trainer.precision", precision, f"be one of {sorted(PRECISION_DTYPES)}")
    return PRECISION_DTYPES[key]


def fast_dtype(tflops: Mapping[str, float]) -> Dtype:
    """The 16-bit dtype a device with peak ``tflops`` per dtype computes fastest in: bf16 where its rate is at
    least fp16's (bf16 keeps fp32's range: no loss scaling), else fp16; fp32 for a device with neither."""
    half = [d for d in (Dtype.bf16, Dtype.fp16) if d in tflops]
    return max(half, key=lambda d: tflops[d]) if half else Dtype.fp32


class InputDtype(StrEnum):
    """The tensor dtype of a built sample input (torch's names; integer dtypes give token ids, zeros)."""

    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"
    float64 = "float64"
    int64 = "int64"


class Float32MatmulPrecision(StrEnum):
    """``torch.set_float32_matmul_precision``'s setting, which decides the rate of fp32 matmuls."""

    highest = "highest"
    """torch's default: IEEE fp32 matmuls, at the fp32 rate."""
    high = "high"
    """TF32 tensor cores where the device has them."""
    medium = "medium"
    """TF32 or bf16 internally; priced as TF32 (the slower of the two)."""
