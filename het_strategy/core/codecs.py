"""The gradient codecs: one ``CodecSpec`` per method token, the pure facts every layer reads.

A *codec* is how one layer's gradient crosses the wire in a data-parallel
sync.  Each is registered here once, by its token (``Codec``), with

- its **exchange**: the collective the comm hook runs for it (``Exchange``);
- its **wire bytes**: what one rank sends for one layer of a given shape, in a
  given gradient dtype, over ``W`` ranks (``CodecSpec.wire_bytes``), and, for
  codecs whose size does not depend on the shape, the bytes per gradient
  element before the exchange's ``W``-dependent factor
  (``CodecSpec.bytes_per_element``);
- its **quality bound**: what one encode/decode round trip may change
  (``Bound``).

The comm hook, the adaptive controller, the wire counter (all in
``het_strategy.compression``) and the cost model's compressed-sync price
(``core/compressed_sync.py``) read this table; nothing else spells a codec's
bytes.  The torch encoders and decoders (``het_strategy.compression.torch_codecs``)
are one per ``Exchange`` and take a codec's own figures from its spec, so they
need no entry of their own.

A codec of an existing exchange is one registration: a member of ``Codec`` and
its ``CodecSpec`` in ``CODECS``; one whose payload no exchange carries yet also
needs a new ``Exchange`` (the steps: docs/extending/codec.md).  Pure Python: no
torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, Sequence

from het_strategy.core.errors import field_error
from het_strategy.core.network import ring_allreduce_bytes, ring_steps
from het_strategy.core.dtypes import DTYPE_BYTES

__all__ = ["Codec", "Exchange", "Bound", "Scaling", "SCALINGS", "META_FLOATS", "CodecParams", "CodecSpec",
           "CODECS", "ELEMENTWISE_CODECS", "codec", "packed_bytes", "topk_count",
           "low_rank"]


class Codec(StrEnum):
    """Method tokens, in the order the hook exchanges a bucket's groups (the same on every rank)."""

    NONE = "none"
    FP16 = "fp16"
    BF16 = "bf16"
    Q8 = "q8"
    Q7 = "q7"
    Q6 = "q6"
    Q5 = "q5"
    Q4 = "q4"
    Q3 = "q3"
    Q2 = "q2"
    TOPK = "topk"
    POWERSGD = "powersgd"


class Exchange(StrEnum):
    """The collective a codec's layers go through (``compression/exchange.py`` runs each)."""

    ALLREDUCE = "allreduce"
    """A ring allreduce of the layers' gradients, cast to the codec's wire dtype (or kept in their own)."""
    QUANTIZED = "quantized"
    """CGX's two phases: an all-to-all of each rank's packed codes, then an allgather of the re-quantized
    chunk means; each phase sends ``(W-1)/W`` of the packed tensor."""
    ALLGATHER = "allgather"
    """An allgather of the (fp32 value, int32 index) pairs of each rank's largest-magnitude entries (top-k)."""
    LOW_RANK = "low_rank"
    """torch's PowerSGD: ring allreduces of the fp32 factors P (rows x r) and Q (cols x r); a matrix that the
    factors would not shrink goes as a plain fp32 allreduce."""


class Bound(StrEnum):
    """What one encode/decode round trip of a tensor ``x`` may change (``x̂``: what it delivers)."""

    EXACT = "exact"
    """``x̂ = x``."""
    ROUNDING = "rounding"
    """``|x̂ - x| <= u |x|`` per element, ``u`` the wire format's unit roundoff (``CodecSpec.unit_roundoff``),
    for ``|x|`` in its normal range (below it, half the format's smallest subnormal step)."""
    HALF_STEP = "half_step"
    """Per bucket of ``bucket_size`` elements, ``|x̂ - x| <=`` half a quantization step (a whole step with
    stochastic rounding); the step is ``(max - min) / (2^b - 1)`` (maxmin) or ``max|x| / (2^(b-1) - 1)``
    (maxnorm)."""
    DROPPED = "dropped"
    """Each element is sent exactly or dropped to 0, and only elements no larger in magnitude than the
    ``k``-th largest are dropped (``k = max(1, ceil(topk_ratio x n))``)."""
    PROJECTION = "projection"
    """``x̂`` is the orthogonal projection of the ``rows x cols`` matrix onto a rank-``r`` column space:
    ``||x̂ - x|| <= ||x||``, and ``x̂ = x`` for a matrix of rank ``<= r``."""


Scaling = Literal["maxmin", "maxnorm"]
SCALINGS: tuple[Scaling, ...] = ("maxmin", "maxnorm")
META_FLOATS: dict[str, int] = {"maxmin": 2, "maxnorm": 1}
"""fp32 figures of metadata per quantization bucket: min and step (maxmin), one scale (maxnorm)."""


@dataclass(frozen=True)
class CodecParams:
    """The knobs a codec's wire size depends on (``CompressionConfig`` fields of the same names and defaults)."""

    bucket_size: int = 256
    """Elements sharing one quantization scale."""
    scaling: Scaling = "maxmin"
    """Quantization scale per bucket (``META_FLOATS`` figures of metadata each)."""
    rank: int = 4
    """PowerSGD's matrix approximation rank."""
    topk_ratio: float = 0.01
    """Fraction of each layer's entries that top-k sends."""


def packed_bytes(num_elements: int, bits: int, params: CodecParams) -> int:
    """Bytes of ``num_elements`` (a multiple of the bucket size) quantized to ``bits``: the densely packed codes
    and each bucket's fp32 metadata."""
    buckets = num_elements // params.bucket_size
    return num_elements * bits // 8 + buckets * META_FLOATS[params.scaling] * 4


def topk_count(numel: int, ratio: float) -> int:
    """Entries top-k keeps of a layer of ``numel``: ``max(1, ceil(ratio x numel))``."""
    return max(1, math.ceil(ratio * numel))


def low_rank(rows: int, cols: int, rank: int) -> int:
    """The rank PowerSGD approximates a ``rows x cols`` matrix with (``min(rows, cols, rank)``), or 0 where
    the factors would not be smaller than the matrix (torch's hook then allreduces it whole)."""
    r = min(rows, cols, rank)
    return r if (rows + cols) * r < rows * cols else 0


@dataclass(frozen=True)
class CodecSpec:
    """One codec's pure facts (module docstring)."""

    token: Codec
    exchange: Exchange
    bound: Bound
    summary: str
    """One line for messages and docs."""
    wire_dtype: str | None = None
    """``ALLREDUCE``: the dtype the gradients are cast to on the wire (None: their own dtype)."""
    bits: int | None = None
    """``QUANTIZED``: bits per element."""
    unit_roundoff: float = 0.0
    """``ROUNDING``: the wire format's unit roundoff (half the distance from 1 to the next number)."""

    def bytes_per_element(self, grad_dtype: str, params: CodecParams = CodecParams()) -> float | None:
        """Wire bytes per gradient element, before the exchange's ring factor ``2 (W-1)/W``; None for a codec
        whose size depends on the layer's shape (top-k's indices, PowerSGD's factors)."""
        if self.exchange is Exchange.ALLREDUCE:
            return float(DTYPE_BYTES[self.wire_dtype or grad_dtype])
        if self.exchange is Exchange.QUANTIZED:
            assert self.bits is not None
            return packed_bytes(params.bucket_size, self.bits, params) / params.bucket_size
        return None

    def wire_bytes(self, shape: Sequence[int], world: int, grad_dtype: str = "fp32",
                   params: CodecParams = CodecParams()) -> int:
        """Bytes one rank sends for one layer of ``shape`` over ``world`` ranks, payload and metadata."""
        numel = math.prod(shape)
        if self.exchange is Exchange.ALLREDUCE:
            return ring_allreduce_bytes(numel * DTYPE_BYTES[self.wire_dtype or grad_dtype], world)
        if self.exchange is Exchange.QUANTIZED:
            assert self.bits is not None
            chunk = math.ceil(numel / (world * params.bucket_size)) * params.bucket_size  # each rank's share
            return ring_steps(world) * packed_bytes(chunk, self.bits, params)  # a ring of packed chunks
        if self.exchange is Exchange.ALLGATHER:
            return (world - 1) * 8 * topk_count(numel, params.topk_ratio)
        rows = shape[0]
        cols = numel // rows
        rank = low_rank(rows, cols, params.rank)
        return ring_allreduce_bytes(4 * (rank * (rows + cols) if rank else numel), world)


def _quantizer(bits: int) -> CodecSpec:
    return CodecSpec(Codec(f"q{bits}"), Exchange.QUANTIZED, Bound.HALF_STEP,
                     f"{bits}-bit bucketed quantization, two-phase exchange", bits=bits)


CODECS: dict[Codec, CodecSpec] = {spec.token: spec for spec in (
    CodecSpec(Codec.NONE, Exchange.ALLREDUCE, Bound.EXACT, "uncompressed allreduce in the gradients' dtype"),
    CodecSpec(Codec.FP16, Exchange.ALLREDUCE, Bound.ROUNDING, "allreduce in fp16", wire_dtype="fp16",
              unit_roundoff=2.0 ** -11),
    CodecSpec(Codec.BF16, Exchange.ALLREDUCE, Bound.ROUNDING, "allreduce in bf16", wire_dtype="bf16",
              unit_roundoff=2.0 ** -8),
    *(_quantizer(bits) for bits in range(8, 1, -1)),
    CodecSpec(Codec.TOPK, Exchange.ALLGATHER, Bound.DROPPED, "top-k sparsification, allgathered pairs"),
    CodecSpec(Codec.POWERSGD, Exchange.LOW_RANK, Bound.PROJECTION, "PowerSGD rank-r factors (torch's hook)"),
)}
"""Every codec, in ``Codec`` order."""

ELEMENTWISE_CODECS: tuple[Codec, ...] = tuple(t for t, s in CODECS.items() if s.bytes_per_element("fp32") is not None)
"""Codecs whose wire size is a fixed number of bytes per element: the ones the cost model can price for any
layer (``compressed_sync``)."""

if list(CODECS) != list(Codec):  # one spec per token, in the enum's order
    raise ImportError(f"core/codecs.py: CODECS covers {list(CODECS)}, Codec names {list(Codec)}")


def codec(token: Any, field: str, allowed: Sequence[Codec] = tuple(Codec)) -> Codec:
    """``token`` as a ``Codec``, or a ConfigError naming ``field`` and the tokens ``allowed``."""
    if isinstance(token, str) and token in allowed:
        return Codec(token)
    raise field_error(field, token, f"be one of {', '.join(allowed)}")
