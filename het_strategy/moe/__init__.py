"""Mixture-of-experts with uneven expert placement.

- ``placement.py``  which global expert ids live on which rank: checked, uniform, from a Plan
- ``gating.py``     top-k routing with capacity, noisy gates and the load-balancing loss
- ``dispatch.py``   the differentiable all-to-all with uneven split sizes
- ``padding.py``    an emulated device's expert compute, padded inside the layer
- ``layer.py``      ``HeteroMoE``, the layer
- ``ddp.py``        expert gradients under DDP (ignored by DDP's allreduce, scaled by 1/world)
"""

from het_strategy.moe.ddp import expert_parameter_names, moe_layers, prepare_for_ddp
from het_strategy.moe.layer import HeteroMoE
from het_strategy.moe.placement import ExpertPlacement, check_placement, placement_from_counts, \
    placements_from_plan, uniform_placement

__all__ = ["HeteroMoE", "ExpertPlacement", "check_placement", "placement_from_counts", "placements_from_plan",
           "uniform_placement", "moe_layers", "expert_parameter_names", "prepare_for_ddp"]
