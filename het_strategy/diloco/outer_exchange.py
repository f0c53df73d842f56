"""The outer exchange: the sample-weighted average of the groups' pseudo-gradients, over the slow link.

Every rank of a group holds the same pseudo-gradient (its group's DDP keeps
them equal), so only the group's leader crosses the slow link:

1. the leader adds its error-feedback residual to ``n_g x delta_g`` (its
   group's samples in the round times its pseudo-gradient), encodes the sum with
   the codec (``compression/torch_codecs.py``: a cast, or a bucketed quantizer) and
   keeps what the encoding lost as the next round's residual;
2. the leaders all-gather the payloads (``compression/duplex.py``: on gloo,
   every receive posted before any send) and the sample counts; each decodes
   every payload in group order and sums, so every leader gets the same bits;
3. the sum over all groups' samples divides it: ``sum_g n_g delta_g / sum_g n_g``;
4. each leader broadcasts the average inside its group (the fast link).

Why an all-gather and not the codecs' own all-reduce: the pseudo-gradient goes
once per round as one flat tensor among a few groups (sites); gathering the
payloads keeps each group's residual exact (it is what its own encoding lost)
and the sum the same on every leader.  A leader sends ``(G - 1)`` payloads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from het_strategy.compression.torch_codecs import TORCH_CODECS
from het_strategy.compression.config import CompressionConfig
from het_strategy.compression.duplex import all_gather
from het_strategy.core.codecs import CODECS, Bound, Codec
from het_strategy.diloco.groups import DiLoCoGroups

__all__ = ["Exchanged", "OuterExchange"]


@dataclass(frozen=True)
class Exchanged:
    """One outer exchange's result on this rank."""

    average: torch.Tensor
    """The sample-weighted average pseudo-gradient (flat)."""
    samples: int
    """Samples of the round over every group."""
    bytes_sent: int
    """Payload bytes this rank sent over the leaders' group (0 on a rank that leads no group)."""


def _tensors(payload: Any) -> list[torch.Tensor]:
    """The tensors of an encoded payload (a tensor, or a tuple whose last item is the element count)."""
    if isinstance(payload, torch.Tensor):
        return [payload]
    return [t for t in payload if isinstance(t, torch.Tensor)]


def _rebuilt(payload: Any, tensors: list[torch.Tensor]) -> Any:
    """``payload``'s shape with ``tensors`` in place of its own."""
    if isinstance(payload, torch.Tensor):
        return tensors[0]
    parts = iter(tensors)
    return tuple(next(parts) if isinstance(t, torch.Tensor) else t for t in payload)


class OuterExchange:
    """Averages the groups' pseudo-gradients in ``codec``, with error feedback on each leader.

    Args:
        codec: the outer codec (``core.outer_sync.OUTER_CODECS``).
        groups: this rank's groups (``groups.build_groups``).
        config: the quantizers' bucket size and scaling (``CompressionConfig``'s fields of those names).
    """

    def __init__(self, codec: Codec, groups: DiLoCoGroups, config: CompressionConfig | None = None) -> None:
        self.spec = CODECS[Codec(codec)]
        self.coder = TORCH_CODECS[self.spec.token]
        self.groups = groups
        self.config = config or CompressionConfig()
        self.residual: torch.Tensor | None = None
        """What this leader's last encodings lost, added to its next pseudo-gradient (None before any)."""

    @property
    def lossy(self) -> bool:
        return self.spec.bound is not Bound.EXACT

    def encode(self, flat: torch.Tensor) -> Any:
        """``flat`` plus the residual, encoded; the residual becomes what the encoding lost."""
        x = flat if self.residual is None or not self.lossy else flat + self.residual
        work = x if x.dtype == torch.float64 and self.spec.wire_dtype is None else x.float()
        payload = self.coder.encode(self.spec, work, (work.numel(),), self.config, None)
        if self.lossy:
            self.residual = x - self.decode(payload).to(x.dtype)
        return payload

    def decode(self, payload: Any) -> torch.Tensor:
        """A payload back to a flat tensor (``none``'s as sent, in its own dtype: the decoders give fp32)."""
        if not self.lossy:
            return payload
        return self.coder.decode(self.spec, payload, self.config)

    def average(self, weighted: torch.Tensor, samples: int) -> Exchanged:
        """The average of every group's ``weighted`` (its ``samples x`` pseudo-gradient, flat) over all samples.

        A collective over every rank: leaders exchange over the leaders' group, then broadcast in their group.
        """
        groups = self.groups
        out = torch.empty_like(weighted)
        total = torch.tensor([samples], dtype=torch.int64, device=weighted.device)
        sent = 0
        if groups.leaders is not None:
            payload = self.encode(weighted)
            mine = _tensors(payload)
            gathered = []
            for t in mine:
                flat = torch.empty(groups.count * t.numel(), dtype=t.dtype, device=t.device)
                all_gather(flat, t.contiguous(), groups.leaders).wait()
                gathered.append(list(flat.reshape(groups.count, *t.shape).unbind(0)))
                sent += (groups.count - 1) * t.numel() * t.element_size()
            summed = torch.zeros_like(weighted)
            for g in range(groups.count):
                summed += self.decode(_rebuilt(payload, [parts[g] for parts in gathered])).to(weighted.dtype)
            dist.all_reduce(total, group=groups.leaders)
            out = summed / total.to(weighted.dtype)
        if len(groups.members) > 1:
            dist.broadcast(out, src=groups.leader, group=groups.group)
            dist.broadcast(total, src=groups.leader, group=groups.group)
        return Exchanged(out, int(total.item()), sent)

    def state_dict(self) -> dict[str, Any]:
        return {"codec": str(self.spec.token), "residual": None if self.residual is None else self.residual.cpu()}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        residual = state.get("residual")
        self.residual = None if residual is None else residual.to(device)
