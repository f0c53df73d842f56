"""Which global expert ids live on which rank: checked, uniform, or from a Plan's expert map.

A placement of one MoE layer is a list with one entry per rank of the
expert-parallel group: the global expert ids that rank holds, in order.  Every
id in ``0 .. num_experts - 1`` appears exactly once over the ranks (no
replicas in this version), and every rank holds at least one expert (a rank
with none would still route tokens, but its share of the expert compute is
zero and the plan says nothing about it).  Tokens go to the rank that holds
their expert: ``owner[e]``; the rank lays out the tokens it receives by its own
expert order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from het_strategy.core.errors import field_error

__all__ = ["ExpertPlacement", "uniform_placement", "placement_from_counts", "check_placement",
           "placements_from_plan"]


@dataclass(frozen=True)
class ExpertPlacement:
    """One MoE layer's experts over the ranks of its group (checked by ``check_placement``)."""

    ranks: tuple[tuple[int, ...], ...]
    """``ranks[r]``: the global expert ids rank r holds, in its local order."""

    @property
    def num_experts(self) -> int:
        return sum(len(ids) for ids in self.ranks)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def counts(self) -> list[int]:
        return [len(ids) for ids in self.ranks]

    def owner(self) -> list[int]:
        """``owner[e]``: the rank holding expert e."""
        out = [0] * self.num_experts
        for r, ids in enumerate(self.ranks):
            for e in ids:
                out[e] = r
        return out

    def slots(self) -> list[int]:
        """``slot[e]``: e's position when the experts are listed rank by rank, each rank in its local order."""
        out = [0] * self.num_experts
        for s, e in enumerate(e for ids in self.ranks for e in ids):
            out[e] = s
        return out


def check_placement(placement: Any, num_experts: int, world_size: int, field: str = "placement") -> ExpertPlacement:
    """``placement`` (one id list per rank) as an ``ExpertPlacement``, or ConfigError naming what is wrong."""
    if isinstance(placement, ExpertPlacement):
        placement = [list(ids) for ids in placement.ranks]
    if isinstance(placement, (str, bytes)) or not isinstance(placement, Sequence):
        raise field_error(field, placement, f"be a list of {world_size} expert-id lists, one per rank")
    if len(placement) != world_size:
        raise field_error(field, placement, f"have one expert-id list per rank of the group ({world_size}); "
                          f"it has {len(placement)}")
    seen: dict[int, int] = {}
    ranks = []
    for r, ids in enumerate(placement):
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise field_error(f"{field}[{r}]", ids, "be a list of expert ids")
        if len(ids) == 0:
            raise field_error(f"{field}[{r}]", list(ids), "hold at least one expert (every rank of the group "
                              "runs expert compute; give a slow rank one expert rather than none)")
        for e in ids:
            if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < num_experts:
                raise field_error(f"{field}[{r}]", list(ids), f"hold expert ids in 0..{num_experts - 1}; "
                                  f"{e!r} is not one")
            if e in seen:
                raise field_error(f"{field}[{r}]", list(ids), f"name each expert once; expert {e} is also on "
                                  f"rank {seen[e]} (replicated experts are not supported)")
            seen[e] = r
        ranks.append(tuple(int(e) for e in ids))
    missing = sorted(set(range(num_experts)) - set(seen))
    if missing:
        raise field_error(field, [list(ids) for ids in placement],
                          f"place every expert 0..{num_experts - 1}; missing {missing}")
    return ExpertPlacement(tuple(ranks))


def placement_from_counts(counts: Sequence[int], num_experts: int, field: str = "placement") -> ExpertPlacement:
    """Contiguous id ranges: rank 0 gets the first ``counts[0]`` ids, and so on."""
    if sum(counts) != num_experts:
        raise field_error(field, list(counts), f"sum to num_experts ({num_experts})")
    ids, start = [], 0
    for n in counts:
        ids.append(list(range(start, start + n)))
        start += n
    return check_placement(ids, num_experts, len(counts), field)


def uniform_placement(num_experts: int, world_size: int, field: str = "num_experts") -> ExpertPlacement:
    """The same number of experts on every rank (DeepSpeed's rule: ``num_experts % world_size == 0``)."""
    if num_experts < world_size:
        raise field_error(field, num_experts, f"be >= the expert-parallel group size ({world_size}) so every "
                          "rank holds an expert")
    if num_experts % world_size:
        raise field_error(field, num_experts, f"be a multiple of the group size ({world_size}) for a uniform "
                          "placement", "give an explicit placement or a Plan's expert map")
    return placement_from_counts([num_experts // world_size] * world_size, num_experts, field)


def placements_from_plan(experts: dict[int, dict[str, list[int]]], devices: Sequence[str],
                         num_experts: Sequence[int]) -> list[ExpertPlacement]:
    """A Plan's ``experts`` (``{layer: {device: ids}}``) as one placement per MoE layer, rank r = ``devices[r]``.

    The plan's MoE layers, in layer order, are the model's HeteroMoE layers in
    module order.
    """
    layers = sorted(experts)
    if len(layers) != len(num_experts):
        raise field_error("plan.experts", sorted(experts), f"place the model's {len(num_experts)} HeteroMoE "
                          f"layer(s); it places {len(layers)}")
    out = []
    for layer, n in zip(layers, num_experts):
        mapping = experts[layer]
        unknown = sorted(set(mapping) - set(devices))
        if unknown:
            raise field_error(f"plan.experts[{layer}]", unknown, f"name devices of the run ({list(devices)})")
        out.append(check_placement([list(mapping.get(d, [])) for d in devices], n, len(devices),
                                   f"plan.experts[{layer}]"))
    return out
