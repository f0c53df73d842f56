"""The collectives behind each codec's ``Exchange``: flat fp32 in, world mean out.

Every function takes this rank's flat fp32 gradient (error feedback already
added) and returns ``Exchanged(mean, delivered, bytes_sent)``: the mean over
ranks that every rank receives *identically* (DDP needs bitwise-equal
replicas), what this rank's own contribution became after compression (for
error feedback), and the bytes this rank put on the wire, counted from the
tensors each collective sends (``core.codecs`` states the same figures per
codec; the tests hold the two equal).

Quantized codes are never summed as small integers (they would overflow and
their scales differ per rank).  ``quantized_mean`` is CGX's two-phase exchange:

1. pad to ``world x bucket_size`` and quantize the whole tensor;
2. ``all_to_all_single``: rank j receives every rank's codes of chunk j
   (gloo supports the single-tensor all-to-all, not the list form);
3. rank j dequantizes them, sums in fp32, divides by the world size and
   re-quantizes its chunk of the mean (adding, with error feedback, what this
   re-quantization left out last time: otherwise a rounding bias of the
   second phase would add up step after step);
4. ``all_gather`` of the re-quantized chunks; every rank dequantizes the same
   bytes, so every replica gets the same gradient.

Each phase sends ``(W-1)/W`` of the packed tensor per rank, the same
``2 (W-1)/W`` factor as a ring allreduce: the wire saving is the full
``32 / bits`` minus metadata.

These run synchronously inside the hook: on gloo, a collective launched from a
future's callback could interleave with the next bucket's collectives in a
different order on different ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from het_strategy.compression.codecs import topk_select
from het_strategy.compression.quantize import Quantized, QuantizerSpec, dequantize, pack_codes, quantize, \
    unpack_codes
from het_strategy.core.codecs import ring_allreduce_bytes

__all__ = ["Exchanged", "allreduce_mean", "half_precision_mean", "quantized_mean", "topk_mean"]


@dataclass
class Exchanged:
    mean: torch.Tensor
    """The world mean (identical on every rank)."""
    delivered: torch.Tensor
    """This rank's contribution as the others received it (for error feedback)."""
    bytes_sent: int
    """Payload and metadata bytes this rank sent."""
    chunk_residual: torch.Tensor | None = None
    """quantized_mean: what re-quantizing this rank's chunk of the mean left out (its next error feedback)."""


def _all_gather(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def allreduce_mean(flat: torch.Tensor, group: dist.ProcessGroup) -> Exchanged:
    """Plain allreduce in ``flat``'s own dtype, divided by the world size."""
    world = group.size()
    out = flat / world
    dist.all_reduce(out, group=group)
    return Exchanged(out, flat, ring_allreduce_bytes(out.numel() * out.element_size(), world))


def half_precision_mean(flat: torch.Tensor, dtype: torch.dtype, group: dist.ProcessGroup) -> Exchanged:
    """Allreduce in fp16 or bf16 (gloo sums both), back to fp32."""
    world = group.size()
    low = (flat / world).to(dtype)
    delivered = low.to(flat.dtype) * world
    dist.all_reduce(low, group=group)
    return Exchanged(low.to(flat.dtype), delivered, ring_allreduce_bytes(low.numel() * low.element_size(), world))


def _pack_rows(q_codes: torch.Tensor, meta: torch.Tensor, spec: QuantizerSpec, num_rows: int) -> torch.Tensor:
    """(num_rows, row_bytes) uint8: each row one chunk's packed codes followed by its metadata bytes."""
    codes = pack_codes(q_codes, spec.bits).reshape(num_rows, -1)
    meta_bytes = meta.reshape(num_rows, -1).contiguous().view(torch.uint8)
    return torch.cat([codes, meta_bytes], dim=1).contiguous()


def _unpack_rows(rows: torch.Tensor, spec: QuantizerSpec, chunk: int) -> torch.Tensor:
    """Dequantized values of each packed row: (num_rows, chunk) fp32."""
    num_rows = rows.shape[0]
    code_bytes = chunk * spec.bits // 8
    codes = unpack_codes(rows[:, :code_bytes].contiguous().reshape(-1), spec.bits)
    meta = rows[:, code_bytes:].contiguous().view(torch.float32).reshape(-1, spec.meta_floats)
    return dequantize(Quantized(codes, meta), spec).reshape(num_rows, chunk)


def quantized_mean(flat: torch.Tensor, spec: QuantizerSpec, group: dist.ProcessGroup,
                   generator: torch.Generator | None = None,
                   chunk_residual: torch.Tensor | None = None) -> Exchanged:
    """The two-phase quantized mean (module docstring); ``chunk_residual``: the last call's, for this chunk."""
    world = group.size()
    n = flat.numel()
    chunk = math.ceil(n / (world * spec.bucket_size)) * spec.bucket_size
    padded = torch.zeros(chunk * world, dtype=torch.float32, device=flat.device)
    padded[:n] = flat
    first = quantize(padded, spec, generator)
    delivered = dequantize(first, spec)[:n]
    send = _pack_rows(first.codes, first.meta, spec, world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    chunk_mean = _unpack_rows(recv, spec, chunk).sum(dim=0) / world
    if chunk_residual is not None and chunk_residual.numel() == chunk:
        chunk_mean += chunk_residual.to(chunk_mean.device)
    second = quantize(chunk_mean, spec, generator)
    left_out = chunk_mean - dequantize(second, spec)
    row = _pack_rows(second.codes, second.meta, spec, 1)
    gathered = torch.empty(world * row.shape[1], dtype=torch.uint8, device=flat.device)
    _all_gather(gathered, row.reshape(-1), group)
    mean = _unpack_rows(gathered.reshape(world, -1), spec, chunk).reshape(-1)[:n]
    # the all-to-all sends W-1 of this rank's W rows, the allgather its one row to W-1 ranks
    return Exchanged(mean, delivered, (world - 1) * (send.numel() // world + row.numel()), left_out)


def topk_mean(flats: list[torch.Tensor], ratio: float, group: dist.ProcessGroup) -> tuple[list[torch.Tensor],
                                                                                         list[torch.Tensor], int]:
    """Top-k by magnitude per tensor; (value, index) pairs allgathered and scattered into the mean.

    Returns the per-tensor means, what each tensor delivered (its top-k, zeros
    elsewhere) and the bytes sent.
    """
    world = group.size()
    values, indices, delivered = [], [], []
    offset = 0
    for flat in flats:
        kept_values, top = topk_select(flat, ratio)
        kept = torch.zeros_like(flat)
        kept[top] = kept_values
        delivered.append(kept)
        values.append(kept_values)
        indices.append((top + offset).to(torch.int32))
        offset += flat.numel()
    vals = torch.cat(values)
    # one message: the fp32 values, then the int32 indices reinterpreted as 4-byte words
    payload = torch.cat([vals, torch.cat(indices).view(torch.float32)])
    gathered = torch.empty(world * payload.numel(), dtype=torch.float32, device=payload.device)
    _all_gather(gathered, payload, group)
    gathered = gathered.reshape(world, 2, -1)
    total = torch.zeros(offset, dtype=torch.float32, device=payload.device)
    total.index_add_(0, gathered[:, 1].contiguous().view(torch.int32).reshape(-1).long(),
                     gathered[:, 0].reshape(-1))
    total /= world
    means, start = [], 0
    for flat in flats:
        means.append(total[start:start + flat.numel()])
        start += flat.numel()
    return means, delivered, (world - 1) * payload.numel() * payload.element_size()
