"""Bucketed uniform quantization of gradients to 2-8 bits, and its bit packing.

A flat fp32 tensor is cut into rows of ``bucket_size`` elements; each row gets
its own scale, so one large value spoils only its row (CGX's bucketing):

- **max-min** — levels ``min + k * (max - min) / (2^b - 1)``, ``k = 0 .. 2^b - 1``;
  two fp32 numbers of metadata per row (min and step).
- **max-norm** — symmetric levels ``k * max|x| / L`` with ``L = 2^(b-1) - 1``,
  ``k = -L .. L`` (b = 2 gives the ternary {-m, 0, m}); one fp32 per row.

Rounding is to the nearest level (error <= step/2 per element) or stochastic
(unbiased, error < step).  Codes are packed densely: 8 codes of b bits into b
bytes, so 3-bit codes cost 3/8 byte each.  A tensor that is not a whole number
of buckets is first ``zero_padded``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from het_strategy.core.codecs import META_FLOATS, Scaling

__all__ = ["QuantizerSpec", "Quantized", "zero_padded", "quantize", "dequantize", "pack_codes", "unpack_codes",
           "error_bound"]


@dataclass(frozen=True)
class QuantizerSpec:
    """How one group of gradients is quantized (validated by ``CompressionConfig``)."""

    bits: int
    """Bits per element, 2-8."""
    scaling: Scaling = "maxmin"
    """``maxmin`` (min and step per row) or ``maxnorm`` (one symmetric scale per row)."""
    bucket_size: int = 256
    """Elements sharing one scale; a multiple of 8 (the packing unit)."""
    stochastic: bool = False
    """Stochastic (unbiased) rounding instead of round-to-nearest."""

    @property
    def meta_floats(self) -> int:
        """fp32 numbers of metadata per row."""
        return META_FLOATS[self.scaling]

    @property
    def levels(self) -> int:
        """Largest code + 1."""
        return 2 ** self.bits if self.scaling == "maxmin" else 2 ** self.bits - 1


@dataclass
class Quantized:
    """Codes (uint8, one per element) and per-row metadata (fp32, rows x meta_floats)."""

    codes: torch.Tensor
    meta: torch.Tensor


def zero_padded(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Flat ``x`` in fp32, followed by zeros up to the next multiple of ``multiple`` elements (whole quantization
    buckets; the two-phase exchange pads to ``world x bucket_size``); ``x`` itself when it is fp32 and whole."""
    whole = math.ceil(x.numel() / multiple) * multiple
    if whole == x.numel() and x.dtype == torch.float32:
        return x
    padded = torch.zeros(whole, dtype=torch.float32, device=x.device)
    padded[:x.numel()] = x
    return padded


def quantize(x: torch.Tensor, spec: QuantizerSpec, generator: torch.Generator | None = None) -> Quantized:
    """Quantize a flat fp32 tensor whose length is a multiple of ``spec.bucket_size``."""
    rows = x.reshape(-1, spec.bucket_size)
    if spec.scaling == "maxmin":
        low = rows.amin(dim=1, keepdim=True)
        step = (rows.amax(dim=1, keepdim=True) - low) / (2 ** spec.bits - 1)
        step = torch.where(step > 0, step, torch.ones_like(step))  # a constant row: every code is 0
        scaled = (rows - low) / step
        top = 2 ** spec.bits - 1
        meta = torch.cat([low, step], dim=1)
    else:
        half = 2 ** (spec.bits - 1) - 1
        step = rows.abs().amax(dim=1, keepdim=True) / half
        step = torch.where(step > 0, step, torch.ones_like(step))
        scaled = rows / step + half
        top = 2 * half
        meta = step
    if spec.stochastic:
        # drawn where the generator lives (a CPU generator on a CUDA tensor too), then moved
        noise = torch.rand(scaled.shape, generator=generator, dtype=scaled.dtype,
                           device=generator.device if generator is not None else scaled.device).to(scaled.device)
        codes = torch.floor(scaled + noise)
    else:
        codes = torch.round(scaled)
    codes = codes.clamp_(0, top).to(torch.uint8).reshape(-1)
    return Quantized(codes, meta.contiguous())


def dequantize(q: Quantized, spec: QuantizerSpec) -> torch.Tensor:
    """The fp32 values the codes stand for (flat)."""
    rows = q.codes.reshape(-1, spec.bucket_size).to(torch.float32)
    if spec.scaling == "maxmin":
        values = q.meta[:, :1] + rows * q.meta[:, 1:2]
    else:
        half = 2 ** (spec.bits - 1) - 1
        values = (rows - half) * q.meta
    return values.reshape(-1)


def error_bound(x: torch.Tensor, spec: QuantizerSpec) -> torch.Tensor:
    """Per-element bound on |dequantize(quantize(x)) - x|: half a step (a full step when stochastic)."""
    rows = x.reshape(-1, spec.bucket_size)
    if spec.scaling == "maxmin":
        step = (rows.amax(dim=1, keepdim=True) - rows.amin(dim=1, keepdim=True)) / (2 ** spec.bits - 1)
    else:
        step = rows.abs().amax(dim=1, keepdim=True) / (2 ** (spec.bits - 1) - 1)
    factor = 1.0 if spec.stochastic else 0.5
    # float32 arithmetic in quantize/dequantize adds a few ulps of the row's magnitude
    slack = rows.abs().amax(dim=1, keepdim=True) * 4 * torch.finfo(torch.float32).eps
    return (step * factor + slack).expand_as(rows).reshape(-1)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (< 2^bits, length a multiple of 8) densely: 8 codes -> ``bits`` bytes."""
    if bits == 8:
        return codes
    if 8 % bits == 0:  # 2 or 4 bits: whole codes per byte, uint8 arithmetic
        per_byte = 8 // bits
        groups = codes.reshape(-1, per_byte)
        packed = groups[:, 0].clone()
        for j in range(1, per_byte):
            packed |= groups[:, j] << (bits * j)
        return packed
    groups = codes.reshape(-1, 8).to(torch.int64)
    shifts = torch.arange(8, dtype=torch.int64, device=codes.device) * bits
    words = (groups << shifts).sum(dim=1, keepdim=True)  # at most 56 bits: fits int64
    byte_shifts = torch.arange(bits, dtype=torch.int64, device=codes.device) * 8
    return ((words >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_codes``."""
    if bits == 8:
        return packed
    if 8 % bits == 0:
        per_byte = 8 // bits
        shifts = torch.arange(per_byte, dtype=torch.uint8, device=packed.device) * bits
        return ((packed.reshape(-1, 1) >> shifts) & (2 ** bits - 1)).reshape(-1)
    groups = packed.reshape(-1, bits).to(torch.int64)
    byte_shifts = torch.arange(bits, dtype=torch.int64, device=packed.device) * 8
    words = (groups << byte_shifts).sum(dim=1, keepdim=True)
    shifts = torch.arange(8, dtype=torch.int64, device=packed.device) * bits
    return ((words >> shifts) & (2 ** bits - 1)).to(torch.uint8).reshape(-1)

