"""Which global rank holds which layers, replica by replica, and who reduces each layer's gradients with whom.

A Plan's pipelines ("replicas") may differ in length and boundaries (an
asymmetric plan: one fast device holding every layer beside a two-stage
pipeline of slow ones).  Each replica holds every layer exactly once (tp =
1), so layer ``l`` is held by one rank per replica: its *holder set*.  The
gradient of ``l`` is reduced over exactly that set.  Layers with the same
holder set share one process group and one flat allreduce; the groups are
created once, in the order of ``ReplicaLayout.holder_sets`` on every rank,
and the reductions run in that same order, so no two ranks ever wait on each
other in opposite orders.

Pure Python (no torch): the runtime and the tests read the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from het_strategy.core.plan import Plan
from het_strategy.core.runtime_rules import shares_boundaries
from het_strategy.ds_runtime.config import rank_layout

__all__ = ["ReplicaLayout", "replica_layout"]


@dataclass(frozen=True)
class ReplicaLayout:
    """Per replica: the global rank of each stage and the stage boundaries ``[0, b1, ..., L]``."""

    stage_ranks: tuple[tuple[int, ...], ...]
    """``stage_ranks[p][s]``: the global rank running stage ``s`` of replica ``p``."""
    parts: tuple[tuple[int, ...], ...]
    """``parts[p]``: replica ``p``'s boundaries; stage ``s`` holds layers ``[parts[p][s], parts[p][s + 1])``."""
    is_aligned: bool
    """Every replica has the same boundaries (``core.runtime_rules.shares_boundaries``): DeepSpeed's own grid of
    stages x replicas runs it."""

    @property
    def num_replicas(self) -> int:
        return len(self.stage_ranks)

    @property
    def num_layers(self) -> int:
        return self.parts[0][-1]

    @property
    def world_size(self) -> int:
        return sum(len(r) for r in self.stage_ranks)

    def where(self, rank: int) -> tuple[int, int]:
        """``(replica, stage)`` of a global rank."""
        for p, ranks in enumerate(self.stage_ranks):
            if rank in ranks:
                return p, ranks.index(rank)
        raise KeyError(rank)

    def layers_of(self, rank: int) -> tuple[int, int]:
        """The ``[start, stop)`` layer range a rank holds."""
        p, s = self.where(rank)
        return self.parts[p][s], self.parts[p][s + 1]

    def holders(self, layer: int) -> tuple[int, ...]:
        """The rank holding ``layer`` in each replica, in replica order (replica 0's is the broadcast source)."""
        out = []
        for ranks, parts in zip(self.stage_ranks, self.parts):
            stage = next(s for s in range(len(ranks)) if parts[s] <= layer < parts[s + 1])
            out.append(ranks[stage])
        return tuple(out)

    @property
    def holder_sets(self) -> tuple[tuple[int, ...], ...]:
        """The distinct holder sets, in the one order every rank creates and reduces them in."""
        return tuple(sorted({self.holders(layer) for layer in range(self.num_layers)}))

    def layers_by_holders(self, rank: int) -> list[tuple[tuple[int, ...], list[int]]]:
        """This rank's layers grouped by holder set, in ``holder_sets`` order."""
        start, stop = self.layers_of(rank)
        out = []
        for hs in self.holder_sets:
            if rank in hs:
                out.append((hs, [layer for layer in range(start, stop) if self.holders(layer) == hs]))
        return out


def replica_layout(plan: Plan) -> ReplicaLayout:
    """The plan's replicas on the global ranks of ``rank_layout`` (plan order when the replicas differ)."""
    ranks: list[list[int]] = [[-1] * len(p.stages) for p in plan.pipelines]
    for ra in rank_layout(plan):
        ranks[ra.pipeline][ra.stage] = ra.rank
    return ReplicaLayout(stage_ranks=tuple(tuple(r) for r in ranks),
                         parts=tuple(tuple(p.boundaries()) for p in plan.pipelines),
                         is_aligned=shares_boundaries(plan))
