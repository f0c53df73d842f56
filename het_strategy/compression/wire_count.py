"""Bytes on the wire, counted where the gradients leave: a wrapper around any DDP comm hook.

``counted_comm_hook(inner, wire)`` adds, for every gradient bucket this rank
hands to ``inner``:

- ``raw`` — what a plain ring allreduce of the bucket in its own dtype sends
  per rank, ``2 (W-1)/W x bucket bytes`` (``core.network.ring_allreduce_bytes``,
  the same figure as ``CompressionState.bytes_fp32`` and the ``none`` codec's
  wire bytes);
- ``sent`` — what ``inner`` really put on the wire: the growth of its state's
  ``bytes_sent`` during the call (``compression_hook`` counts every
  collective's payload and metadata as it launches it), ``raw`` for torch's
  plain ``allreduce_hook``, unknown (``None``) for any other hook whose state
  does not count bytes.

``WireBytes`` keeps running totals on this rank; readers (the telemetry
callback) take the difference between two readings, so several readers can
share one counter.  Nothing here is a collective: the counts are this rank's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from het_strategy.core.network import ring_allreduce_bytes

__all__ = ["WireBytes", "counted_comm_hook"]


class WireBytes:
    """Running totals of this rank's gradient bytes (``raw``: uncompressed allreduce; ``sent``: on the wire)."""

    __slots__ = ("raw", "sent", "unknown_buckets")

    def __init__(self) -> None:
        self.raw = 0
        """Bytes a plain ring allreduce of every bucket so far would have sent from this rank."""
        self.sent = 0
        """Bytes this rank's hook put on the wire so far (buckets of unknown size left out)."""
        self.unknown_buckets = 0
        """Buckets whose hook did not say what it sent (a user's hook without ``state.bytes_sent``)."""

    def add(self, raw: int, sent: int | None) -> None:
        self.raw += int(raw)
        if sent is None:
            self.unknown_buckets += 1
        else:
            self.sent += int(sent)

    def reading(self) -> tuple[int, int | None]:
        """(raw, sent) so far; ``sent`` is ``None`` once a bucket's wire bytes were unknown."""
        return self.raw, (None if self.unknown_buckets else self.sent)


def counted_comm_hook(inner: Callable[[Any, Any], Any], wire: WireBytes) -> Callable[[Any, Any], Any]:
    """``inner`` (a DDP comm hook ``(state, bucket) -> Future``) with its bytes added to ``wire``."""
    plain = inner is allreduce_hook

    def counted_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations only
        group = getattr(state, "process_group", None) or dist.group.WORLD
        buffer = bucket.buffer()
        raw = ring_allreduce_bytes(buffer.numel() * buffer.element_size(), group.size())
        before = getattr(state, "bytes_sent", None)
        fut = inner(state, bucket)
        # compression_hook counts its bytes synchronously, before it returns its future
        after = getattr(state, "bytes_sent", None)
        if isinstance(before, int) and isinstance(after, int):
            wire.add(raw, after - before)
        else:
            wire.add(raw, raw if plain else None)
        return fut

    counted_hook.__qualname__ = f"counted({getattr(inner, '__qualname__', type(inner).__name__)})"
    return counted_hook

