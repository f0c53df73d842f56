"""Activations and their gradients between two pipeline stages of any tensor-parallel degrees, partitioned.

After a stage's last row-parallel all-reduce its output is whole and equal on
every rank of its tensor-parallel group, so sending it whole from each rank
would carry it ``tp`` times.  As DeepSpeed's ``is_pipe_partitioned`` does for
equal degrees, each rank sends a part and the receiving group all-gathers;
here the two sides may differ (tp ``a`` sending to tp ``b``): ``StageLink``
says who sends which chunk to whom (its docstring has the steps);
``send_tensors`` / ``recv_tensors`` carry the activations and ``send_grads`` /
``recv_grads`` their gradients back over the same link (the gradient of a
stage's input is whole and equal on its group too: the backward of Megatron's
*f* all-reduces it).  Non-floating tensors (ids, masks) go whole from each
receiver's primary sender.  A header (the tensors' count, dtypes and shapes)
precedes the activations, so micro-batches of any size pass (DeepSpeed's
``dynamic_shape``).

Ordering, the distributed invariant: every send and receive of a pair is a
blocking ``send``/``recv`` in ascending chunk order on both sides, and a wait
chain between ranks always moves to a smaller chunk index, so no cycle (no
deadlock) can form; the receivers' all-gather starts only after each has
received all its chunks.  With ``a = b = 1`` this is one header and one send
per tensor, as DeepSpeed's own pipeline sends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["StageLink", "send_tensors", "recv_tensors", "send_grads", "recv_grads"]

_HEADER = 64
"""Entries of the int64 header: count, then per tensor dtype id, ndim and dims."""
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16]


@dataclass(frozen=True)
class StageLink:
    """Who sends which chunk to whom between a sending group and a receiving group (global ranks, tp order).

    For tp ``a`` sending to tp ``b``:

    1. each floating tensor is flattened, zero-padded to a multiple of
       ``n = lcm(a, b)`` and cut into ``n`` equal chunks;
    2. chunk ``c`` goes from sender ``c mod a`` to receiver ``c mod b``
       (``sends``, ``receives``): every sender sends ``1/a`` of the tensor, every receiver
       receives ``1/b``; each connected pair exchanges exactly one chunk
       (Chinese remainder theorem), every pair in ascending ``c``;
    3. the receivers all-gather their chunks over their group and reassemble.

    Non-floating tensors go whole from each receiver's primary sender, ``c = j``
    (``primary_sender``), which also sends the header before the activations.
    """

    senders: tuple[int, ...]
    receivers: tuple[int, ...]

    @property
    def num_chunks(self) -> int:
        return math.lcm(len(self.senders), len(self.receivers))

    def reversed(self) -> "StageLink":
        """The same stages with the roles swapped (the gradients' direction)."""
        return StageLink(self.receivers, self.senders)

    def sends(self, rank: int) -> list[tuple[int, int]]:
        """``(chunk, receiver rank)`` pairs ``rank`` sends, in chunk order."""
        a, b = len(self.senders), len(self.receivers)
        i = self.senders.index(rank)
        return [(c, self.receivers[c % b]) for c in range(self.num_chunks) if c % a == i]

    def receives(self, rank: int) -> list[tuple[int, int]]:
        """``(chunk, sender rank)`` pairs ``rank`` receives, in chunk order."""
        a, b = len(self.senders), len(self.receivers)
        j = self.receivers.index(rank)
        return [(c, self.senders[c % a]) for c in range(self.num_chunks) if c % b == j]

    def primary_sender(self, rank: int) -> int:
        """The sender of chunk ``j`` to receiver ``j``: it sends the header and any non-floating tensor."""
        return self.senders[self.receivers.index(rank) % len(self.senders)]

    def served(self, rank: int) -> list[int]:
        """The receivers ``rank`` is the primary sender of."""
        a = len(self.senders)
        i = self.senders.index(rank)
        return [r for j, r in enumerate(self.receivers) if j % a == i]


def _as_tuple(x: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x)
    raise TypeError(f"a pipeline stage must pass a tensor or a tuple of tensors, not {type(x).__name__}")


def _header(tensors: Sequence[torch.Tensor], device: Any) -> torch.Tensor:
    entries = [len(tensors)]
    for t in tensors:
        entries += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(entries) > _HEADER:
        raise ValueError(f"{len(tensors)} tensors of these ranks do not fit the {_HEADER}-entry header")
    out = torch.zeros(_HEADER, dtype=torch.int64)
    out[:len(entries)] = torch.tensor(entries, dtype=torch.int64)
    return out.to(device)


def _read_header(header: torch.Tensor) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    values = header.tolist()
    out, k = [], 1
    for _ in range(values[0]):
        dtype, ndim = _DTYPES[values[k]], values[k + 1]
        out.append((dtype, tuple(values[k + 2:k + 2 + ndim])))
        k += 2 + ndim
    return out


def _chunks(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` flattened, zero-padded to a multiple of ``n``, as ``n`` rows."""
    flat = t.detach().reshape(-1)
    per = -(-flat.numel() // n)
    if per * n != flat.numel():
        flat = torch.cat([flat, flat.new_zeros(per * n - flat.numel())])
    return flat.view(n, per)


def _send_floating(t: torch.Tensor, link: StageLink, rank: int) -> None:
    import torch.distributed as dist

    rows = _chunks(t, link.num_chunks)
    for c, dst in link.sends(rank):
        dist.send(rows[c].contiguous(), dst)


def _recv_floating(dtype: torch.dtype, shape: tuple[int, ...], link: StageLink, rank: int, group: Any,
                   device: Any) -> torch.Tensor:
    import torch.distributed as dist

    n = link.num_chunks
    numel = math.prod(shape)
    per = -(-numel // n)
    mine = link.receives(rank)
    got = torch.empty(len(mine), per, dtype=dtype, device=device)
    for k, (_, src) in enumerate(mine):
        dist.recv(got[k], src)
    b = len(link.receivers)
    if b == 1:
        rows = got
    else:
        parts = [torch.empty_like(got) for _ in range(b)]
        dist.all_gather(parts, got, group=group)
        rows = torch.empty(n, per, dtype=dtype, device=device)
        for j, part in enumerate(parts):
            rows[j::b] = part  # receiver j held chunks j, j + b, j + 2b, ...
    return rows.reshape(-1)[:numel].view(shape)


def send_tensors(outputs: Any, link: StageLink, rank: int) -> None:
    """Send a stage's output (a tensor or a tuple of tensors) over ``link`` from ``rank``."""
    import torch.distributed as dist

    tensors = _as_tuple(outputs)
    header = _header(tensors, tensors[0].device)
    served = link.served(rank)
    for dst in served:
        dist.send(header, dst)
    for t in tensors:
        if t.is_floating_point():
            _send_floating(t, link, rank)
        else:
            for dst in served:
                dist.send(t.contiguous(), dst)


def recv_tensors(link: StageLink, rank: int, group: Any, device: Any) -> tuple[torch.Tensor, ...]:
    """Receive a stage's input over ``link`` at ``rank`` (``group``: the receiving stage's tp group)."""
    import torch.distributed as dist

    src = link.primary_sender(rank)
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src)
    out = []
    for dtype, shape in _read_header(header):
        if dtype.is_floating_point:
            out.append(_recv_floating(dtype, shape, link, rank, group, device))
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(t, src)
            out.append(t)
    return tuple(out)


def send_grads(grads: Sequence[torch.Tensor], link: StageLink, rank: int) -> None:
    """Send the gradients of a stage's floating inputs back over ``link`` (already reversed) from ``rank``."""
    for g in grads:
        _send_floating(g, link, rank)


def recv_grads(like: Sequence[torch.Tensor], link: StageLink, rank: int, group: Any) -> list[torch.Tensor]:
    """Receive the gradients of the floating tensors ``like`` (this stage's outputs) over ``link`` (reversed)."""
    return [_recv_floating(t.dtype, tuple(t.shape), link, rank, group, t.device) for t in like]
