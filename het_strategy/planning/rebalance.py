"""Re-planning a running data-parallel plan from measured per-rank speeds.

The straggler callback measures each rank's compute seconds per sample; the
cost model's datasheet figures are then stale for the ranks that slowed down
(or recovered).  ``rebalance`` makes the next Plan from those measurements:

1. rank r on n samples costs ``n x seconds_per_sample[r]`` (the measured
   per-sample time already holds the device's real speed and any slowdown);
2. the shares are the exact integer min-max of those costs
   (``allocation.allocate_min_max``), within each rank's ``minimum``/``cap``;
3. the new Plan (``with_shares``) keeps the old one's cluster, model, batch, dtype and ZeRO
   stage and each rank's micro-batch size (clipped to its new share); a rank
   given 0 samples has no pipeline (idle: a DDP runtime keeps it in step with
   weight-0 filler samples);
4. ``predicted`` is re-priced: the slowest rank's measured compute plus the
   old plan's gradient sync and update (a DP sync moves the same bytes
   whatever the split), with ``source: measured`` and the per-sample times.

The result is a whole Plan, so the runtime that applies it (``apply_plan``)
runs, reports and checkpoints exactly what was planned.
"""

from __future__ import annotations

from typing import Any, Sequence

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.errors import field_error
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.planning.allocation import allocate_min_max

__all__ = ["rebalance", "with_shares"]


def rebalance(plan: Plan, cluster: ClusterSpec, seconds_per_sample: Sequence[float],
              minimum: Sequence[int] | None = None, cap: Sequence[int | None] | None = None) -> Plan | None:
    """The plan whose shares minimise the slowest rank's measured compute; None if the bounds can't hold the batch.

    Args:
        plan: the pure data-parallel plan being run.
        cluster: its cluster; rank r plays ``cluster.devices[r]``.
        seconds_per_sample: measured compute seconds per sample of each rank, in rank order.
        minimum: least samples per rank (default 0).
        cap: most samples per rank (``None`` entries: no cap).
    """
    if not plan.is_pure_dp:
        raise field_error("plan.mode", plan.mode, "be a pure data-parallel plan to rebalance by measured speeds")
    names = [d.name for d in cluster.devices]
    if list(plan.cluster_devices) != names:
        raise field_error("plan.cluster_devices", list(plan.cluster_devices),
                          f"equal the devices of cluster `{cluster.name}` in rank order ({names})")
    if len(seconds_per_sample) != len(names) or not all(t > 0 for t in seconds_per_sample):
        raise field_error("seconds_per_sample", list(seconds_per_sample),
                          f"give one time > 0 per rank ({len(names)} ranks)")
    times = [float(t) for t in seconds_per_sample]
    shares = allocate_min_max([_linear(t) for t in times], plan.global_batch_size, minimum=minimum, cap=cap)
    if shares is None:
        return None
    compute = [n * t for n, t in zip(shares, times)]
    sync_and_update = float(plan.predicted.get("sync_time_s", 0.0)) + float(plan.predicted.get("update_time_s", 0.0))
    step = max(compute) + sync_and_update
    predicted = {**plan.predicted, "source": "measured", "step_time_s": step,
                 "samples_per_s": plan.global_batch_size / step if step > 0 else 0.0,
                 "pipeline_times_s": [c for c, n in zip(compute, shares) if n > 0],
                 "measured_seconds_per_sample": dict(zip(names, times))}
    return with_shares(plan, cluster, shares, predicted)


def with_shares(plan: Plan, cluster: ClusterSpec, shares: Sequence[int],
                predicted: dict[str, Any] | None = None) -> Plan:
    """``plan`` (pure data parallel) with rank r taking ``shares[r]`` samples of every global batch.

    Each rank keeps its micro-batch size, clipped to its share (a rank new to the
    plan takes the plan's smallest); a share of 0 leaves the device idle.
    ``predicted`` replaces the old figures (default: none, they no longer hold).
    """
    names = [d.name for d in cluster.devices]
    if len(shares) != len(names) or sum(shares) != plan.global_batch_size or min(shares) < 0:
        raise field_error("shares", list(shares), f"give {len(names)} counts >= 0 (one per rank) summing to the "
                          f"plan's global batch {plan.global_batch_size}")
    old = {p.stages[0].devices[0]: p for p in plan.pipelines}
    smallest_mbs = min(p.micro_batch_size for p in plan.pipelines)
    num_layers = plan.pipelines[0].stages[0].layers[1]
    pipelines = []
    for name, n in zip(names, shares):
        if n > 0:
            mbs = old[name].micro_batch_size if name in old else smallest_mbs
            pipelines.append(Pipeline((Stage((name,), (0, num_layers)),), min(mbs, n), int(n)))
    return Plan(cluster=plan.cluster, cluster_devices=plan.cluster_devices, model=dict(plan.model),
                global_batch_size=plan.global_batch_size, pipelines=tuple(pipelines), zero_stage=plan.zero_stage,
                dtype=plan.dtype, device_dtypes=dict(plan.device_dtypes), mode="dp", experts=dict(plan.experts), predicted=predicted or {},
                idle_reasons={name: plan.idle_reasons.get(name, "given 0 samples when the plan was rebalanced")
                              for name, n in zip(names, shares) if n == 0})

class _linear:
    """n -> n x seconds (a class, so equal rates share one group in ``allocate_min_max``)."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, n: int) -> float:
        return n * self.seconds

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _linear) and other.seconds == self.seconds

    def __hash__(self) -> int:
        return hash(self.seconds)
