"""Which ranks hold which layers, replica by replica, and with whom each gradient part is reduced: the holder sets.

A Plan's pipelines ("replicas") may differ in length, boundaries and
tensor-parallel degree (an asymmetric plan: one fast device holding every
layer beside a two-stage pipeline of slow ones; or one A100 at tp 1 beside
two V100s at tp 2).  Stage ``s`` of replica ``p`` runs on a tensor-parallel
group of ranks, ``stage_groups[p][s]`` (one rank when tp = 1).

Gradients are reduced over *holder sets*, the ranks holding the same part of
a parameter: a unit of a sharded parameter (``unit_holders``) or a whole
replicated one (``layer_holders``); ``ReplicaLayout``'s docstring says which
is which.  With tp = 1 everywhere both sets are the rank holding ``l`` in each
replica.  A tied matrix (tied embeddings, ``tied``) is one set: every rank holding the first or last layer.

Invariant: sets with the same ranks share one process group and one flat
allreduce; the groups are created once, in the order of ``holder_sets`` on
every rank, and the reductions run in that same order, so no two ranks ever
wait on each other in opposite orders.

The runtime (``ds_runtime.replicas.replica_layout`` numbers the ranks, ``ds_runtime.holder_reduction`` reduces) and
the cost model (``core.holder_sync`` prices the same sets in the same order) read this one layout.

Planning core: pure Python (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

__all__ = ["ReplicaLayout"]


@dataclass(frozen=True)
class ReplicaLayout:
    """Per replica and stage: the tensor-parallel group of global ranks, and the stage boundaries.

    Holder sets, the ranks holding the same part of a parameter of layer ``l``:

    - a **sharded** parameter (split by ``tensor_parallel``: a column- or
      row-parallel linear) of layer ``l`` is cut into ``units(l)`` equal units,
      the largest tp holding ``l`` (every other tp divides it:
      ``core.runtime_rules``).  In a replica at tp ``t``, tp rank ``r`` holds
      units ``[r u/t, (r + 1) u/t)``; unit ``k``'s holder set is one rank per
      replica (``unit_holders``).
    - a **replicated** parameter (a LayerNorm, a row-parallel bias, every
      parameter at tp 1) is whole on every rank of each stage holding ``l``; its
      holder set is all of them (``layer_holders``), and each rank scales its
      gradient by ``1 / tp`` of its stage before the sum, so every replica counts
      once.
    """

    stage_groups: tuple[tuple[tuple[int, ...], ...], ...]
    """``stage_groups[p][s]``: the global ranks running stage ``s`` of replica ``p``, in tp-rank order."""
    parts: tuple[tuple[int, ...], ...]
    """``parts[p]``: replica ``p``'s boundaries; stage ``s`` holds layers ``[parts[p][s], parts[p][s + 1])``."""
    is_aligned: bool
    """Every replica has the same boundaries (``core.runtime_rules.shares_boundaries``)."""
    per_replica: bool
    """Each replica runs as its own pipeline (``core.runtime_rules.runs_per_replica``: asymmetric, tp > 1, ...);
    otherwise DeepSpeed's own grid of stages x replicas runs the plan."""
    tied: tuple[tuple[int, str], ...] = ()
    """Parameters the first and the last layer share (tied embeddings), as ``(layer, name in the layer)``
    (``tied_weights.tied_parameters``): reduced over ``tied_holders``, one copy per rank holding either layer."""

    @property
    def stage_ranks(self) -> tuple[tuple[int, ...], ...]:
        """``stage_ranks[p][s]``: the lead (tp rank 0) of stage ``s`` of replica ``p``."""
        return tuple(tuple(group[0] for group in groups) for groups in self.stage_groups)

    @property
    def num_replicas(self) -> int:
        return len(self.stage_groups)

    @property
    def num_layers(self) -> int:
        return self.parts[0][-1]

    @property
    def world_size(self) -> int:
        return sum(len(g) for groups in self.stage_groups for g in groups)

    @property
    def has_tensor_parallel(self) -> bool:
        return any(len(g) > 1 for groups in self.stage_groups for g in groups)

    def where(self, rank: int) -> tuple[int, int]:
        """``(replica, stage)`` of a global rank."""
        for p, groups in enumerate(self.stage_groups):
            for s, group in enumerate(groups):
                if rank in group:
                    return p, s
        raise KeyError(rank)

    def group_of(self, rank: int) -> tuple[int, ...]:
        """The tensor-parallel group (the stage's ranks) ``rank`` belongs to."""
        p, s = self.where(rank)
        return self.stage_groups[p][s]

    def layers_of(self, rank: int) -> tuple[int, int]:
        """The ``[start, stop)`` layer range a rank holds."""
        p, s = self.where(rank)
        return self.parts[p][s], self.parts[p][s + 1]

    @cached_property
    def _stage_of(self) -> tuple[tuple[int, ...], ...]:
        """``_stage_of[p][l]``: the stage of replica ``p`` holding layer ``l``."""
        return tuple(tuple(s for s in range(len(parts) - 1) for _ in range(parts[s], parts[s + 1]))
                     for parts in self.parts)

    @cached_property
    def _units(self) -> tuple[int, ...]:
        return tuple(max(len(self._group_holding(p, layer)) for p in range(self.num_replicas))
                     for layer in range(self.num_layers))

    def _group_holding(self, replica: int, layer: int) -> tuple[int, ...]:
        return self.stage_groups[replica][self._stage_of[replica][layer]]

    def units(self, layer: int) -> int:
        """The units a sharded parameter of ``layer`` is reduced in: the largest tp holding it."""
        return self._units[layer]

    def unit_holders(self, layer: int, unit: int) -> tuple[int, ...]:
        """The rank holding unit ``unit`` of ``layer``'s sharded parameters in each replica, in replica order."""
        out = []
        units = self.units(layer)
        for p in range(self.num_replicas):
            group = self._group_holding(p, layer)
            out.append(group[unit * len(group) // units])
        return tuple(out)

    def layer_holders(self, layer: int) -> tuple[int, ...]:
        """Every rank holding (part of) ``layer``, replica by replica in tp order: the set of its replicated
        parameters (replica 0's lead first: the broadcast source)."""
        return tuple(r for p in range(self.num_replicas) for r in self._group_holding(p, layer))

    def holders(self, layer: int) -> tuple[int, ...]:
        """The lead rank holding ``layer`` in each replica, in replica order."""
        return tuple(self._group_holding(p, layer)[0] for p in range(self.num_replicas))

    @property
    def tied_holders(self) -> tuple[int, ...]:
        """Every rank holding the first or the last layer, replica by replica (each once: a rank holding both keeps
        one copy): the holder set of the ``tied`` parameters (replica 0's first stage first: the broadcast source)."""
        out: list[int] = []
        for p in range(self.num_replicas):
            for layer in (0, self.num_layers - 1):
                out += [r for r in self._group_holding(p, layer) if r not in out]
        return tuple(out)

    def is_tied(self, layer: int, name: str) -> bool:
        """``name`` of ``layer`` is a copy of the tied matrix."""
        return (layer, name) in self.tied

    @property
    def holder_sets(self) -> tuple[tuple[int, ...], ...]:
        """Every distinct holder set (units, whole layers, the tied matrix), in the one order every rank creates and
        reduces them in."""
        sets = {self.tied_holders} if self.tied else set()
        for layer in range(self.num_layers):
            sets.add(self.layer_holders(layer))
            sets.update(self.unit_holders(layer, u) for u in range(self.units(layer)))
        return tuple(sorted(sets))

    def layers_by_holders(self, rank: int) -> list[tuple[tuple[int, ...], list[int]]]:
        """This rank's layers grouped by ``layer_holders``, in ``holder_sets`` order."""
        start, stop = self.layers_of(rank)
        by_set: dict[tuple[int, ...], list[int]] = {}
        for layer in range(start, stop):
            by_set.setdefault(self.layer_holders(layer), []).append(layer)
        return [(hs, by_set[hs]) for hs in self.holder_sets if hs in by_set]
