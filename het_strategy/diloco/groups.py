"""The plan's device groups as process groups, created once, in one order, on every rank."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch.distributed as dist

from het_strategy.core.errors import field_error

__all__ = ["DiLoCoGroups", "build_groups"]


@dataclass(frozen=True)
class DiLoCoGroups:
    """This rank's place among the groups: its group's ranks and process group, and the leaders' group."""

    index: int
    """The group this rank belongs to."""
    ranks: tuple[tuple[int, ...], ...]
    """Global ranks of every group, each in rank order; a group's first rank is its leader."""
    group: Any
    """This rank's group's process group (its DDP all-reduces there)."""
    leaders: Any
    """The process group of every group's leader (None on a rank that leads no group)."""

    @property
    def members(self) -> tuple[int, ...]:
        return self.ranks[self.index]

    @property
    def leader(self) -> int:
        """The global rank that speaks for this rank's group in the outer exchange."""
        return self.members[0]

    @property
    def count(self) -> int:
        return len(self.ranks)


def group_ranks(groups: Sequence[Sequence[str]], devices: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Each group's global ranks (rank r plays ``devices[r]``), in rank order; ConfigError naming
    ``plan.outer_sync.groups`` for a device the run does not have."""
    index = {name: r for r, name in enumerate(devices)}
    out = []
    for g, group in enumerate(groups):
        missing = [d for d in group if d not in index]
        if missing:
            raise field_error(f"plan.outer_sync.groups[{g}]", list(group), f"name devices of the run's cluster "
                              f"({', '.join(devices)}); {', '.join(missing)} is not one")
        out.append(tuple(sorted(index[d] for d in group)))
    return tuple(out)


def build_groups(groups: Sequence[Sequence[str]], devices: Sequence[str], rank: int,
                 timeout: timedelta | None = None) -> DiLoCoGroups:
    """Create every group's process group and the leaders' one (a collective: every rank, same order)."""
    ranks = group_ranks(groups, devices)
    kwargs = {} if timeout is None else {"timeout": timeout}
    created = [dist.new_group(list(members), **kwargs) for members in ranks]
    leaders = dist.new_group([members[0] for members in ranks], **kwargs)
    index = next(g for g, members in enumerate(ranks) if rank in members)
    return DiLoCoGroups(index, ranks, created[index], leaders if rank == ranks[index][0] else None)
