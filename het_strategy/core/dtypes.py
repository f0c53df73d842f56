"""The dtype names of the package: one table each, one spelling per dtype.

* ``Dtype`` — a training dtype, what the cost model prices a model in and a
  plan records (``settings.dtype``, ``settings.grad_dtype``, ``plan.dtype``,
  a workload's activation dtype); ``DTYPE_BYTES`` is each one's element size.
* ``InputDtype`` — the tensor dtype of a sample input het-plan builds for a
  model given as a Python path (``model_input.dtype``), named as torch names it.

Both are ``StrEnum``s whose member names are the config spellings (Hydra
matches an enum value by name), so a member compares equal to, hashes as and
serialises as its string: ``Dtype.bf16 == "bf16"`` and JSON writes ``"bf16"``.
``as_dtype`` turns a string into a member or raises ``ConfigError`` naming the
field, the value and the allowed names.  Pure Python: no torch.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from het_strategy.core.errors import require_option

__all__ = ["Dtype", "DTYPE_BYTES", "as_dtype", "InputDtype"]


class Dtype(StrEnum):
    """A training dtype (member names are the config spellings)."""

    fp32 = "fp32"
    """IEEE single precision."""
    fp16 = "fp16"
    """IEEE half precision (mixed precision with loss scaling)."""
    bf16 = "bf16"
    """bfloat16 (mixed precision)."""

    @property
    def bytes(self) -> int:
        """Bytes of one element."""
        return DTYPE_BYTES[self]


DTYPE_BYTES: dict[Dtype, int] = {Dtype.fp32: 4, Dtype.fp16: 2, Dtype.bf16: 2}
"""Bytes of one element of each training dtype (a key also matches its plain string: ``DTYPE_BYTES["fp32"]``)."""


def as_dtype(value: Any, field: str) -> Dtype:
    """``value`` (a ``Dtype`` or its name) as a ``Dtype``; ConfigError naming ``field`` and the dtypes otherwise."""
    return require_option(Dtype, value, field)


class InputDtype(StrEnum):
    """The tensor dtype of a built sample input (torch's names; integer dtypes give token ids, zeros)."""

    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"
    float64 = "float64"
    int64 = "int64"
