"""What every rank must agree on, decided once on rank 0: ``decided_on_rank_zero``.

The plan of a run is searched on rank 0 only and sent to the others, so every
rank runs the same plan even where a search could differ between processes
(measured profiles, timing).  An error on rank 0 is sent instead, and raised on
every rank, so no rank waits for a result that never comes.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch.distributed as dist

from het_strategy.core.errors import ConfigError

__all__ = ["decided_on_rank_zero"]

T = TypeVar("T")


def decided_on_rank_zero(rank: int, world_size: int, decide: Callable[[], T]) -> T:
    """``decide()`` run on rank 0, its (picklable) result returned on every rank; a ``ConfigError`` it raises is
    raised on every rank (marked ``reported_by_rank_zero`` on the others, so a CLI prints it once).  A collective
    when ``world_size > 1``."""
    payload: list[Any] = [None]
    if rank == 0:
        try:
            payload[0] = ("value", decide())
        except ConfigError as exc:
            payload[0] = ("error", str(exc))
    if world_size > 1:
        dist.broadcast_object_list(payload, src=0)
    kind, value = payload[0]
    if kind == "error":
        raise ConfigError(value, reported_by_rank_zero=rank != 0)
    return value
