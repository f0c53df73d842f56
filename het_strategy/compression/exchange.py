"""The collectives behind each codec's ``Exchange``: flat fp32 in, world mean out.

Each function carries one ``Exchange``'s payloads and nothing else: the
tensors a codec puts on the wire are its registered encoder's
(``compression/codecs.py``, ``TORCH_CODECS``), and what comes back is turned
into fp32 by its registered decoder.  The functions take this rank's flat
fp32 gradient (error feedback already added), the codec's ``CodecSpec`` and
the ``CompressionConfig``, and return ``Exchanged(mean, delivered,
bytes_sent)``: the mean over ranks that every rank receives *identically*
(DDP needs bitwise-equal replicas), what this rank's own contribution became
after compression (for error feedback), and the bytes this rank put on the
wire, counted from the tensors each collective sends (``core.codecs`` states
the same figures per codec; the tests hold the two equal).

- ``allreduce_mean`` (``ALLREDUCE``): ``flat / W`` encoded (one tensor the
  backend can sum: the gradients' own dtype, fp16 or bf16), ring-allreduced,
  decoded;
- ``quantized_mean`` (``QUANTIZED``): CGX's two phases, below;
- ``topk_mean`` (``ALLGATHER``): every layer's (value, index) pairs
  allgathered in one message and summed into the mean.

PowerSGD (``LOW_RANK``) is torch's ``powerSGD_hook``, run by the hook itself.

Quantized codes are never summed as small integers (they would overflow and
their scales differ per rank).  ``quantized_mean`` is CGX's two-phase exchange:

1. pad to ``world x bucket_size`` and encode the whole tensor (packed codes,
   per-bucket metadata);
2. ``all_to_all_single`` of one row per rank, each row a chunk's packed codes
   followed by its metadata bytes: rank j receives every rank's chunk j
   (gloo supports the single-tensor all-to-all, not the list form);
3. rank j decodes them, sums in fp32, divides by the world size and
   re-encodes its chunk of the mean (adding, with error feedback, what this
   re-encoding left out last time: otherwise a rounding bias of the
   second phase would add up step after step);
4. ``all_gather`` of the re-encoded chunks; every rank decodes the same
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
from typing import Any

import torch
import torch.distributed as dist

from het_strategy.compression.codecs import TORCH_CODECS
from het_strategy.compression.config import CompressionConfig, quantizer_for
from het_strategy.compression.quantize import zero_padded
from het_strategy.core.codecs import CodecSpec, ring_allreduce_bytes

__all__ = ["Exchanged", "allreduce_mean", "quantized_mean", "topk_mean"]


@dataclass
class Exchanged:
    mean: torch.Tensor
    """The world mean (identical on every rank)."""
    delivered: torch.Tensor | None
    """This rank's contribution as the others received it, for error feedback (None for ``allreduce_mean``:
    the hook keeps none for the allreduce codecs)."""
    bytes_sent: int
    """Payload and metadata bytes this rank sent."""
    chunk_residual: torch.Tensor | None = None
    """quantized_mean: what re-encoding this rank's chunk of the mean left out (its next error feedback)."""


def _all_gather(output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def allreduce_mean(flat: torch.Tensor, spec: CodecSpec, config: CompressionConfig,
                   group: dist.ProcessGroup) -> Exchanged:
    """An ``ALLREDUCE`` codec's mean: ``flat / W`` through its encoder (``none``: ``flat``'s own dtype, which
    the hook sets to the gradients'; fp16, bf16: cast), summed in place by an allreduce, decoded to fp32."""
    world = group.size()
    coder = TORCH_CODECS[spec.token]
    payload = coder.encode(spec, flat / world, flat.shape, config, None)
    dist.all_reduce(payload, group=group)
    return Exchanged(coder.decode(spec, payload, config), None,
                     ring_allreduce_bytes(payload.numel() * payload.element_size(), world))


def _rows(payload: tuple[torch.Tensor, torch.Tensor, int], num_rows: int) -> torch.Tensor:
    """A quantized payload as (num_rows, row_bytes) uint8: each row one chunk's packed codes, then its metadata."""
    packed, meta, _ = payload
    meta_bytes = meta.reshape(num_rows, -1).contiguous().view(torch.uint8)
    return torch.cat([packed.reshape(num_rows, -1), meta_bytes], dim=1).contiguous()


def _payload(rows: torch.Tensor, code_bytes: int, meta_floats: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                          int]:
    """Inverse of ``_rows``: the quantized payload (packed codes, metadata, elements) of every row's chunk."""
    packed = rows[:, :code_bytes].contiguous().reshape(-1)
    meta = rows[:, code_bytes:].contiguous().view(torch.float32).reshape(-1, meta_floats)
    return packed, meta, rows.shape[0] * chunk


def quantized_mean(flat: torch.Tensor, spec: CodecSpec, config: CompressionConfig, group: dist.ProcessGroup,
                   generator: torch.Generator | None = None,
                   chunk_residual: torch.Tensor | None = None) -> Exchanged:
    """A ``QUANTIZED`` codec's two-phase mean (module docstring); ``chunk_residual``: the last call's, for this
    rank's chunk."""
    world = group.size()
    coder = TORCH_CODECS[spec.token]
    q_spec = quantizer_for(spec.token, config)
    n = flat.numel()
    padded = zero_padded(flat, world * q_spec.bucket_size)
    chunk = padded.numel() // world
    code_bytes = chunk * q_spec.bits // 8
    first = coder.encode(spec, padded, padded.shape, config, generator)
    delivered = coder.decode(spec, first, config)[:n]
    send = _rows(first, world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    received = coder.decode(spec, _payload(recv, code_bytes, q_spec.meta_floats, chunk), config)
    chunk_mean = received.reshape(world, chunk).sum(dim=0) / world
    if chunk_residual is not None and chunk_residual.numel() == chunk:
        chunk_mean += chunk_residual.to(chunk_mean.device)
    second = coder.encode(spec, chunk_mean, chunk_mean.shape, config, generator)
    left_out = chunk_mean - coder.decode(spec, second, config)
    row = _rows(second, 1)
    gathered = torch.empty(world * row.shape[1], dtype=torch.uint8, device=flat.device)
    _all_gather(gathered, row.reshape(-1), group)
    mean = coder.decode(spec, _payload(gathered.reshape(world, -1), code_bytes, q_spec.meta_floats, chunk),
                        config)[:n]
    # the all-to-all sends W-1 of this rank's W rows, the allgather its one row to W-1 ranks
    return Exchanged(mean, delivered, (world - 1) * (send.numel() // world + row.numel()), left_out)


def topk_mean(flats: list[torch.Tensor], spec: CodecSpec, config: CompressionConfig,
              group: dist.ProcessGroup) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """An ``ALLGATHER`` codec's mean: each tensor encoded to (values, int32 indices); every tensor's pairs
    allgathered in one message and summed into the mean.

    Returns the per-tensor means, what each tensor delivered (its decoded payload: the kept entries, zeros
    elsewhere) and the bytes sent.
    """
    world = group.size()
    coder = TORCH_CODECS[spec.token]
    values, indices, delivered = [], [], []
    offset = 0
    for flat in flats:
        payload: Any = coder.encode(spec, flat, flat.shape, config, None)
        delivered.append(coder.decode(spec, payload, config))
        kept_values, kept_indices, _ = payload
        values.append(kept_values)
        indices.append(kept_indices + offset)  # indices into the concatenation of the tensors
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
