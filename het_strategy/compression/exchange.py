"""The collectives behind each codec's ``Exchange``: flat fp32 in, world mean out.

Each function carries one ``Exchange``'s payloads and nothing else: what goes
on the wire is the codec's registered encoder's (``torch_codecs.TORCH_CODECS``)
and what comes back is turned into fp32 by its decoder.  They take this rank's
flat fp32 gradient (error feedback already added), the codec's ``CodecSpec``
and the ``CompressionConfig``, and return ``Exchanged(mean, delivered,
bytes_sent)``:

- ``mean`` is the same on every rank, bitwise (DDP needs equal replicas);
  quantized codes are never summed as small integers (they would overflow and
  their scales differ per rank), so ``quantized_steps`` decodes before it sums;
- ``delivered`` is this rank's contribution after compression (error feedback);
- ``bytes_sent`` is counted from the tensors each collective sends
  (``core.codecs`` states the same figures per codec; the tests hold them equal).

``allreduce_steps`` (``ALLREDUCE``), ``quantized_steps`` (``QUANTIZED``, CGX's
two phases) and ``topk_steps`` (``ALLGATHER``) write each exchange once, as a
generator that launches a collective, yields its future and is sent its value.
``settle`` runs steps to completion (``*_mean``); ``chain`` runs them from the
futures' ``then`` callbacks; ``run_steps`` picks one by ``overlaps(group)``, the
only place that decides.  The hooks compose their steps with ``yield from``, so
a bucket's codec groups chain one after another.  PowerSGD (``LOW_RANK``) is
torch's ``powerSGD_hook``, run by the hook itself.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from het_strategy.compression.torch_codecs import TORCH_CODECS
from het_strategy.compression.config import CompressionConfig, quantizer_for
from het_strategy.compression.duplex import all_gather, all_to_all
from het_strategy.compression.quantize import zero_padded
from het_strategy.core.codecs import CodecSpec
from het_strategy.core.network import ring_allreduce_bytes

__all__ = ["Exchanged", "Steps", "overlaps", "settle", "chain", "run_steps", "allreduce_steps", "quantized_steps",
           "topk_steps", "allreduce_mean", "quantized_mean", "topk_mean"]

T = TypeVar("T")
Steps = Generator[torch.futures.Future, Any, T]
"""An exchange in steps: yields the future of each collective it launched, is sent its value, returns ``T``."""


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


def overlaps(group: dist.ProcessGroup) -> bool:
    """Whether the hooks chain their collectives on futures (NCCL) rather than run each to completion.

    The ordering rule: every rank must issue the same collectives in the same order.  NCCL enqueues a
    collective on its stream and completes its future at once (the future carries CUDA events), so a ``then``
    callback runs right away in the launching thread, before the hook returns and before DDP's next bucket: the
    order is the program's, and the steps' GPU work waits for the wire on ``chain``'s side stream, not on
    backward's.  On gloo (and any other backend) a future completes on the backend's worker thread, and a
    collective launched from its callback could interleave with the next bucket's collectives in a different
    order on different ranks: there every collective runs to completion inside the hook.
    """
    return dist.get_backend(group) == dist.Backend.NCCL


def settle(steps: Steps[T]) -> T:
    """Run ``steps`` synchronously: wait for each collective, then run the step after it; the result."""
    sent = None
    while True:
        try:
            launched = steps.send(sent)
        except StopIteration as stop:
            return stop.value
        sent = launched.wait()


def chain(steps: Steps[T], device: torch.device) -> torch.futures.Future[T]:
    """Run ``steps`` from the ``then`` callback of each collective's future; a future of the result, or of the
    first error.

    On CUDA every step runs on one side stream that first waits for the launching (backward's) stream and then,
    step by step, for each collective: the steps' arithmetic overlaps backward, and a tensor one step allocates
    and a later one reads is freed only to that same stream (the caching allocator reuses a block on its own
    stream), so backward cannot reuse it while a later step still reads it.  The result's future carries that
    stream's event, which DDP waits for.
    """
    on_side = contextlib.nullcontext
    if device.type == "cuda":
        side = _side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        on_side = functools.partial(torch.cuda.stream, side)  # type: ignore[assignment]
    result: torch.futures.Future[T] = torch.futures.Future(devices=[device] if device.type == "cuda" else None)

    def advance(sent: Any) -> None:
        try:
            launched = steps.send(sent)
        except StopIteration as stop:
            result.set_result(stop.value)
        except Exception as exc:  # the error is the result's: DDP raises it where it waits
            result.set_exception(exc)
        else:
            launched.then(resume)

    def resume(done: torch.futures.Future) -> None:
        with on_side():
            try:
                value = done.wait()  # completed already; on CUDA: the side stream waits for the collective
            except Exception as exc:  # a failed collective
                steps.close()
                result.set_exception(exc)
                return
            advance(value)

    with on_side():
        advance(None)
    return result


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> Any:
    """The stream ``chain`` runs its steps on, one per CUDA device."""
    return torch.cuda.Stream(device)


def run_steps(steps: Steps[T], group: dist.ProcessGroup, device: torch.device) -> torch.futures.Future[T]:
    """``steps`` chained (``overlaps(group)``: NCCL) or run to completion (any other backend, see ``overlaps``),
    as a future of their result (already completed on the synchronous path)."""
    if overlaps(group):
        return chain(steps, device)
    result: torch.futures.Future[T] = torch.futures.Future()
    result.set_result(settle(steps))
    return result


def _launched(work: Any) -> torch.futures.Future:
    return work.get_future()


def allreduce_steps(flat: torch.Tensor, spec: CodecSpec, config: CompressionConfig,
                    group: dist.ProcessGroup) -> Steps[Exchanged]:
    """An ``ALLREDUCE`` codec's mean: ``flat / W`` through its encoder (``none``: ``flat``'s own dtype, which
    the hook sets to the gradients'; fp16, bf16: cast), summed in place by an allreduce, decoded to fp32."""
    world = group.size()
    coder = TORCH_CODECS[spec.token]
    payload = coder.encode(spec, flat / world, flat.shape, config, None)
    yield _launched(dist.all_reduce(payload, group=group, async_op=True))
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


def quantized_steps(flat: torch.Tensor, spec: CodecSpec, config: CompressionConfig, group: dist.ProcessGroup,
                    generator: torch.Generator | None = None,
                    chunk_residual: torch.Tensor | None = None) -> Steps[Exchanged]:
    """A ``QUANTIZED`` codec's mean, CGX's two-phase exchange; ``chunk_residual``: the last call's, for this
    rank's chunk.

    1. pad to ``world x bucket_size`` and encode the whole tensor (packed codes,
       per-bucket metadata);
    2. an all-to-all of one row per rank, each row a chunk's packed codes
       followed by its metadata bytes: rank j receives every rank's chunk j;
    3. rank j decodes them, sums in fp32, divides by the world size and
       re-encodes its chunk of the mean (adding, with error feedback, what this
       re-encoding left out last time: otherwise a rounding bias of the
       second phase would add up step after step);
    4. an all-gather of the re-encoded chunks; every rank decodes the same
       bytes, so every replica gets the same gradient.

    Both phases run through ``duplex.py`` (on gloo, every receive posted before any
    send, so that both directions of a link run at once).  Each phase sends
    ``(W-1)/W`` of the packed tensor per rank, the same
    ``2 (W-1)/W`` factor as a ring allreduce: the wire saving is the full
    ``32 / bits`` minus metadata.
    """
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
    yield all_to_all(recv, send, group)
    received = coder.decode(spec, _payload(recv, code_bytes, q_spec.meta_floats, chunk), config)
    chunk_mean = received.reshape(world, chunk).sum(dim=0) / world
    if chunk_residual is not None and chunk_residual.numel() == chunk:
        chunk_mean += chunk_residual.to(chunk_mean.device)
    second = coder.encode(spec, chunk_mean, chunk_mean.shape, config, generator)
    left_out = chunk_mean - coder.decode(spec, second, config)
    row = _rows(second, 1)
    gathered = torch.empty(world * row.shape[1], dtype=torch.uint8, device=flat.device)
    yield all_gather(gathered, row.reshape(-1), group)
    mean = coder.decode(spec, _payload(gathered.reshape(world, -1), code_bytes, q_spec.meta_floats, chunk),
                        config)[:n]
    # the all-to-all sends W-1 of this rank's W rows, the allgather its one row to W-1 ranks
    return Exchanged(mean, delivered, (world - 1) * (send.numel() // world + row.numel()), left_out)


def topk_steps(flats: list[torch.Tensor], spec: CodecSpec, config: CompressionConfig,
               group: dist.ProcessGroup) -> Steps[tuple[list[torch.Tensor], list[torch.Tensor], int]]:
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
    yield all_gather(gathered, payload, group)
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


def allreduce_mean(flat: torch.Tensor, spec: CodecSpec, config: CompressionConfig,
                   group: dist.ProcessGroup) -> Exchanged:
    """``allreduce_steps``, run synchronously."""
    return settle(allreduce_steps(flat, spec, config, group))


def quantized_mean(flat: torch.Tensor, spec: CodecSpec, config: CompressionConfig, group: dist.ProcessGroup,
                   generator: torch.Generator | None = None,
                   chunk_residual: torch.Tensor | None = None) -> Exchanged:
    """``quantized_steps``, run synchronously."""
    return settle(quantized_steps(flat, spec, config, group, generator, chunk_residual))


def topk_mean(flats: list[torch.Tensor], spec: CodecSpec, config: CompressionConfig,
              group: dist.ProcessGroup) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """``topk_steps``, run synchronously."""
    return settle(topk_steps(flats, spec, config, group))
