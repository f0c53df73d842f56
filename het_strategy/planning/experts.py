"""MoE expert placement: non-uniform expert counts per device by speed and memory.

For every MoE layer, the devices holding it (one stage per pipeline; all
devices of a tensor-parallel group count as one holder, its first device
listed) form the expert-parallel group.  Tokens are routed uniformly, so a
holder with n of E experts runs n/E of the group's routed tokens; its expert
time is proportional to n / speed.  Experts are integer and each holder must
keep at least one, so the counts come from the exact min-max allocation,
capped by the memory each holder has left after its stage's dense part.
Expert ids are then given out in contiguous ranges, holder by holder.
"""

from __future__ import annotations

from enum import StrEnum

from het_strategy.core.cost_model import CostModel
from het_strategy.core.plan import Plan
from het_strategy.planning.allocation import allocate_min_max

__all__ = ["MoEPlacement", "place_experts", "expert_counts_by_speed"]


class MoEPlacement(StrEnum):
    """Where the experts of an MoE model live (het-train's ``moe.placement``; ``HeteroStrategy(moe_placement=...)``,
    which also takes one placement per layer)."""

    planned = "planned"
    """Experts per device by its speed and memory (or the given plan's map)."""
    uniform = "uniform"
    """The same count of experts on every rank."""


def place_experts(cm: CostModel, plan: Plan) -> dict[int, dict[str, list[int]]]:
    """``{layer: {device: [expert ids]}}`` for every MoE layer of the workload."""
    placement: dict[int, dict[str, list[int]]] = {}
    dp = plan.num_pipelines
    for layer, cost in enumerate(cm.workload.layers):
        moe = cost.moe
        if moe is None:
            continue
        holders = []
        for pipe in plan.pipelines:
            for stage in pipe.stages:
                if stage.layers[0] <= layer < stage.layers[1]:
                    holders.append((stage, pipe))
        if len(holders) > moe.num_experts:
            continue  # more holders than experts: keep every expert replicated (no placement)
        rates, caps = [], []
        for stage, pipe in holders:
            dev = cm.cluster.device(stage.devices[0])
            rates.append(dev.flops_per_second(cm.settings.compute_dtype(dev), cm.settings.float32_matmul_precision)
                         * stage.tp)
            # memory left for this layer's experts after the stage's dense part (and all its other experts)
            n_flight = min(len(pipe.stages) - pipe.stages.index(stage), pipe.num_micro_batches)
            used = cm.stage_memory_bytes(stage.layers[0], stage.layers[1], stage.tp, pipe.micro_batch_size,
                                         n_flight, dp, experts_held={layer: 0})
            per_expert = moe.params_per_expert / stage.tp * cm.settings.state_bytes_per_param(dp)
            caps.append(max(1, int((cm.memory_budget_bytes(dev, stage.tp) - used) // per_expert)))
        counts = expert_counts_by_speed(rates, moe.num_experts, caps)
        if counts is None:
            continue
        ids = iter(range(moe.num_experts))
        placement[layer] = {stage.devices[0]: [next(ids) for _ in range(n)]
                            for (stage, _), n in zip(holders, counts)}
    return placement


def expert_counts_by_speed(rates: list[float], num_experts: int, caps: list[int] | None = None) -> list[int] | None:
    """Experts per holder minimising the slowest holder's expert time (n / rate), each holding >= 1 and <= its cap.

    None when the experts cannot be placed (fewer experts than holders, or the caps too small).
    """
    costs = [lambda n, rate=rate: n / rate for rate in rates]
    return allocate_min_max(costs, num_experts, minimum=[1] * len(rates), cap=caps)
