"""The per-element error bound of the two-phase quantized exchange, for the tests that check sums against it."""

from __future__ import annotations

import math

import torch

from het_strategy.compression.quantize import QuantizerSpec, error_bound


def two_phase_bound(inputs: list[torch.Tensor], spec: QuantizerSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The true mean of ``inputs`` (one per exchanging rank) and the per-element bound of the exchange: each
    rank's rounding (divided by W), plus the re-quantization of the chunk mean, whose per-bucket range is at
    most the true mean's range plus twice the first-phase error."""
    world, n = len(inputs), inputs[0].numel()
    chunk = math.ceil(n / (world * spec.bucket_size)) * spec.bucket_size
    padded = [torch.cat([x, torch.zeros(chunk * world - n)]) for x in inputs]
    true = sum(padded) / world
    first = sum(error_bound(x, spec) for x in padded) / world
    rows = true.reshape(-1, spec.bucket_size)
    widen = first.reshape(-1, spec.bucket_size).amax(dim=1, keepdim=True)
    if spec.scaling == "maxmin":
        step = (rows.amax(1, keepdim=True) - rows.amin(1, keepdim=True) + 2 * widen) / (2 ** spec.bits - 1)
    else:
        step = (rows.abs().amax(1, keepdim=True) + widen) / (2 ** (spec.bits - 1) - 1)
    second = (step * (1.0 if spec.stochastic else 0.5)).expand_as(rows).reshape(-1)
    return true[:n], (first + second + 1e-6)[:n]
