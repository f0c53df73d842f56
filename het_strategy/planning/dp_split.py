"""Uneven data parallelism: integer per-rank shares of the global batch.

Every device is a one-stage pipeline holding the whole model (plain DDP).
Its time on b samples, g_i(b), is the best over micro-batch sizes that fit its
memory of (n - 1) micro-batches of size m plus one of the remainder — a
non-decreasing function — so the exact min-max allocation in
``allocation.allocate_min_max`` gives the optimal integer shares (not
proportional rounding).  Every device that runs gets at least one sample; a
device is left idle when the plan without it is faster or it cannot hold a
replica (``idle.best_device_set``: the search over device sets and the reason
recorded for each idle device in ``Plan.idle_reasons``).
"""

from __future__ import annotations

from het_strategy.core.cost_model import CostModel
from het_strategy.core.errors import field_error
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.planning.idle import best_device_set
from het_strategy.planning.structure import StructureResult, plan_from_pipelines

__all__ = ["plan_data_parallel", "equal_split_plan"]


def plan_data_parallel(cm: CostModel) -> StructureResult | None:
    """Optimal uneven data-parallel plan over the devices worth using (None if the model fits on none).

    Devices left idle (too slow, sync too dear, no memory for a replica, no sample left) carry their
    reason in ``plan.idle_reasons``.
    """
    n = cm.cluster.num_devices
    if cm.settings.global_batch_size < n:
        raise field_error("settings.global_batch_size", cm.settings.global_batch_size,
                          f"be >= the number of data-parallel ranks ({n}): every launched rank takes part in "
                          "every step", "to use fewer devices, leave them out of the cluster")
    return best_device_set(cm)[0]


def equal_split_plan(cm: CostModel) -> Plan:
    """The plain-DDP baseline: the global batch split as evenly as integers allow, same micro-batch everywhere."""
    devices = [d.name for d in cm.cluster.devices]
    B, n = cm.settings.global_batch_size, len(devices)
    if B < n:
        raise field_error("settings.global_batch_size", B, f"be >= the number of ranks ({n})")
    shares = [B // n + (1 if i < B % n else 0) for i in range(n)]
    L = cm.workload.num_layers
    m = max((m for m in cm.settings.micro_batch_sizes if m <= min(shares)), default=1)
    pipes = [Pipeline((Stage((d,), (0, L)),), m, b) for d, b in zip(devices, shares)]
    return plan_from_pipelines(cm, pipes, "equal")
